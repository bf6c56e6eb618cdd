"""Late interaction (ColBERT): instead of one vector a text, a small vector for every token,
each the token's state projected down (one or more linear layers) and brought to unit
length. A query is scored against a document by MaxSim: each query vector's best cosine
among the document's vectors, summed over the query's vectors (or their mean), so every
query token finds its own match.

Which tokens' vectors a caller gets is a matter of tokenization the server applies (a
query's expansion positions, a document's punctuation left out, bge-m3's [CLS] left out):
the head gives one at every position.
"""

import torch
from torch import nn

from attnserve.model.pooling import normalize


class TokenVectors(nn.Module):
    """(batch, seq, hidden) token states -> (batch, seq, dim) unit vectors."""

    def __init__(self, projection: nn.Module):
        super().__init__()
        self.projection = projection

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return normalize(self.projection(hidden))
