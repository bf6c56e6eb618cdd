"""The pooled vector a request gets: the graph's, or one that leaves a prompt's tokens out
(a span of each sequence, averaged on the inference thread), cut to a Matryoshka size; as
sentence-transformers pools and cuts them: docs/api.md#prompts, #matryoshka-sizes."""

from collections.abc import Iterable

import numpy as np

from attnserve.artifact import POOLINGS, pooled_output
from attnserve.server.runtime.backend import SequenceResult

POOLED = {pooled_output(p, n): (p, n) for p in POOLINGS for n in (False, True)}
"""graph output -> (pooling, normalised)"""
# sentence-transformers' normalize: x / max(|x|, eps).
NORM_EPS = 1e-12


def prompt_spans(lengths: np.ndarray, prompt_length: int, pooling: str) -> list[np.ndarray]:
    """Per sequence, int64 [1, 2]: the tokens its vector pools when the first
    `prompt_length` are the prompt's (never past its last token)."""
    starts = np.minimum(prompt_length, lengths - 1)
    ends = starts + 1 if pooling == "cls" else lengths
    return list(np.stack((starts, ends), axis=1).astype(np.int64).reshape(-1, 1, 2))


def unit(vectors: np.ndarray) -> np.ndarray:
    """Each row (or the vector) scaled to length 1."""
    if vectors.ndim == 1:  # one result's: numpy's reductions cost more than the arithmetic
        return (vectors / max(float(vectors @ vectors) ** 0.5, NORM_EPS)).astype(np.float32)
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors))[:, None]
    return (vectors / np.maximum(norms, NORM_EPS)).astype(np.float32, copy=False)


def to_dimensions(vectors: np.ndarray, dimensions: int, normalized: bool) -> np.ndarray:
    """The first `dimensions` values of each row (or of the vector), normalised again when
    they were; `dimensions` 0 keeps them all."""
    if not dimensions:
        return vectors
    vectors = vectors[..., :dimensions]
    return unit(vectors) if normalized else vectors


def finish(results: Iterable[SequenceResult], names: Iterable[str], from_spans: bool,
           dimensions: int) -> None:
    """Each result's pooled vectors `names` as the request asked for them: from its span's
    mean (`from_spans`), cut to `dimensions` (0: whole)."""
    names = [(name, POOLED[name][1]) for name in names]
    for r in results:
        if from_spans:
            mean = r.span_means[0]
            r.pooled = {name: unit(mean) if normalized else mean for name, normalized in names}
        if dimensions:
            r.pooled = {name: to_dimensions(r.pooled[name], dimensions, normalized)
                        for name, normalized in names}
