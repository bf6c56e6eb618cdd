"""Trace the PyTorch encoder into ONNX graphs with dynamic batch and sequence axes."""

from pathlib import Path

import torch
from torch import nn

from attnserve.artifact import HIDDEN_OUTPUT, INPUT_NAMES, attention_output
from attnserve.model import Encoder

# The TorchScript exporter at opset 17: torch 2.13's default dynamo exporter writes a
# graph whose attention onnxruntime's optimiser cannot fuse, and which runs slower.
OPSET = 17


class _GraphOutputs(nn.Module):
    """The encoder with a flat tuple of outputs, as ONNX wants them."""

    def __init__(self, encoder: Encoder, attention: bool):
        super().__init__()
        self.encoder = encoder
        self.attention = attention

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.encoder(input_ids, attention_mask, output_attentions=self.attention)
        if self.attention:
            return (out.last_hidden_state, *out.attentions)
        return out.last_hidden_state


def output_names(encoder: Encoder, attention: bool) -> list[str]:
    names = [HIDDEN_OUTPUT]
    if attention:
        names += [attention_output(i) for i in range(encoder.config.num_layers)]
    return names


def export_graph(encoder: Encoder, path: Path, attention: bool) -> list[str]:
    """Write one fp32 graph; returns its output names."""
    outputs = output_names(encoder, attention)
    # Trace at a shape no test uses, so a graph that baked in the tracing shape fails
    # the parity checks at other lengths instead of passing by coincidence.
    batch, seq = 3, 7
    input_ids = torch.randint(0, encoder.config.vocab_size, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    attention_mask[1, 5:] = 0
    dynamic = {name: {0: "batch", 1: "seq"} for name in (*INPUT_NAMES, HIDDEN_OUTPUT)}
    dynamic |= {name: {0: "batch", 2: "seq", 3: "seq"} for name in outputs[1:]}
    with torch.no_grad():
        torch.onnx.export(
            _GraphOutputs(encoder, attention).eval(),
            (input_ids, attention_mask),
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )
    return outputs
