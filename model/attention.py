"""Scaled dot-product attention with several heads, written the way attention is taught.

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k + mask) V

Q, K and V come from three separate projections; each head attends in its own
d_k = hidden / heads sized subspace, and the heads are concatenated and projected.
The module takes (query, key, value) so self-attention passes the same tensor
three times and cross-attention passes another sequence as key and value.
"""

import math

import torch
from torch import nn

from attnserve.model.positions import RotaryEmbedding


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, rotary: RotaryEmbedding | None = None,
                 bias: bool = True):
        """`rotary`: rotate queries and keys by their positions (RoPE); `bias`: the
        projections add one (ModernBERT's do not)."""
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.d_k = hidden_size // num_heads
        # Three separate projections: sharing one matrix would make every query
        # look for exactly what it offers, and the model would degenerate.
        self.w_q = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.w_k = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.w_v = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.w_o = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.rotary = rotary

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, heads, seq, d_k)."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.num_heads, self.d_k).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, d_k) -> (batch, seq, hidden): the heads side by side."""
        batch, _, seq, _ = x.shape
        return x.transpose(1, 2).reshape(batch, seq, self.num_heads * self.d_k)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend from `query` (batch, q_len, hidden) to `key`/`value` (batch, k_len, hidden).

        `mask` is 1 where a query may look and 0 where it may not, broadcastable to
        (batch, heads, q_len, k_len). Returns the output (batch, q_len, hidden) and the
        attention probabilities (batch, heads, q_len, k_len).
        """
        q = self.split_heads(self.w_q(query))
        k = self.split_heads(self.w_k(key))
        v = self.split_heads(self.w_v(value))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)

        # Q Kᵀ / √d_k keeps the scores' variance near 1 so the softmax does not saturate;
        # written as a product with 1/√d_k, the float rounding Hugging Face's BERT uses.
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.d_k))
        if mask is not None:
            # Before the softmax, never after: adding the most negative float turns a
            # blocked score into an exact zero weight, and the rest still sum to one.
            blocked = 1.0 - mask.to(scores.dtype)
            scores = scores + blocked.masked_fill(blocked.bool(), torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)
        return self.w_o(self.merge_heads(context)), probs
