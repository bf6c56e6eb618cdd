"""Predicted peak memory of one batch: the bytes its run allocates at its peak, outputs
included, over what the process held before it (the weights and the sessions are the
baseline, counted once at start). Per graph, provider and precision, one or more phases
(a layer peaks in its feed-forward phase or its attention phase), each

    bytes ≈ a + b·batch·seq + c·batch·heads·seq² + d·batch·heads·seq²·returned_layers

predicting the largest: docs/memory.md ("The memory model") says what each term counts.
`attnserve memory-profile` fits it into memory_model.json beside the artifact, keyed by
`provider/precision/graph`; without an entry for the provider the server runs on, a
conservative analytic bound stands in.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from attnserve.artifact import MEMORY_MODEL, SCORERS, Manifest

EMBEDDINGS, ATTENTION, SCORES = "embeddings", "attention", "scores"


def graph_kinds(manifest: Manifest) -> tuple[str, ...]:
    """The graphs an artifact's batches run through: an embedder's two, a scorer's one."""
    return (SCORES,) if manifest.kind in SCORERS else (EMBEDDINGS, ATTENTION)


FORMAT_VERSION = 2
"""memory_model.json: 1 (no "format_version"): one set of coefficients, a b c d source,
for every graph; 2: {"format_version": 2, "models": {"<provider>/<precision>/<graph>":
{a, b, c, d, source, ...}}}, where entries may carry more (how they were measured, their
held-out error) that the memory model does not read: "time", the same graph's batch time
model (server/memory/batch_time.py), which a server that predates it ignores."""
COEFFICIENTS = ("a", "b", "c", "d")


@dataclass(frozen=True)
class ShapeModel:
    """A quantity of one graph's batch as a function of its shape, in the form above: one
    or more phases of coefficients a, b, c, d (each ≥ 0), predicting the largest phase's
    value. The memory model predicts bytes (MemoryModel); the time model, of the same form
    and fitted the same way, seconds (server/memory/batch_time.py)."""

    a: float
    b: float
    c: float
    d: float
    source: str
    """"fitted on <provider> ..." or "analytic bound" """
    other_phases: tuple[tuple[float, float, float, float], ...] = ()
    """(a, b, c, d) of each further phase; the prediction is the largest phase's"""

    def __post_init__(self):
        for phase in self.phases:
            if len(phase) != len(COEFFICIENTS):
                raise ValueError(f"a phase has the coefficients {COEFFICIENTS}, not {phase!r}")
            for name, value in zip(COEFFICIENTS, phase, strict=True):
                if isinstance(value, bool) or not isinstance(value, int | float) \
                        or not math.isfinite(value) or value < 0:
                    raise ValueError(f"coefficient {name} must be a finite number >= 0, not {value!r}")

    @property
    def phases(self) -> list[tuple[float, float, float, float]]:
        return [(self.a, self.b, self.c, self.d), *self.other_phases]

    def predict(self, batch: int, seq: int, heads: int, returned_layers: int) -> float:
        tokens, quadratic = batch * seq, batch * heads * seq * seq
        return max(a + b * tokens + c * quadratic + d * quadratic * returned_layers
                   for a, b, c, d in self.phases)

    def entry(self) -> dict:
        """As memory_model.json holds it."""
        out = {n: getattr(self, n) for n in (*COEFFICIENTS, "source")}
        if self.other_phases:
            out["other_phases"] = [dict(zip(COEFFICIENTS, p, strict=True)) for p in self.other_phases]
        return out

    @classmethod
    def from_entry(cls, entry: dict):
        """From memory_model.json's entry; raises ValueError (or TypeError) for a damaged one."""
        if not isinstance(entry, dict):
            raise ValueError(f"an entry must be an object, not {entry!r}")
        missing = [k for k in (*COEFFICIENTS, "source") if k not in entry]
        if missing:
            raise ValueError(f"entry lacks {', '.join(missing)}")
        others = entry.get("other_phases", [])
        if not isinstance(others, list) or not all(isinstance(p, dict) for p in others):
            raise ValueError(f"other_phases must be a list of objects, not {others!r}")
        return cls(**{k: entry[k] for k in (*COEFFICIENTS, "source")},
                   other_phases=tuple(tuple(p.get(n) for n in COEFFICIENTS) for p in others))


class MemoryModel(ShapeModel):
    """One graph's peak bytes (see the module's docstring)."""

    def save(self, directory: Path) -> Path:
        """memory_model.json in format 1: this model for every graph and provider."""
        path = directory / MEMORY_MODEL
        path.write_text(json.dumps(self.entry(), indent=2) + "\n")
        return path


@dataclass(frozen=True)
class GraphModels:
    """What the server predicts with: the embeddings graph's model for batches without
    maps, the attention graph's for batches that return some (a reranker's scores graph
    is both: its batches never return maps)."""

    embeddings: ShapeModel
    attention: ShapeModel

    @classmethod
    def by_kind(cls, models: dict[str, ShapeModel]):
        """From the models of graph_kinds' graphs: a scorer's one graph stands for both."""
        scores = models.get(SCORES)
        return cls(models.get(EMBEDDINGS, scores), models.get(ATTENTION, scores))

    @property
    def source(self) -> str:
        if self.embeddings.source == self.attention.source:
            return self.embeddings.source
        return f"{EMBEDDINGS}: {self.embeddings.source}; {ATTENTION}: {self.attention.source}"

    def for_graph(self, kind: str) -> ShapeModel:
        return self.attention if kind == ATTENTION else self.embeddings

    def predict(self, batch: int, seq: int, heads: int, returned_layers: int) -> float:
        graph = self.attention if returned_layers else self.embeddings
        return graph.predict(batch, seq, heads, returned_layers)


MemoryModels = GraphModels
"""each graph's MemoryModel"""


def model_key(provider: str, precision: str, kind: str) -> str:
    return f"{provider}/{precision}/{kind}"


def analytic_bound(manifest: Manifest) -> MemoryModel:
    """float32 activations, counted generously: per token the hidden state a few times
    over (a decoder's queries, keys and values of its grouped heads fit in them) and two
    of the feed-forward's widening (4× or the manifest's `intermediate_size`, the wider:
    a gated one holds two); per score the scores, the probabilities and the mask (a
    sliding window's masked scores are computed too); returned maps in the graph's
    output, the slices taken from it and the unfused attention graph's own temporaries
    (a two-copy count measured ~10 % short); a SPLADE head's vocabulary scores per
    token, and their masked copy, which outgrow the rest (30,522 entries against a few
    thousand); bge-m3's weight and multi-vector vector a token."""
    hidden = manifest.hidden_size
    widening = max(4 * hidden, manifest.intermediate_size)
    vocabulary = 2 * manifest.vocab_size if manifest.sparse else 0
    heads = (manifest.lexical is not None) + (manifest.multi_vector.dim if manifest.multi_vector else 0)
    return MemoryModel(a=64 * 1024 * 1024, b=4.0 * (8 * hidden + 2 * widening + vocabulary + heads),
                       c=4.0 * 4, d=4.0 * 4, source="analytic bound")


def read_entries(path: Path) -> dict[str, dict]:
    """A format-2 file's entries; {} for a missing or format-1 file (which a new fit
    replaces). Raises ValueError for a damaged one."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if "format_version" not in data:
        return {}
    if data["format_version"] != FORMAT_VERSION or not isinstance(data.get("models"), dict):
        raise ValueError(f"format_version {data['format_version']!r} with models "
                         f"{type(data.get('models')).__name__}; this server reads 1 and {FORMAT_VERSION}")
    for key, entry in data["models"].items():
        try:
            MemoryModel.from_entry(entry)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{key}: {err}") from err
    return data["models"]


def save_entries(directory: Path, entries: dict[str, dict]) -> Path:
    """Write `entries` into memory_model.json, keeping the other entries already there."""
    path = directory / MEMORY_MODEL
    models = read_entries(path) | entries
    path.write_text(json.dumps({"format_version": FORMAT_VERSION, "models": dict(sorted(models.items()))},
                               indent=2) + "\n")
    return path


def load_memory_model(directory: Path, manifest: Manifest, provider: str = "CPUExecutionProvider",
                      precision: str = "fp32") -> MemoryModels:
    """The models for the graphs the server runs on `provider` at `precision`. Raises
    ValueError (or TypeError) for a damaged file."""
    path = directory / MEMORY_MODEL
    bound = analytic_bound(manifest)
    if not path.is_file():
        return MemoryModels(bound, bound)
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "format_version" not in data:
        one = MemoryModel.from_entry(data)
        return MemoryModels(one, one)
    entries = read_entries(path)
    fitted = {kind: entries.get(model_key(provider, precision, kind)) for kind in graph_kinds(manifest)}
    missing = f"analytic bound (memory_model.json has no {provider}/{precision} fit)"
    models = {kind: MemoryModel.from_entry(entry) if entry else replace(bound, source=missing)
              for kind, entry in fitted.items()}
    return MemoryModels.by_kind(models)
