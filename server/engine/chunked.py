"""A chunked text's plan: the sequences it runs and, once they have run, its chunk vectors.

LATE runs the text's windows (server/engine/chunking.py), only those some chunk is pooled
from, each between the model's special tokens; each window's result carries the mean
embedding of every chunk pooled from it (the scheduler's `spans`). ISOLATED runs each
chunk alone between the special tokens, mean-pooled by the graph as a text's pooled
vector is.
"""

from dataclasses import dataclass

import numpy as np

from attnserve.server.engine.chunk_cuts import Chunks, best_windows, default_overlap, windows
from attnserve.server.engine.requests import Chunking, ChunkingMode, FieldNames
from attnserve.server.engine.tokenize import TextTokens
from attnserve.server.errors import InvalidArgument
from attnserve.server.runtime.backend import SequenceResult


def window_overlap(chunking: Chunking, names: FieldNames, width: int) -> int:
    """The overlap LATE windows run with (0 for ISOLATED), the request's checked; `width`:
    the tokens a window holds, special tokens aside."""
    field = names.chunking
    if not 1 <= chunking.max_tokens <= width:
        raise InvalidArgument(f"{field}.max_tokens", f"{chunking.max_tokens}; expected 1 to "
                              f"{width}, the tokens one sequence holds besides its special tokens")
    overlap = chunking.window_overlap
    if chunking.mode is ChunkingMode.ISOLATED:
        if overlap:
            raise InvalidArgument(f"{field}.window_overlap", "isolated chunks run alone, in no "
                                  "windows: leave it 0")
        return 0
    if not overlap:
        return default_overlap(chunking.max_tokens, width)
    if not chunking.max_tokens - 1 <= overlap < width:
        raise InvalidArgument(
            f"{field}.window_overlap", f"{overlap}; expected {chunking.max_tokens - 1} "
            f"(max_tokens - 1, so that every chunk lies whole in a window) to {width - 1}, or "
            f"0 for the default ({default_overlap(chunking.max_tokens, width)})")
    return overlap


@dataclass(frozen=True)
class TextPlan:
    tokens: TextTokens
    chunks: Chunks
    windows: np.ndarray | None
    """LATE: int64 [windows, 2], the token ranges of the windows that run; None: ISOLATED"""
    pooled_from: list[np.ndarray]
    """LATE: per window run, the chunks pooled from it, ascending"""

    @classmethod
    def late(cls, tokens: TextTokens, chunks: Chunks, width: int, overlap: int) -> "TextPlan":
        starts, ends = windows(len(tokens.ids), width, overlap)
        best = best_windows(chunks.bounds, starts, ends)
        order = np.argsort(best, kind="stable")
        used, counts = np.unique(best[order], return_counts=True)
        pooled_from = np.split(order, np.cumsum(counts)[:-1]) if len(used) else []
        return cls(tokens, chunks, np.column_stack((starts[used], ends[used])), pooled_from)

    @classmethod
    def isolated(cls, tokens: TextTokens, chunks: Chunks) -> "TextPlan":
        return cls(tokens, chunks, None, [])

    def _ranges(self) -> np.ndarray:
        """int64 [sequences, 2]: the token range each sequence runs."""
        if self.windows is not None:
            return self.windows
        return np.column_stack((self.chunks.bounds[:-1], self.chunks.bounds[1:]))

    def lengths(self, specials: int) -> np.ndarray:
        return np.diff(self._ranges(), axis=1).reshape(-1) + specials

    def sequences(self, head: np.ndarray, tail: np.ndarray) -> list[np.ndarray]:
        ids = self.tokens.ids
        return [np.concatenate((head, ids[start:end], tail)) for start, end in self._ranges().tolist()]

    def spans(self, head: int) -> list[np.ndarray]:
        """LATE: per window, its chunks' token ranges in the sequence run (after `head`
        special tokens)."""
        bounds = self.chunks.bounds
        return [np.column_stack((bounds[chunks], bounds[chunks + 1])) - start + head
                for (start, _), chunks in zip(self.windows.tolist(), self.pooled_from, strict=True)]

    def vectors(self, results: list[SequenceResult], pooled: str, normalize: bool,
                hidden: int) -> np.ndarray:
        """float32 [chunks, hidden] in text order, from this plan's results; `pooled`: the
        graph output ISOLATED chunks come with."""
        if not results:
            return np.zeros((0, hidden), dtype=np.float32)
        if self.windows is None:
            return np.stack([r.pooled[pooled] for r in results]).astype(np.float32, copy=False)
        means = np.concatenate([r.span_means for r in results])
        vectors = np.empty_like(means)
        vectors[np.concatenate(self.pooled_from)] = means
        if normalize:
            vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors
