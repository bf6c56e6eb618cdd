"""Sparse heads: a weight for each vocabulary entry a text holds, most of them zero, as a
lexical index (an inverted list per entry) scores texts by the entries they share.

SPLADE takes the masked language model's score of every vocabulary entry at every token
(model/masked_lm.py), squashed so that a few large scores do not dominate and negatives
count for nothing,

    f(x) = log(1 + ReLU(x))          (log1p_relu: log(1 + f(x)), a flatter squash)

and keeps, for each entry, the largest over the text's tokens:

    w_v = max_t f(logits[t, v])      (sum: Σ_t f(logits[t, v]), SPLADE's first version)

Padding tokens' scores are multiplied by zero first, and f(0) = 0: they never add to a
weight. Since f never decreases, max_t f(x_t) = f(max_t x_t), so the largest score is taken
first and only the [batch, vocab] row is squashed.

Lexical weights (bge-m3) are one weight per token instead, ReLU(w · h_t + b); a text's
weight for an entry is then its tokens' largest, which the server takes per token id.
"""

import torch
from torch import nn

from attnserve.model.masked_lm import VocabularyHead

SPLADE_POOLINGS = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


class SpladeHead(nn.Module):
    """(batch, seq, hidden) token states -> (batch, vocab) weights."""

    def __init__(self, vocabulary: VocabularyHead, pooling: str = "max", activation: str = "relu"):
        super().__init__()
        self.vocabulary = vocabulary
        self.pooling, self.activation = pooling, activation

    def squash(self, scores: torch.Tensor) -> torch.Tensor:
        weights = torch.log1p(torch.relu(scores))
        return torch.log1p(weights) if self.activation == "log1p_relu" else weights

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        scores = self.vocabulary(hidden) * attention_mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "max":
            return self.squash(scores.amax(dim=1))
        return self.squash(scores).sum(dim=1)


class LexicalWeights(nn.Module):
    """(batch, seq, hidden) token states -> (batch, seq) weights, zero at padding."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(hidden)).squeeze(-1) * attention_mask.to(hidden.dtype)
