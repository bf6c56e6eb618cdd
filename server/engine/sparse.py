"""Texts through a SPLADE model: each text's sparse vector, the non-zero weights of its
vocabulary row (the graph's max over the text's tokens of log(1 + ReLU(masked-LM
scores))), as (token id, weight) entries in ascending id order, as TEI's /embed_sparse
gives them. A text's row never leaves the server whole: it becomes its entries here.

How many entries a text has is known only once it has run, so the response's size is
checked twice: before any work, exactly when `top_k` bounds it (at least, without); after
the batch, exactly, and refused naming a top_k that would fit."""

import numpy as np

from attnserve.artifact import EMBEDDER, SPARSE_OUTPUT
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
    model.check_serving()
    model.require(EMBEDDER, "sparse embedding")
    names, manifest = request.names, model.manifest
    if manifest.sparse is None:
        raise InvalidArgument("model", f"{model.name!r} has no sparse head (its heads: "
                              f"{', '.join(manifest.heads)}): sparse vectors come from a SPLADE "
                              "model")
    count = len(request.texts)
    if not count:
        raise InvalidArgument(names.sequences, "empty: send at least one text")
    check_cut(names.top_k, request.top_k, "every non-zero weight")
    top_k = request.top_k or manifest.sparse.top_k
    vocab = manifest.vocab_size
    most = np.full(count, min(top_k or vocab, vocab))
    model.scheduler.admit(count * len(model.tokenizer.empty.ids), at_least=True)
    if top_k is None:
        request.size.check(np.zeros(count, dtype=np.int64), at_least=True)
    else:
        request.size.check(most)
    prompt = model.prompt(request.prompt_name)
    encoded = await model.tokenize(request.texts, request.truncate, names.sequence, holds,
                                   prompt=prompt, left=model.left(request.truncation_direction))
    ids = [e.ids for e in encoded]
    lengths = lengths_of(ids)
    # Held until sent: the response at its largest (no more than the door sends), and each
    # text's vocabulary row until it has become its entries.
    held = min(request.size.measure(most), request.size.limit)
    results = await model.run(Submission(ids, lengths, deadline=deadline,
                                         outputs=frozenset({SPARSE_OUTPUT})), names.sequence,
                              held, holds, kept_bytes=4 * vocab * count)
    indices, values = await model.offload.response(
        count * vocab * COPY_BYTE_S, entries, [r.pooled[SPARSE_OUTPUT] for r in results], top_k)
    counts = lengths_of(indices)
    size = request.size.measure(counts)
    if size > request.size.limit:
        raise TooLarge(
            f"response would be {size_text(size)}, over the {size_text(request.size.limit)} "
            "message limit: ask for top_k ≤ "
            f"{fitting_top_k(request.size.measure, counts, request.size.limit)}, or send fewer "
            "texts")
    return SparseEmbedded(indices, values, int(lengths.sum()), size)


def entries(rows: list[np.ndarray], top_k: int | None) -> tuple[list[np.ndarray],
                                                                 list[np.ndarray]]:
    """Each row's non-zero entries, ids ascending: the top_k largest only (equal weights,
    the lower id) with `top_k`."""
    indices, values = [], []
    for row in rows:
        ids = np.flatnonzero(row)
        if top_k is not None and len(ids) > top_k:
            ids = np.sort(ids[np.argsort(-row[ids], kind="stable")[:top_k]])
        indices.append(ids)
        values.append(row[ids].astype(np.float32))
    return indices, values


def fitting_top_k(measure, counts: np.ndarray, limit: int) -> int:
    """The largest top_k under which texts of `counts` entries fit `limit` (0: none does)."""
    low, high = 0, int(counts.max())
    while low < high:
        middle = (low + high + 1) // 2
        if measure(np.minimum(counts, middle)) <= limit:
            low = middle
        else:
            high = middle - 1
    return low
