"""Texts scored against a query: by a reranker (a cross-encoder), each (query, text) pair one sequence batched
with every other of its model, scored by its classifier (`rerank`); or by an embedding model, from the vectors
of the query and each text (cosine of pooled vectors, MaxSim of token vectors: `score`). The scores, and the
ranking every rerank route returns, are computed here from the outputs."""

from collections.abc import Sequence

import numpy as np

from attnserve.artifact import EMBEDDER, LOGITS_OUTPUT, MULTI_VECTOR_OUTPUT, RERANKER, pooled_output, sigmoid
from attnserve.server.engine import multi_vector
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, MAXSIM_S, TEXT_CHAR_S, TEXT_S, cost
from attnserve.server.engine.pooling import unit
from attnserve.server.engine.requests import (
    Fields,
    Reranked,
    RerankRequest,
    Scored,
    ScoreMode,
    ScoreRequest,
    Submission,
    check_cut,
    lengths_of,
)
from attnserve.server.engine.tokenize import TooLong
from attnserve.server.errors import InvalidArgument
from attnserve.server.memory.ledger import Holds
from attnserve.server.runtime.backend import HIDDEN_ONLY


async def rerank(model: ServedModel, request: RerankRequest, holds: Holds,
                 deadline: float | None) -> Reranked:
    """Each (query, text) pair one sequence, scored by the classifier's one label (its
    sigmoid, or its logit with raw_scores); the texts ranked by score."""
    model.require("rerank", RERANKER)
    names, labels = request.names, model.manifest.labels
    if len(labels) != 1:
        raise InvalidArgument("model", f"{model.name!r} has {len(labels)} labels "
                              f"({', '.join(map(repr, labels[:8]))}): rerank ranks by one "
                              "score; its logits come from raw tensor inference")
    _check_pairs(request.query, request.texts, names)
    check_cut(names.top_n, request.top_n, "every text")
    left = model.left(request.truncation_direction)
    count = len(request.texts)
    shown = count if request.top_n is None else min(count, request.top_n)
    least = model.tokenizer.pair.specials + 1  # an empty text's pair with a one-token query
    model.scheduler.admit(count * least, at_least=True)
    with model.stage("tokenize"):
        ids, segments, size = await model.offload.request(
            cost(request.texts, TEXT_S, TEXT_CHAR_S), _pairs, model, request, shown, left, holds)
    lengths = lengths_of(ids)
    results = await model.run(Submission(ids, lengths, deadline=deadline,
                                         outputs=frozenset({LOGITS_OUTPUT}), segments=segments),
                              names.sequence, size, holds)
    logits = np.fromiter((r.pooled[LOGITS_OUTPUT][0] for r in results), np.float32, count)
    scores = logits if request.raw_scores else sigmoid(logits)
    order = np.argsort(-scores, kind="stable")[:request.top_n]
    return Reranked(order, scores[order], int(lengths.sum()), size)


def _check_pairs(query: str, texts: Sequence[str], names: Fields) -> None:
    if not query:
        raise InvalidArgument(names.query, "empty: send the query to score the texts against")
    if not texts:
        raise InvalidArgument(names.sequences, "empty: send at least one text")


def _pairs(model: ServedModel, request: RerankRequest, shown: int, left: bool,
           holds: Holds) -> tuple[list[np.ndarray], np.ndarray | None, int]:
    """The pairs' ids and segments, and the response's size: measured for the `shown`
    longest texts, which no top_n of them can outgrow."""
    texts = request.texts
    chars = lengths_of(texts)
    size = request.size.check(np.argsort(-chars, kind="stable")[:shown])
    try:
        ids, segments = model.tokenizer.encode_pairs(request.query, texts, request.truncate,
                                                     holds, request.max_text_tokens, left)
    except TooLong as err:
        field = request.names.query if err.index < 0 else request.names.sequence(err.index)
        raise InvalidArgument(field, err.reason) from err
    return ids, segments, size


async def score(model: ServedModel, request: ScoreRequest, holds: Holds, deadline: float | None) -> Scored:
    """The query and each text embedded (pooled vectors for COSINE, every token's for
    MAXSIM, which never leave the server), each text scored against the query."""
    model.require("scoring", EMBEDDER)
    names = request.names
    _check_pairs(request.query, request.texts, names)
    count = len(request.texts)
    least = len(model.tokenizer.empty.ids)
    model.scheduler.admit((count + 1) * least, at_least=True)
    request.size.check(np.full(count, least), at_least=True)
    # The query, then each text, each with the prompt Embed would give it.
    prompt = model.prompt(request.prompt_name)

    def field_of(index: int) -> str:
        return names.query if index == 0 else names.sequence(index - 1)

    if request.mode is ScoreMode.COSINE and not model.manifest.dense:
        raise InvalidArgument("mode", f"cosine scores pooled vectors, and {model.name!r} has "
                              f"none (its heads: {', '.join(model.manifest.heads)})")
    # MAXSIM on a multi-vector head: the query tokenized as its checkpoint tokenizes a query,
    # the texts as documents (or all alike, bge-m3's), scored by the head's similarity.
    head = model.manifest.multi_vector if request.mode is ScoreMode.MAXSIM else None
    query_side = None if head is None else multi_vector.side_of(model, "query", "mode")
    attended = None
    if query_side is None:
        encoded = await model.tokenize([request.query, *request.texts], request.truncate,
                                       field_of, holds, prompt=prompt,
                                       left=model.left(request.truncation_direction))
        ids = [e.ids for e in encoded]
        lengths = lengths_of(ids)
    else:
        query = await multi_vector.tokenize(model, [request.query], "query", query_side, field_of, holds)
        texts = await multi_vector.tokenize(model, request.texts, "document", head.document,
                                            lambda i: field_of(i + 1), holds)
        ids = query.ids + texts.ids
        lengths = np.concatenate([query.lengths, texts.lengths])
        attended = np.concatenate([query.attended, texts.attended])
    size = request.size.check(lengths[1:])
    if request.mode is ScoreMode.MAXSIM:
        outputs, dim = ((HIDDEN_ONLY, model.manifest.hidden_size) if head is None
                        else (frozenset({MULTI_VECTOR_OUTPUT}), head.dim))
        # Every token's vector (float32) is kept until the texts are scored.
        results = await model.run(Submission(ids, lengths, deadline=deadline, outputs=outputs,
                                             attended=attended), field_of, size, holds,
                                  kept_bytes=4 * dim * int(lengths.sum()))
        work = MAXSIM_S * dim * int(lengths[0]) * int(lengths[1:].sum())
        if head is None:  # every token's hidden state
            vectors, mean = [r.hidden for r in results], False
        else:
            multi_vector.keep(model, results[:1], ids[:1], query_side)
            multi_vector.keep(model, results[1:], ids[1:], head.document)
            vectors, mean = [r.pooled[MULTI_VECTOR_OUTPUT] for r in results], head.similarity == "meanmaxsim"
        scores = await model.offload.response(work, multi_vector.maxsim, vectors[0], vectors[1:], mean,
                                              head is None)
    else:
        name = pooled_output(model.manifest.default_pooling, True)
        results = await model.run_pooled(Submission(ids, lengths, deadline=deadline,
                                                    outputs=frozenset({name})),
                                         field_of, size, holds, prompt, 0)
        scores = await model.offload.response(count * model.manifest.embedding_size * COPY_BYTE_S,
                                              cosines, results[0].pooled[name],
                                              [r.pooled[name] for r in results[1:]])
    return Scored(scores, int(lengths.sum()), size)


def cosines(query: np.ndarray, texts: list[np.ndarray]) -> np.ndarray:
    """float32 [texts]: the cosine of the query's vector (hidden,) and each text's."""
    return unit(np.stack(texts)) @ unit(query)

