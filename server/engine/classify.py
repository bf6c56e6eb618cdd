"""Texts, alone or in pairs, through a sequence classifier: every label's score of each, from one batched run
of the scores graph. The activation is the model's (its problem_type's: softmax over the labels, a sigmoid
each, or none for regression) unless the request names one (none: the logits, raw scores); how many labels a
door answers, and in what order, is the door's."""

import numpy as np

from attnserve.artifact import ACTIVATIONS, CLASSIFIER, LOGITS_OUTPUT, RERANKER
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import TEXT_CHAR_S, TEXT_S, cost
from attnserve.server.engine.requests import Classified, ClassifyRequest, Submission, check_cut, lengths_of
from attnserve.server.engine.tokenize import TooLong
from attnserve.server.errors import InvalidArgument
from attnserve.server.memory.ledger import Holds


async def classify(model: ServedModel, request: ClassifyRequest, holds: Holds,
                   deadline: float | None) -> Classified:
    model.require("classification", CLASSIFIER, RERANKER)
    names = request.names
    count = len(request.texts)
    if not count:
        raise InvalidArgument(names.sequences, "empty: send at least one text")
    check_cut(names.top_k, request.top_k, "every label")
    left = model.left(request.truncation_direction)
    model.scheduler.admit(count * len(model.tokenizer.empty.ids), at_least=True)
    size = request.size.check(np.zeros(count, dtype=np.int64))
    with model.stage("tokenize"):
        ids, segments = await model.offload.request(
            cost([*request.texts, *filter(None, request.text_pairs)], TEXT_S, TEXT_CHAR_S),
            _encode, model, request, left, holds)
    lengths = lengths_of(ids)
    results = await model.run(Submission(ids, lengths, deadline=deadline,
                                         outputs=frozenset({LOGITS_OUTPUT}), segments=segments),
                              names.sequence, size, holds)
    logits = np.stack([r.pooled[LOGITS_OUTPUT] for r in results]).astype(np.float32)
    activation = request.activation or model.manifest.activation
    return Classified(ACTIVATIONS[activation](logits), int(lengths.sum()), size)


def _encode(model: ServedModel, request: ClassifyRequest, left: bool,
            holds: Holds) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Each input's ids, and where its second segment starts (its length for a text
    alone; None when the model takes no token types)."""
    names, tokenizer = request.names, model.tokenizer
    pairs = list(request.text_pairs) or [None] * len(request.texts)
    alone = [i for i, pair in enumerate(pairs) if pair is None]
    ids: list[np.ndarray | None] = [None] * len(pairs)
    starts = np.zeros(len(pairs), dtype=np.int64)
    try:
        for i, encoded in zip(alone, tokenizer.encode([request.texts[i] for i in alone],
                                                      request.truncate, holds, left=left),
                              strict=True):
            ids[i] = np.asarray(encoded.ids, dtype=np.int64)
            starts[i] = len(ids[i])
    except TooLong as err:
        raise InvalidArgument(names.sequence(alone[err.index]), err.reason) from err
    for i, pair in enumerate(pairs):
        if pair is None:
            continue
        try:
            (ids[i],), segment = tokenizer.encode_pairs(request.texts[i], [pair],
                                                        request.truncate, holds, left=left)
        except TooLong as err:
            field = names.sequence(i) if err.index < 0 else names.pair(i)
            raise InvalidArgument(field, err.reason) from err
        starts[i] = len(ids[i]) if segment is None else segment[0]
    return ids, starts if tokenizer.pair.segments else None
