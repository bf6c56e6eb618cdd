"""Chunked embedding: each text cut into chunks (server/engine/chunk_cuts.py), one vector
a chunk, and a chunked text's plan: the sequences it runs and, once they have run, its
chunk vectors.

LATE runs the text's windows, only those some chunk is pooled from, each between the
model's special tokens; each window's result carries the mean embedding of every chunk
pooled from it (the scheduler's `spans`), through the model's Dense layers. ISOLATED runs
each chunk alone between the special tokens, pooled by the graph as the model pools a text
(the last token of a decoder embedder's chunk, say). A prompt's tokens run in every window
or chunk, after its leading special tokens.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnserve.artifact import pooled_output
from attnserve.server.engine.chunk_cuts import Chunks, best_windows, cut, default_overlap, windows
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import CHUNK_S, CUT_CHAR_S, TEXT_CHAR_S, TEXT_S, cost
from attnserve.server.engine.pooling import to_dimensions, unit
from attnserve.server.engine.requests import (
    ChunkedText,
    Chunking,
    ChunkingMode,
    Embedded,
    EmbedRequest,
    Fields,
    ResponseSize,
    Submission,
)
from attnserve.server.engine.tokenize import KEPT_BYTES_PER_ID, Prompt, TextTokens
from attnserve.server.errors import InvalidArgument
from attnserve.server.memory.ledger import Holds
from attnserve.server.runtime.backend import SequenceResult


def window_overlap(chunking: Chunking, names: Fields, width: int) -> int:
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
        """LATE: per window, its chunks' token ranges in the sequence run (after `head` special tokens)."""
        bounds = self.chunks.bounds
        return [np.column_stack((bounds[chunks], bounds[chunks + 1])) - start + head
                for (start, _), chunks in zip(self.windows.tolist(), self.pooled_from, strict=True)]

    def vectors(self, results: list[SequenceResult], pooled: str, normalize: bool, size: int) -> np.ndarray:
        """float32 [chunks, size] in text order, from this plan's results; `pooled`: the
        graph output ISOLATED chunks come with."""
        if not results:
            return np.zeros((0, size), dtype=np.float32)
        if self.windows is None:
            return np.stack([r.pooled[pooled] for r in results]).astype(np.float32, copy=False)
        means = np.concatenate([r.span_means for r in results])
        vectors = np.empty_like(means)
        vectors[np.concatenate(self.pooled_from)] = means
        return unit(vectors) if normalize else vectors


async def embed_chunked(model: ServedModel, request: EmbedRequest, prompt: Prompt | None,
                        dimensions: int, holds: Holds, deadline: float | None) -> Embedded:
    """Each text cut into chunks and run as its windows (LATE) or chunks (ISOLATED), under
    the same bounds as any request, each as soon as it can be known: the queue and the
    response from the count of texts, the response again from the count of chunks, the
    queue from the tokens of every window, the memory budget from the longest."""
    names, texts, chunking = request.names, request.texts, request.chunking
    if request.token_ids:
        raise InvalidArgument(names.chunking, "chunking cuts texts into chunks: send texts, not token ids")
    tokenizer = model.tokenizer
    head = tokenizer.head_ids if prompt is None else np.concatenate((tokenizer.head_ids, prompt.ids))
    specials = len(head) + len(tokenizer.tail_ids)
    width = model.manifest.max_positions - specials  # a window's tokens, specials aside
    overlap = window_overlap(chunking, names, width)
    # A text may have no tokens, and so no chunks.
    model.scheduler.admit(0, at_least=True)
    request.size.check(np.zeros(len(texts), dtype=np.int64), at_least=True)
    with model.stage("tokenize"):
        plans = await model.offload.request(
            cost(texts, TEXT_S, TEXT_CHAR_S + CUT_CHAR_S), _plan_chunks, model, texts, chunking,
            width, overlap, names, request.size, holds)
    size = request.size.check(np.fromiter((p.chunks.count for p in plans), np.int64, len(plans)))
    per_text = [p.lengths(specials) for p in plans]
    lengths = np.concatenate(per_text)
    late = chunking.mode is ChunkingMode.LATE
    pooled = pooled_output(chunking.mode.pooling(model.manifest.default_pooling), request.normalize)
    planning = cost(plans, CHUNK_S, CHUNK_S, lambda p: p.chunks.count)
    results: list[SequenceResult] = []
    if len(lengths):
        model.scheduler.admit(int(lengths.sum()))
        sequences, spans = await model.offload.request(planning, _sequences, plans, late, head,
                                                       tokenizer.tail_ids, holds)
        text_of = np.repeat(np.arange(len(plans)), list(map(len, per_text)))
        # LATE: the chunks' means from their windows' spans; ISOLATED: each chunk's pooled
        # vector. Cut to `dimensions` with the rest of the chunk vectors.
        outputs = frozenset() if late else frozenset({pooled})
        results = await model.run_pooled(
            Submission(sequences, lengths, deadline=deadline, outputs=outputs, spans=spans),
            lambda i: names.sequence(int(text_of[i])), size, holds, prompt, 0)
    chunked = await model.offload.request(
        planning, _chunk_vectors, plans, list(map(len, per_text)), results, pooled,
        request.normalize, dimensions, model.manifest.embedding_size)
    return Embedded([], lengths, [], chunked, size)


def _plan_chunks(model: ServedModel, texts: Sequence[str], chunking: Chunking, width: int,
                 overlap: int, names: Fields, size: ResponseSize, holds: Holds) -> list[TextPlan]:
    """Each text tokenized whole, cut into chunks and (LATE) placed in windows of `width`
    tokens that overlap by `overlap`."""
    max_tokens, limit = chunking.max_tokens, model.max_chunking_chars
    for i, text in enumerate(texts):
        if len(text) > limit:
            raise InvalidArgument(names.sequence(i), f"{len(text)} characters, more than the "
                                  f"{limit} a text to chunk may have on this server "
                                  "(--max-chunking-chars): split it")
    tokens = model.tokenizer.encode_whole(texts, holds)
    # Before any cutting: each text has at least this many chunks.
    size.check(np.fromiter((-(-len(t.ids) // max_tokens) for t in tokens), np.int64,
                           len(tokens)), at_least=True)
    chunks = [cut(text, t, max_tokens) for text, t in zip(texts, tokens, strict=True)]
    if chunking.mode is ChunkingMode.ISOLATED:
        return [TextPlan(t, c, None, []) for t, c in zip(tokens, chunks, strict=True)]
    return [TextPlan.late(t, c, width, overlap) for t, c in zip(tokens, chunks, strict=True)]


def _sequences(plans: list[TextPlan], late: bool, head: np.ndarray, tail: np.ndarray,
               holds: Holds) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Every plan's sequences, each between the ids `head` and `tail`, and, for windows
    (`late`), the chunks' token spans in each."""
    sequences = [s for plan in plans for s in plan.sequences(head, tail)]
    holds.take(KEPT_BYTES_PER_ID * sum(map(len, sequences)), "token ids")
    return sequences, [s for plan in plans for s in plan.spans(len(head))] if late else None


def _chunk_vectors(plans: list[TextPlan], counts: list[int], results: list[SequenceResult],
                   pooled: str, normalize: bool, dimensions: int, size: int) -> list[ChunkedText]:
    """Each text's chunks and their vectors (`size` wide), cut to `dimensions` (0: whole); `counts`: the
    sequences each plan ran; `pooled`: the graph output ISOLATED chunks come with."""
    out, at = [], 0
    for plan, count in zip(plans, counts, strict=True):
        vectors = to_dimensions(plan.vectors(results[at:at + count], pooled, normalize, size),
                                dimensions, normalize)
        out.append(ChunkedText(len(plan.tokens.ids), plan.chunks.spans, plan.chunks.token_counts, vectors))
        at += count
    return out
