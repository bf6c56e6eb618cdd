"""ModernBERT: token embeddings then LayerNorm, pre-LN blocks of rotary attention and a
GeGLU feed-forward, a final LayerNorm; no biases anywhere (by its configuration).

Attention alternates (model/layer_kinds.py): a global layer lets every token look at the
whole sequence; a local one only at the tokens at most `local_attention // 2` positions
away on either side. Each kind rotates its queries and keys with a RoPE base of its own.
"""

import torch
from torch import nn

from attnserve.model.attention import MultiHeadAttention
from attnserve.model.config import ModernBertConfig
from attnserve.model.feed_forward import GatedFeedForward
from attnserve.model.layer_kinds import LayerKindStack
from attnserve.model.positions import RotaryEmbedding


def _norm(config: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)


class Embeddings(nn.Module):
    """token, then LayerNorm: positions come in later, as rotations inside attention."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(input_ids))


class ModernBertBlock(nn.Module):
    """x + attention(LayerNorm(x)), then x + feed-forward(LayerNorm(x)) (pre-LN)."""

    def __init__(self, config: ModernBertConfig, index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.local = config.layer_types[index] == "local"
        # The embeddings end in a LayerNorm: the first layer attends to them as they are.
        self.attention_norm = _norm(config) if index else nn.Identity()
        self.attention = MultiHeadAttention(config.hidden_size, config.num_heads, rotary,
                                            bias=config.attention_bias)
        self.feed_forward_norm = _norm(config)
        self.feed_forward = GatedFeedForward(config.hidden_size, config.intermediate_size, "gelu",
                                             bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.attention_norm(x)
        attended, probs = self.attention(normed, normed, normed, mask)
        x = x + attended
        x = x + self.feed_forward(self.feed_forward_norm(x))
        return x, probs


class ModernBertEncoder(LayerKindStack):
    def __init__(self, config: ModernBertConfig):
        super().__init__(config, ModernBertBlock, _norm(config))
        self.embeddings = Embeddings(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids)
