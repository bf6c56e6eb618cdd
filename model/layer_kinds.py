"""Stacks whose layers are of two kinds (ModernBERT, Gemma3; Qwen3's are all global): a
global layer attends over the whole sequence, a local one over a window around each
token, applied as a mask before the softmax, like padding; each kind rotates queries and
keys with a RoPE base of its own."""

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from attnserve.model.attention import key_mask, window_mask
from attnserve.model.config import LayerKindsConfig
from attnserve.model.encoder import EncoderOutput
from attnserve.model.positions import RotaryEmbedding


def rotaries(config: LayerKindsConfig) -> dict[str, RotaryEmbedding]:
    """One RoPE for each kind of layer the stack has, with that kind's base; halves are
    paired, as transformers' rotate_half pairs them."""
    bases = {"global": config.global_rope_theta, "local": config.local_rope_theta}
    return {kind: RotaryEmbedding(config.head_dim, config.max_positions, bases[kind],
                                  pairs="halves") for kind in sorted(set(config.layer_types))}


class LayerKindStack(nn.Module, ABC):
    """Token states from `embed`, then the layers (each one's `local` says its kind), each
    with its kind's mask (every real key, or the real keys at most the config's
    window_radius away), then `final_norm`. A family gives its block, made as
    `block(config, index, rotary)` with its layer's kind's RoPE, and its final norm, and
    says how it embeds the ids."""

    def __init__(self, config: LayerKindsConfig,
                 block: Callable[[LayerKindsConfig, int, RotaryEmbedding], nn.Module],
                 final_norm: nn.Module):
        super().__init__()
        self.config = config
        rotary = rotaries(config)
        self.layers = nn.ModuleList(block(config, i, rotary[kind])
                                    for i, kind in enumerate(config.layer_types))
        self.final_norm = final_norm

    @abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The family's token embeddings of `input_ids`, [batch, seq, hidden]."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False) -> EncoderOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        whole = key_mask(attention_mask)
        window = (window_mask(attention_mask, self.config.window_radius)
                  if any(layer.local for layer in self.layers) else None)
        x = self.embed(input_ids)
        attentions = []
        for layer in self.layers:
            x, probs = layer(x, window if layer.local else whole)
            attentions.append(probs)
        return EncoderOutput(self.final_norm(x), attentions=tuple(attentions) if output_attentions else None)
