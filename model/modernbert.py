"""ModernBERT: token embeddings then LayerNorm, pre-LN blocks of rotary attention and a
GeGLU feed-forward, a final LayerNorm; no biases anywhere (by its configuration).

Attention alternates: a global layer lets every token look at the whole sequence; a
local one only at the tokens at most `local_attention // 2` positions away on either
side, a window applied as a mask before the softmax, like padding. Each kind rotates its
queries and keys with a RoPE base of its own.
"""

import torch
from torch import nn

from attnserve.model.attention import MultiHeadAttention, key_mask, window_mask
from attnserve.model.config import ModernBertConfig
from attnserve.model.encoder import EncoderOutput
from attnserve.model.feed_forward import GatedFeedForward
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


class ModernBertEncoder(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        rotary = {kind: RotaryEmbedding(config.head_dim, config.max_positions, base, pairs="halves")
                  for kind, base in (("global", config.global_rope_theta),
                                     ("local", config.local_rope_theta))}
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(ModernBertBlock(config, i, rotary[kind])
                                    for i, kind in enumerate(config.layer_types))
        self.final_norm = _norm(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> EncoderOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        whole, window = key_mask(attention_mask), window_mask(attention_mask,
                                                              self.config.window_radius)
        x = self.embeddings(input_ids)
        attentions = []
        for layer in self.layers:
            x, probs = layer(x, window if layer.local else whole)
            attentions.append(probs)
        return EncoderOutput(
            last_hidden_state=self.final_norm(x),
            attentions=tuple(attentions) if output_attentions else None,
        )
