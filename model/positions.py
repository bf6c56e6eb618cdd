"""Ways to tell the encoder where each token sits: learned, sinusoidal, rotary."""

import math
from typing import Literal

import torch
from torch import nn


def sinusoidal_table(max_positions: int, hidden_size: int) -> torch.Tensor:
    """The original Transformer's fixed encoding: sin on even dimensions, cos on odd."""
    position = torch.arange(max_positions, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, hidden_size, 2, dtype=torch.float32)
                          * (-math.log(10000.0) / hidden_size))
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
        self.pairs = pairs
        # As transformers computes it, so the angles round the same.
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        # Kept to check the copy some checkpoints save (`rotary_emb.inv_freq`) against.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
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


class RelativePositionBias(nn.Module):
    """Relative positions as a bias on the attention scores (T5's buckets, MPNet): the
    score of query i for key j gains a learned value per head for the bucket of j - i.
    Distances below num_buckets / 4 get a bucket each, on each side; longer ones share
    buckets spaced logarithmically up to `max_distance`, past which they share the last.
    Computed once from the sequence length and added to every layer's scores."""

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bias = nn.Embedding(num_buckets, num_heads)

    def bucket(self, relative: torch.Tensor) -> torch.Tensor:
        """key position - query position -> bucket: the first half of the buckets for keys
        before the query, the second half for keys after it."""
        half = self.num_buckets // 2
        exact = half // 2
        after = (relative > 0).long() * half
        distance = relative.abs()
        # As transformers computes it (log in float32, truncated), so buckets match its.
        far = exact + (torch.log(distance.float() / exact) / math.log(self.max_distance / exact)
                       * (half - exact)).long()
        far = torch.clamp(far, max=half - 1)
        return after + torch.where(distance < exact, distance, far)

    def forward(self, seq: int, device: torch.device) -> torch.Tensor:
        """-> (1, heads, seq, seq), to add to the scores."""
        position = torch.arange(seq, device=device)
        buckets = self.bucket(position[None, :] - position[:, None])
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)
