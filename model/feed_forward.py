"""The position-wise feed-forward networks that follow attention in every block.

    plain: down(act(up(x)))              BERT, RoBERTa, MPNet, DistilBERT
    gated: down(act(gate(x)) ⊙ up(x))    ModernBERT (GeGLU), Qwen3 (SwiGLU), Gemma3 (GeGLU, tanh)

In the gated form the activated branch decides, per channel, how much of the linear
branch passes.
"""

from functools import partial

import torch
from torch import nn

# Hugging Face's names for the activations these families use.
ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": partial(nn.GELU, approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]()


class FeedForward(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "gelu"):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)
        self.act = activation(act)
        self.down = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class GatedFeedForward(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.act = activation(act)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))
