"""Texts through a model with a sparse head: each text's sparse vector, as (token id,
weight) entries in ascending id order, as TEI's /embed_sparse gives them.

- SPLADE: the non-zero weights of the text's vocabulary row (the graph's max over the
  text's tokens of log(1 + ReLU(masked-LM scores))). A text's row never leaves the
  server whole: it becomes its entries here.
- bge-m3's lexical weights: the graph gives one weight per token (ReLU(sparse_linear(h)));
  a token id's weight is the largest of its tokens', the special tokens left out, as
  FlagEmbedding computes them.

How many entries a text has is known only once it has run, so the response's size is
checked twice: before any work, exactly when `top_k` bounds it (at least, without); after
the batch, exactly, and refused naming a top_k that would fit."""

import bisect

import numpy as np

from attnserve.artifact import EMBEDDER, SPARSE_OUTPUT, TOKEN_WEIGHTS_OUTPUT
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S
from attnserve.server.engine.requests import (
    SparseEmbedded,
    SparseRequest,
    Submission,
    check_cut,
    lengths_of,
    size_text,
)
from attnserve.server.errors import InvalidArgument, TooLarge
from attnserve.server.memory.ledger import Holds


async def embed_sparse(model: ServedModel, request: SparseRequest, holds: Holds,
                       deadline: float | None) -> SparseEmbedded:
    model.require("sparse embedding", EMBEDDER)
    names, manifest = request.names, model.manifest
    if manifest.sparse is None and manifest.lexical is None:
        raise InvalidArgument("model", f"{model.name!r} has no sparse head (its heads: "
                              f"{', '.join(manifest.heads)}): sparse vectors come from a SPLADE "
                              "model or bge-m3's lexical weights")
    count = len(request.texts)
    if not count:
        raise InvalidArgument(names.sequences, "empty: send at least one text")
    check_cut(names.top_k, request.top_k, "every non-zero weight")
    splade = manifest.sparse is not None
    top_k = request.top_k or (manifest.sparse.top_k if splade else None)
    vocab = manifest.vocab_size
    # A text's entries: at most its vocabulary row's (SPLADE), or its tokens' (lexical).
    most = np.full(count, min(top_k or vocab, vocab if splade else manifest.max_positions))
    model.scheduler.admit(count * len(model.tokenizer.empty.ids), at_least=True)
    request.size.check(np.zeros(count, dtype=np.int64) if top_k is None else most, at_least=top_k is None)
    prompt = model.prompt(request.prompt_name)
    encoded = await model.tokenize(request.texts, request.truncate, names.sequence, holds,
                                   prompt=prompt, left=model.left(request.truncation_direction))
    ids = [e.ids for e in encoded]
    lengths = lengths_of(ids)
    # Held until sent: the response at its largest (no more than the door sends), and each text's row (a
    # vocabulary's, or a weight a padded token) until it has become its entries.
    held = min(request.size.measure(np.minimum(most, lengths) if not splade else most), request.size.limit)
    output = SPARSE_OUTPUT if splade else TOKEN_WEIGHTS_OUTPUT
    row = vocab if splade else int(lengths.max())
    results = await model.run(Submission(ids, lengths, deadline=deadline,
                                         outputs=frozenset({output})), names.sequence,
                              held, holds, kept_bytes=4 * row * count)
    rows = [r.pooled[output] for r in results]
    if not splade:
        rows = await model.offload.response(
            12 * int(lengths.sum()) * COPY_BYTE_S, lexical_rows, ids, rows,
            manifest.lexical.dropped_token_ids)
    indices, values = await model.offload.response(count * row * COPY_BYTE_S, entries, rows, top_k)
    counts = lengths_of(indices)
    measure, limit = request.size.measure, request.size.limit
    size = measure(counts)
    if size > limit:
        # The largest top_k under which the texts fit the limit (0: none does).
        fits = bisect.bisect_right(range(int(counts.max()) + 1), limit,
                                   key=lambda k: measure(np.minimum(counts, k)))
        raise TooLarge(f"response would be {size_text(size)}, over the {size_text(limit)} message "
                       f"limit: ask for top_k ≤ {max(fits - 1, 0)}, or send fewer texts")
    return SparseEmbedded(indices, values, int(lengths.sum()), size)


def lexical_rows(ids: list[np.ndarray], rows: list[np.ndarray],
                 dropped: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's (token ids ascending, the largest weight of each id's tokens), the
    `dropped` ids and weights of 0 left out. `rows[i]` is text i's weight per position of
    its padded batch: the first len(ids[i]) are its tokens'."""
    found = []
    for sequence, row in zip(ids, rows, strict=True):
        weights = row[:sequence.size]
        kept = (weights > 0) & ~np.isin(sequence, dropped)
        order = np.argsort(sequence[kept], kind="stable")
        tokens, weights = sequence[kept][order], weights[kept][order]
        unique, starts = np.unique(tokens, return_index=True)
        found.append((unique, np.maximum.reduceat(weights, starts) if unique.size else weights[:0]))
    return found


def entries(rows: list, top_k: int | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each row's non-zero entries, ids ascending: the top_k largest only (equal weights, the lower id) with
    `top_k`. A row is a vocabulary's weights, or the (ids, weights) of `lexical_rows`."""
    indices, values = [], []
    for row in rows:
        if isinstance(row, tuple):
            ids, weights = row
        else:
            ids = np.flatnonzero(row)
            weights = row[ids]
        if top_k is not None and len(ids) > top_k:
            chosen = np.sort(np.argsort(-weights, kind="stable")[:top_k])
            ids, weights = ids[chosen], weights[chosen]
        indices.append(ids)
        values.append(weights.astype(np.float32))
    return indices, values

