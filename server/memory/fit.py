"""The memory model fitted to measured peaks, and the time model to measured batch times
(server/memory/model.py gives their form and what each term stands for; `attnserve
memory-profile` measures both).

Per graph, by least squares on relative error, every coefficient ≥ 0, as one phase or (the
memory model) the larger of two; scored on shapes held out along the diagonals of the
batch × seq grid, then fitted on all of them."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from attnserve.server.memory.model import ATTENTION, COEFFICIENTS

# Relative errors are scored over shapes whose peak reaches this; the fit weighs smaller
# ones as if they were at it (a few hundred KiB of per-run overhead is not what a memory
# budget is about).
NOISE_FLOOR_BYTES = 1 << 20
# The same for batch times: below a tenth of a millisecond a run's time is mostly the
# scheduler's jitter, and no batch that short is worth cutting.
NOISE_FLOOR_SECONDS = 1e-4


class Measured(Protocol):
    """One shape's measured peak and batch time."""

    graph: str
    """embeddings or attention"""
    batch: int
    seq: int
    returned_layers: int
    peak_bytes: int
    batch_seconds: float


@dataclass(frozen=True)
class Target:
    """What a fit predicts: a measured attribute of each row, the floor below which a row
    is weighed as if at it (and not scored), and the most phases the model may have."""

    attribute: str
    floor: float
    max_phases: int

    def of(self, row: Measured) -> float:
        return float(getattr(row, self.attribute))


PEAK = Target("peak_bytes", NOISE_FLOOR_BYTES, 2)
"""the memory model: a layer's memory peaks in one phase or another, so the larger of two"""
BATCH_TIME = Target("batch_seconds", NOISE_FLOOR_SECONDS, 1)
"""the time model: a batch's time adds up its parts, so one phase"""


def features(graph: str, batch: int, seq: int, heads: int, returned_layers: int) -> list[float]:
    quadratic = float(batch) * heads * seq * seq
    return [1.0, float(batch) * seq, quadratic, quadratic * returned_layers if graph == ATTENTION else 0.0]


def fit_phase(rows: list[Measured], heads: int, target: Target = PEAK) -> np.ndarray:
    """a, b, c, d of one phase: least squares on relative error (each row weighted by
    1/measured, floored at the target's floor), every coefficient kept ≥ 0 (a negative term
    would predict less for a larger batch: one that comes out negative is dropped and the
    rest refitted; so is one no row varies)."""
    x = np.array([features(r.graph, r.batch, r.seq, heads, r.returned_layers) for r in rows])
    y = np.array([target.of(r) for r in rows])
    weight = 1.0 / np.maximum(y, target.floor)
    active = [k for k in range(x.shape[1]) if x[:, k].any()]
    coef = np.zeros(len(COEFFICIENTS))
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] * weight[:, None], y * weight, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        del active[int(np.argmin(solution))]
    return coef


def predict(phases: list[np.ndarray], row: Measured, heads: int) -> float:
    values = features(row.graph, row.batch, row.seq, heads, row.returned_layers)
    return max(float(np.dot(p, values)) for p in phases)


def _mean_error(phases: list[np.ndarray], rows: list[Measured], heads: int, target: Target) -> float:
    return float(np.mean([abs(predict(phases, r, heads) - target.of(r)) / max(target.of(r), target.floor)
                          for r in rows]))


# A second phase must earn its four coefficients: at least this much lower mean error.
PHASE_GAIN = 0.01


def fit_phases(rows: list[Measured], heads: int, target: Target = PEAK) -> list[np.ndarray]:
    """One graph's model: one phase, or (where the target allows two) two whose larger is
    the peak (the feed-forward phase below some length, the attention phase above it;
    server/memory/model.py). Since both phases scale with batch·seq, which is larger
    depends on seq alone: each measured length is tried as the boundary, each side
    fitted, then every row given to the phase that predicts more for it and both
    refitted, until that settles."""
    best = [fit_phase(rows, heads, target)]
    best_error = _mean_error(best, rows, heads, target) - PHASE_GAIN
    for boundary in sorted({r.seq for r in rows})[:-1] if target.max_phases > 1 else ():
        groups = [[r for r in rows if r.seq <= boundary], [r for r in rows if r.seq > boundary]]
        phases = None
        for _ in range(8):
            if min(len(g) for g in groups) < len(COEFFICIENTS) - 1:
                break
            phases = [fit_phase(g, heads, target) for g in groups]
            regrouped: list[list[Measured]] = [[], []]
            for r in rows:
                values = features(r.graph, r.batch, r.seq, heads, r.returned_layers)
                regrouped[int(np.dot(phases[1], values) > np.dot(phases[0], values))].append(r)
            if regrouped == groups:
                break
            groups = regrouped
        if phases is not None and _mean_error(phases, rows, heads, target) < best_error:
            best, best_error = phases, _mean_error(phases, rows, heads, target)
    return best


def relative_errors(fits: dict[str, list[np.ndarray]], rows: list[Measured], heads: int,
                    target: Target = PEAK) -> dict:
    """|predicted - measured| / measured over the rows at or above the target's floor."""
    errors = [abs(predict(fits[r.graph], r, heads) - target.of(r)) / target.of(r)
              for r in rows if target.of(r) >= target.floor]
    return {"shapes": len(rows), "shapes_scored": len(errors),
            "mean_rel_error": float(np.mean(errors)) if errors else None,
            "max_rel_error": float(np.max(errors)) if errors else None}


def held_out_flags(rows: list[Measured], every: int) -> list[bool]:
    """Which rows are held out: along the diagonals of each graph's batch × seq grid
    (rank of its seq + rank of its batch ≡ -1 mod `every`), so every length and every
    batch size keeps shapes on both sides."""
    flags = []
    for r in rows:
        mine = [x for x in rows if x.graph == r.graph]
        seqs, batches = sorted({x.seq for x in mine}), sorted({x.batch for x in mine})
        flags.append((seqs.index(r.seq) + batches.index(r.batch)) % every == every - 1)
    return flags


def fit_with_holdout(rows: list[Measured], heads: int, every: int, target: Target = PEAK) -> dict:
    """Per graph: a fit on the shapes not held out, scored on those held out; then the
    fit on all of them."""
    flags = held_out_flags(rows, every)
    train_fits, held, train, fits = {}, [], [], {}
    for kind in dict.fromkeys(r.graph for r in rows):
        mine = [(r, f) for r, f in zip(rows, flags, strict=True) if r.graph == kind]
        fits[kind] = fit_phases([r for r, _ in mine], heads, target)
        out = [r for r, f in mine if f]
        kept = [r for r, f in mine if not f]
        if out and len(kept) >= len(COEFFICIENTS):
            train_fits[kind] = fit_phases(kept, heads, target)
            held += out
            train += kept
    holdout = None if not held else relative_errors(train_fits, held, heads, target) | {
        "every": every, "train_shapes": len(train),
        "by_graph": {kind: relative_errors(train_fits, [r for r in held if r.graph == kind], heads, target)
                     for kind in train_fits}}
    return {"fits": fits, "holdout": holdout, "in_sample": relative_errors(fits, rows, heads, target),
            "held": {i for i, f in enumerate(flags) if f}}


def formula(phase: np.ndarray) -> str:
    a, b, c, d = phase
    return (f"{a:.4g} + {b:.4g}·batch·seq + {c:.4g}·batch·heads·seq² "
            f"+ {d:.4g}·batch·heads·seq²·returned_layers")
