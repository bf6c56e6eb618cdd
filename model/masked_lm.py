"""A masked language model: the encoder, and over each token a head that scores every entry
of the vocabulary as the token that belongs there.

    logits = decoder(LayerNorm(act(dense(h))))        decoder: x · Eᵀ + b

E is the vocabulary's embedding matrix, in most checkpoints the very word embeddings the
encoder starts from (tied), so a token's score for an entry is how close its transformed
state lies to that entry's embedding. SPLADE reads these scores as term weights
(model/sparse.py).
"""

import torch
from torch import nn

from attnserve.model.config import VocabularyHeadConfig
from attnserve.model.families import AnyEncoder
from attnserve.model.feed_forward import activation


class VocabularyHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, config: VocabularyHeadConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(hidden_size, hidden_size, bias=config.dense_bias)
        self.act = activation(config.activation)
        self.norm = nn.LayerNorm(hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.decoder = nn.Linear(hidden_size, vocab_size, bias=config.decoder_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, vocab) logits."""
        return self.decoder(self.norm(self.act(self.dense(hidden))))


class MaskedLanguageModel(nn.Module):
    def __init__(self, encoder: AnyEncoder, head: VocabularyHeadConfig):
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        self.head = VocabularyHead(encoder.config.hidden_size, encoder.config.vocab_size, head)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq) -> (batch, seq, vocab) logits."""
        return self.head(self.encoder(input_ids, attention_mask).last_hidden_state)
