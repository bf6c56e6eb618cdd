"""Ways to tell the encoder where each token sits: learned, sinusoidal, rotary."""

import math

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
    """RoPE: rotate each (even, odd) pair of a head's query and key by an angle that
    grows with the position, so Q·K depends on the distance between two tokens."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cos(angles), persistent=False)
        self.register_buffer("sin", torch.sin(angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim)."""
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2)
