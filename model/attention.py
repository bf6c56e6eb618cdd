"""Scaled dot-product attention with several heads, written the way attention is taught.

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k + bias + mask) V

Q, K and V come from three separate projections; each head attends in its own d_k sized
subspace, and the heads are concatenated and projected. The module takes (query, key,
value) so self-attention passes the same tensor three times and cross-attention passes
another sequence as key and value.

What the families differ by are options and inputs of this one module, never copies of
it: rotary positions (RoPE) turn Q and K; a score bias is added to QKᵀ (MPNet's relative
positions); a causal mask hides every later key (decoders such as Qwen3); fewer key/value
heads than query heads share each K and V among a group of query heads (grouped-query
attention, GQA); a norm per head on Q and K (Qwen3, Gemma3); another scale than 1/√d_k
(Gemma3's query_pre_attn_scalar).
"""

import math

import torch
from torch import nn

from attnserve.model.positions import RotaryEmbedding


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, rotary: RotaryEmbedding | None = None,
                 bias: bool = True, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, causal: bool = False, scale: float | None = None,
                 query_norm: nn.Module | None = None, key_norm: nn.Module | None = None):
        """`rotary`: rotate queries and keys by their positions (RoPE); `bias`: the
        projections add one (ModernBERT's, Qwen3's do not); `num_kv_heads`: heads of K and V,
        each shared by num_heads / num_kv_heads query heads (default: num_heads, one each);
        `head_dim`: each head's width (default hidden_size / num_heads); `causal`: a query
        never sees a later key; `scale`: what Q Kᵀ is multiplied by (default 1/√head_dim);
        `query_norm`, `key_norm`: applied to each head's query and key before RoPE."""
        super().__init__()
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
            head_dim = hidden_size // num_heads
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.d_k = num_heads, num_kv_heads, head_dim
        self.causal = causal
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        # Three separate projections: sharing one matrix would make every query
        # look for exactly what it offers, and the model would degenerate.
        self.w_q = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.w_k = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.w_v = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.w_o = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = rotary
        self.query_norm = query_norm
        self.key_norm = key_norm

    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(batch, seq, heads·d_k) -> (batch, heads, seq, d_k)."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, heads, self.d_k).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, d_k) -> (batch, seq, heads·d_k): the heads side by side."""
        batch, _, seq, _ = x.shape
        return x.transpose(1, 2).reshape(batch, seq, self.num_heads * self.d_k)

    def share_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, kv_heads, seq, d_k) -> (batch, heads, seq, d_k): K/V head i serves query
        heads i·g … i·g + g - 1, g = heads / kv_heads."""
        group = self.num_heads // self.num_kv_heads
        if group == 1:
            return x
        batch, kv_heads, seq, d_k = x.shape
        return x[:, :, None].expand(batch, kv_heads, group, seq, d_k).reshape(
            batch, kv_heads * group, seq, d_k)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None = None,
                score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend from `query` (batch, q_len, hidden) to `key`/`value` (batch, k_len, hidden).

        `mask` is 1 where a query may look and 0 where it may not, broadcastable to
        (batch, heads, q_len, k_len); `score_bias` is added to the scores, broadcastable to
        the same. Returns the output (batch, q_len, hidden) and the attention probabilities
        (batch, heads, q_len, k_len).
        """
        q = self.split_heads(self.w_q(query), self.num_heads)
        k = self.split_heads(self.w_k(key), self.num_kv_heads)
        v = self.split_heads(self.w_v(value), self.num_kv_heads)
        if self.query_norm is not None:
            q, k = self.query_norm(q), self.key_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        k, v = self.share_kv_heads(k), self.share_kv_heads(v)

        # Q Kᵀ / √d_k keeps the scores' variance near 1 so the softmax does not saturate;
        # written as a product with 1/√d_k, the float rounding Hugging Face's BERT uses.
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if score_bias is not None:
            scores = scores + score_bias
        if self.causal:
            later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            mask = ~later if mask is None else mask.bool() & ~later
        if mask is not None:
            # Before the softmax, never after: adding the most negative float turns a
            # blocked score into an exact zero weight, and the rest still sum to one.
            blocked = 1.0 - mask.to(scores.dtype)
            scores = scores + blocked.masked_fill(blocked.bool(), torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)
        return self.w_o(self.merge_heads(context)), probs


def key_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq) of 1 = real token, 0 = padding -> (batch, 1, 1, seq): may a query look
    at key j? Every real key, never padding."""
    return attention_mask[:, None, None, :].bool()


def window_mask(attention_mask: torch.Tensor, radius: int) -> torch.Tensor:
    """(batch, seq) -> (batch, 1, seq, seq): the real keys at most `radius` positions from
    the query, on either side (a local layer's sliding window)."""
    position = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    near = (position[:, None] - position[None, :]).abs() <= radius
    return key_mask(attention_mask) & near
