"""Hugging Face's model of a checkpoint's family (BertModel for BERT, RobertaModel, …) on
its own weights: a reference that shares no code with our model, the export, the graphs
or the server, so the end-to-end tests compare what a caller gets with an implementation
they did not write. Eager attention, so it returns its maps (transformers 5.x returns none
with its default SDPA attention)."""

from pathlib import Path

import numpy as np

# The tiny model's float16 graphs against this reference in float32, for the export test
# and the fp16 serving test alike. The graphs reach hidden states within 3.5e-3 and
# attention maps within 9.4e-6 (x86-64, onnxruntime 1.31); the export's own gate is 5e-2.
FP16_HIDDEN_ATOL = 8e-3
FP16_MAPS_ATOL = 5e-5


class HuggingFace:
    def __init__(self, checkpoint: Path):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        self.model = AutoModel.from_pretrained(str(checkpoint), attn_implementation="eager").eval()

    def ids(self, text: str) -> list[int]:
        """The text as the checkpoint's tokenizer turns it into ids, special tokens included."""
        return self.tokenizer(text, truncation=False)["input_ids"]

    def run(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """One unpadded sequence: hidden states (tokens, hidden) and every layer's attention
        probabilities (layers, heads, tokens, tokens)."""
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids]), output_attentions=True)
        maps = np.stack([layer[0].numpy() for layer in out.attentions])
        return out.last_hidden_state[0].numpy(), maps
