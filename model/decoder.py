"""A decoder's blocks used as an encoder (Qwen3, Gemma3): token embeddings, pre-norm
blocks of rotary attention and a gated feed-forward, a final RMSNorm; the hidden state of
every token is the output, as for the encoders.

    x = x + post_norm(attention(norm(x)))         post_norm: Gemma3's only
    x = x + post_norm(feed_forward(norm(x)))

Attention has fewer key/value heads than query heads (GQA) and normalises each head's
query and key before rotating them. Qwen3 attends causally, so a token's state reads only
what came before it and a sequence is best summed up by its last token; Gemma3 as
EmbeddingGemma attends both ways, alternating local layers (a window around each token)
with global ones, each kind with a RoPE base of its own.
"""

import torch
from torch import nn

from attnserve.model.attention import MultiHeadAttention
from attnserve.model.config import DecoderConfig
from attnserve.model.feed_forward import GatedFeedForward
from attnserve.model.layer_kinds import LayerKindStack
from attnserve.model.positions import RotaryEmbedding


class RMSNorm(nn.Module):
    """x / √(mean(x²) + ε), scaled per channel by (offset + weight): LayerNorm without the
    mean or the bias. Gemma stores its scales as offsets from one (offset 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * (self.offset + self.weight) if self.offset else self.weight * normed


def _norm(config: DecoderConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or config.hidden_size, config.layer_norm_eps, config.norm_offset)


class DecoderBlock(nn.Module):
    def __init__(self, config: DecoderConfig, index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.local = config.layer_types[index] == "local"
        self.attention_norm = _norm(config)
        self.attention = MultiHeadAttention(
            config.hidden_size, config.num_heads, rotary, bias=config.attention_bias,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, causal=config.causal,
            scale=config.query_scale, query_norm=_norm(config, config.head_dim),
            key_norm=_norm(config, config.head_dim))
        self.post_attention_norm = _norm(config) if config.sandwich_norms else nn.Identity()
        self.feed_forward_norm = _norm(config)
        self.feed_forward = GatedFeedForward(config.hidden_size, config.intermediate_size, config.activation)
        self.post_feed_forward_norm = _norm(config) if config.sandwich_norms else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.attention_norm(x)
        attended, probs = self.attention(normed, normed, normed, mask)
        x = x + self.post_attention_norm(attended)
        x = x + self.post_feed_forward_norm(self.feed_forward(self.feed_forward_norm(x)))
        return x, probs


class Decoder(LayerKindStack):
    def __init__(self, config: DecoderConfig):
        super().__init__(config, DecoderBlock, _norm(config))
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.word(input_ids)
        if self.config.embedding_scale:
            # A float32 constant, as Gemma multiplies by it.
            return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        return x
