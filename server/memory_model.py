"""Predicted peak memory of a batch:

    bytes ≈ a + b·batch·seq + c·batch·heads·seq² + d·batch·heads·seq²·returned_layers

The first three terms are the activations (attention scores grow with the square of the
length); the last is the attention maps a request asks to get back. `attnserve
memory-profile` fits the coefficients on the device and saves them beside the artifact;
without that file, a conservative analytic bound stands in.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from attnserve.artifact import MEMORY_MODEL, Manifest


@dataclass(frozen=True)
class MemoryModel:
    a: float
    b: float
    c: float
    d: float
    source: str
    """"fitted on <provider>" or "analytic bound" """

    def predict(self, batch: int, seq: int, heads: int, returned_layers: int) -> float:
        quadratic = batch * heads * seq * seq
        return self.a + self.b * batch * seq + self.c * quadratic + self.d * quadratic * returned_layers

    def save(self, directory: Path) -> Path:
        path = directory / MEMORY_MODEL
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def analytic_bound(manifest: Manifest) -> MemoryModel:
    """float32 activations, counted generously: per token the hidden state a few times
    over and the feed-forward's 4× widening; per score the scores, the probabilities
    and the mask; returned maps in the graph's output, the slices taken from it and the
    unfused attention graph's own temporaries (a two-copy count measured ~10 % short)."""
    hidden = manifest.hidden_size
    return MemoryModel(
        a=64 * 1024 * 1024,
        b=4.0 * (8 * hidden + 2 * 4 * hidden),
        c=4.0 * 4,
        d=4.0 * 4,
        source="analytic bound",
    )


def load_memory_model(directory: Path, manifest: Manifest) -> MemoryModel:
    path = directory / MEMORY_MODEL
    if path.is_file():
        return MemoryModel(**json.loads(path.read_text()))
    return analytic_bound(manifest)
