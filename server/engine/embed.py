"""Texts and token ids through an embedding model: each sequence's vectors (`embed`; a chunked request goes to
chunked.py), each text's tokens (`tokenize`), and ids back to text (`decode`)."""

from collections.abc import Sequence

import numpy as np

from attnserve.artifact import EMBEDDER, HIDDEN_OUTPUT, MULTI_VECTOR_OUTPUT
from attnserve.server.engine import multi_vector
from attnserve.server.engine.chunked import embed_chunked
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import DECODE_ID_S, ID_SEQUENCE_S, TOKEN_ID_S, cost
from attnserve.server.engine.pooling import POOLED
from attnserve.server.engine.requests import (
    DecodeRequest,
    Embedded,
    EmbedRequest,
    Fields,
    Submission,
    TokenizeRequest,
    lengths_of,
)
from attnserve.server.engine.tokenize import Encoded
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.memory.ledger import Holds


async def embed(model: ServedModel, request: EmbedRequest, holds: Holds, deadline: float | None) -> Embedded:
    model.require("embedding", EMBEDDER)
    names = request.names
    count = len(request.texts) or len(request.token_ids)
    if not count:
        raise InvalidArgument(names.sequences, "empty: send at least one sequence")
    manifest = model.manifest
    if not manifest.dense and (request.chunking or not (request.outputs or request.layers) or
                               request.outputs - {HIDDEN_OUTPUT, *manifest.head_outputs}):
        raise InvalidArgument("model", f"{model.name!r} has no dense vectors (its heads: "
                              f"{', '.join(manifest.heads)}): ask for those")
    texts = bool(request.texts)
    multi = MULTI_VECTOR_OUTPUT in request.outputs
    side = multi_vector.side_of(model, request.prompt_name, "prompt_name") if multi else None
    prompt = None if side is not None else model.prompt(request.prompt_name, texts)
    left = model.left(request.truncation_direction, texts)
    dimensions = _dimensions(model, request)
    if request.chunking is not None:
        return await embed_chunked(model, request, prompt, dimensions, holds, deadline)
    # The cheap bounds first, from the count of sequences alone (each has at least an empty text's tokens, or
    # one id): a request that cannot be served is refused before any text is tokenized or any id read.
    least = len(model.tokenizer.empty.ids) if texts else 1
    model.scheduler.admit(count * least, at_least=True)
    request.size.check(np.full(count, least), at_least=True)
    attended = None
    if side is not None:
        if not texts:
            raise InvalidArgument(names.sequences, f"{model.name!r} tokenizes a query or a "
                                  "document its own way: send texts")
        tokens = await multi_vector.tokenize(model, request.texts, request.prompt_name, side,
                                             names.sequence, holds)
        ids, lengths, attended = tokens.ids, tokens.lengths, tokens.attended
    elif texts:
        encoded = await model.tokenize(request.texts, request.truncate, names.sequence, holds,
                                       prompt=prompt, left=left)
        ids = [e.ids for e in encoded]
        lengths = lengths_of(ids)
    else:
        with model.stage("tokenize"):
            ids, lengths = await model.offload.request(
                cost(request.token_ids, ID_SEQUENCE_S, TOKEN_ID_S), _read_ids, model,
                request.token_ids, request.truncate, names)
    size = request.size.check(lengths)
    results = await model.run_pooled(
        Submission(ids, lengths, request.layers, deadline, request.outputs, attended=attended),
        names.sequence, size, holds, prompt, dimensions)
    if multi:
        multi_vector.keep(model, results, ids, side)
    return Embedded(ids, lengths, results, response_bytes=size)


def _dimensions(model: ServedModel, request: EmbedRequest) -> int:
    """The size pooled vectors are cut to, checked; 0: the vectors' size (no cut)."""
    dimensions, size = request.dimensions, model.manifest.embedding_size
    if dimensions in (0, size):
        return 0
    if not model.manifest.matryoshka_dims:
        raise InvalidArgument("dimensions", f"{quote(dimensions)}; {model.name!r} declares no "
                              "Matryoshka sizes: omit dimensions or set it to its one size, "
                              f"{size}")
    if dimensions not in model.dimensions:
        raise InvalidArgument("dimensions", f"{quote(dimensions)}; {model.name!r} takes "
                              f"{', '.join(map(str, model.dimensions))}")
    if request.chunking is None and not set(request.outputs) & POOLED.keys():
        raise InvalidArgument("dimensions", "cuts the pooled vector: ask for one")
    return dimensions


def _read_ids(model: ServedModel, token_ids: Sequence[Sequence[int]], truncate: bool,
              names: Fields) -> tuple[list[np.ndarray], np.ndarray]:
    """Caller-supplied ids, taken as they are (the caller adds special tokens), and their lengths: a Python
    loop over the sequences, which lets the interpreter go between them. A sequence longer than the model
    takes is refused, or only its first max_positions ids are read."""
    limit = model.manifest.max_positions
    sequences = []
    for i, entry in enumerate(token_ids):
        count = len(entry)
        if count == 0:
            raise InvalidArgument(names.sequence(i), "empty sequence")
        if count > limit and not truncate:
            raise InvalidArgument(
                names.sequence(i), f"{count} tokens, longer than the model's {limit} "
                "positions; set truncate=true to cut it")
        sequences.append(_vocabulary_ids(model, entry[:limit] if count > limit else entry, i, names))
    return sequences, lengths_of(sequences)


def _vocabulary_ids(model: ServedModel, entry: Sequence[int], index: int, names: Fields) -> np.ndarray:
    """Sequence `index`'s ids as int64, refused (naming the first) where one lies outside the vocabulary."""
    vocab = model.manifest.vocab_size
    try:
        ids = np.asarray(entry, dtype=np.int64)
    except OverflowError:  # an integer past int64 (JSON's are unbounded)
        ids = np.asarray([min(max(int(x), -1), vocab) for x in entry], np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        j = int(bad[0])
        raise InvalidArgument(names.token(index, j), f"id {quote(entry[j])} is outside the "
                              f"vocabulary [0, {vocab})")
    return ids


async def tokenize(model: ServedModel, request: TokenizeRequest, holds: Holds) -> list[Encoded]:
    """Ids, tokens, character offsets and special-token flags of each text; the door holds its response."""
    model.check_serving()
    if not request.texts:
        raise InvalidArgument(request.names.sequences, "empty: send at least one text")
    prompt = model.prompt(request.prompt_name)
    return await model.tokenize(request.texts, request.truncate, request.names.sequence, holds,
                                True, prompt, model.left(request.truncation_direction),
                                request.special_tokens)


async def decode(model: ServedModel, request: DecodeRequest, holds: Holds) -> list[str]:
    """Each id sequence as text; the door holds its response."""
    model.check_serving()
    if not request.token_ids:
        raise InvalidArgument(request.names.sequences, "empty: send at least one sequence")
    return await model.offload.request(
        cost(request.token_ids, ID_SEQUENCE_S, TOKEN_ID_S + DECODE_ID_S), _decode, model,
        request, holds)


def _decode(model: ServedModel, request: DecodeRequest, holds: Holds) -> list[str]:
    names = request.names
    for i, entry in enumerate(request.token_ids):
        if not entry:
            raise InvalidArgument(names.sequence(i), "empty sequence")
        _vocabulary_ids(model, entry, i, names)
    return model.tokenizer.decode(request.token_ids, request.skip_special_tokens, holds)
