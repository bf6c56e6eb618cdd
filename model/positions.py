"""Ways to tell the encoder where each token sits: learned, sinusoidal, rotary."""

import math
from typing import Literal

import torch
from torch import nn


def sinusoidal_table(max_positions: int, hidden_size: int) -> torch.Tensor:
    """The original Transformer's fixed encoding: sin on even dimensions, cos on odd."""
    position = torch.arange(max_positions, dtype=torch.float32)[:, None]
    frequency = torch.exp(
        torch.arange(0, hidden_size, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden_size)
    )
    table = torch.zeros(max_positions, hidden_size)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: hidden_size // 2])
    return table


def positions_after_padding(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """RoBERTa's position ids, (batch, seq): each row's tokens other than the padding id
    numbered pad_token_id + 1, pad_token_id + 2, … in order, and each padding token
    pad_token_id (a row that is never trained). Counted from the ids, as the checkpoint
    was trained, so an id sequence means the same with or without its padding; computed
    in the graph, so it holds at every batch and length."""
    real = (input_ids != pad_token_id).long()
    return torch.cumsum(real, dim=1) * real + pad_token_id


class RotaryEmbedding(nn.Module):
    """RoPE: rotate pairs of a head's query and key dimensions by an angle that grows with
    the position, so Q·K depends on the distance between two tokens. Pair i turns by
    base^(-2i/head_dim) radians a position.

    Which dimensions make a pair is a convention a checkpoint was trained with:
    `interleaved` pairs neighbours, (0, 1), (2, 3), …, as RoPE was first written down;
    `halves` pairs each dimension of the first half with its match in the second, (0,
    d/2), (1, d/2 + 1), …, as GPT-NeoX and transformers' rotate_half do (ModernBERT).
    """

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0,
                 pairs: Literal["interleaved", "halves"] = "interleaved"):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        if pairs not in ("interleaved", "halves"):
            raise ValueError(f"unknown RoPE pairing {pairs!r}")
        self.pairs = pairs
        # As transformers computes it, so the angles round the same.
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cos(angles), persistent=False)
        self.register_buffer("sin", torch.sin(angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim); each pair (a, b) becomes
        (a cos θ - b sin θ, a sin θ + b cos θ)."""
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        if self.pairs == "halves":
            a, b = x.chunk(2, dim=-1)
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
