"""Predicted time of one batch: what the batch loop sizes bulk batches by while
interactive work is arriving (server/engine/batch_loop.py).

The memory model's form in one phase, since a batch's time is the sum of its parts rather
than the larger of two; `attnserve memory-profile` fits it and stores it in the same
memory_model.json entry, under "time" (docs/memory.md, "The time model"). Without one for
the provider and precision served (a file written before there was one, a format-1 file,
none at all), measured batch times stand in (`BatchTimes`)."""

from pathlib import Path

from attnserve.artifact import MEMORY_MODEL, Manifest
from attnserve.server.memory.model import GraphModels, ShapeModel, graph_kinds, model_key, read_entries

TIME = "time"
"""the key of a memory_model.json entry that holds the graph's time model"""
# Each batch run moves the measured seconds per padded token of its length bucket this
# share of the way to its own: a few batches settle it, one slow batch does not.
MEASURED_WEIGHT = 0.25


# One graph's batch time in seconds (see the module's docstring), and each graph's.
TimeModel, TimeModels = ShapeModel, GraphModels


def load_time_model(directory: Path, manifest: Manifest, provider: str, precision: str) -> TimeModels | None:
    """The fitted time models of the graphs the server runs on `provider` at `precision`;
    None when memory_model.json lacks one of them. Raises ValueError (or TypeError) for
    a damaged entry."""
    entries = read_entries(directory / MEMORY_MODEL)  # {} without a file
    found = {}
    for kind in graph_kinds(manifest):
        key = model_key(provider, precision, kind)
        entry = entries.get(key, {})
        if TIME not in entry:
            return None
        try:
            found[kind] = TimeModel.from_entry(entry[TIME])
        except (ValueError, TypeError) as err:
            raise ValueError(f"{key}: {TIME}: {err}") from err
    return TimeModels.by_kind(found)


class BatchTimes:
    """A batch's predicted seconds: from the fitted time model, or without one from the
    batches this model has run (`ran`), per graph (maps returned or not) and length bucket
    (lengths up to each power of two)."""

    def __init__(self, fitted: TimeModels | None, heads: int, missing: str = ""):
        """`missing`: why there is no fit, for `source`."""
        self.fitted, self.heads = fitted, heads
        self.rates: dict[tuple[bool, int], float] = {}
        """(maps returned, length bucket) -> seconds per padded token"""
        self.source = fitted.source if fitted is not None else f"measured batch times ({missing})"

    def predict(self, batch: int, seq: int, returned_layers: int) -> float | None:
        """Seconds for a batch run at [batch, seq]; None when nothing tells yet (no fit,
        and no batch of its graph and length bucket has run)."""
        if self.fitted is not None:
            return self.fitted.predict(batch, seq, self.heads, returned_layers)
        rate = self.rates.get(_bucket(seq, returned_layers))
        return None if rate is None else rate * batch * seq

    def ran(self, batch: int, seq: int, returned_layers: int, seconds: float) -> None:
        """A batch run at [batch, seq] took `seconds` (read only without a fit)."""
        if self.fitted is not None:
            return
        key, rate = _bucket(seq, returned_layers), seconds / (batch * seq)
        before = self.rates.get(key)
        self.rates[key] = rate if before is None else before + MEASURED_WEIGHT * (rate - before)


def _bucket(seq: int, returned_layers: int) -> tuple[bool, int]:
    return returned_layers > 0, (seq - 1).bit_length()
