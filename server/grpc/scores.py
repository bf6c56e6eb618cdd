"""attnserve.v1's Rerank and Score, between protobuf and the data plane: their field names,
their requests, and their responses, sized before any work is done for them."""

import numpy as np

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.engine.requests import (
    Reranked,
    RerankRequest,
    ResponseSize,
    Scored,
    ScoreMode,
    ScoreRequest,
)
from attnserve.server.errors import InvalidArgument
from attnserve.server.grpc.wire import field_bytes, varint_bytes

SCORE_MODES = {pb.SCORE_MODE_COSINE: ScoreMode.COSINE, pb.SCORE_MODE_MAXSIM: ScoreMode.MAXSIM}
RERANK_ADVICE = "set top_n, leave return_texts unset, or send fewer texts"
SCORE_ADVICE = "send fewer texts"
# One result's index (a uint32) and score (a float), each with its one-byte tag, and the
# text's tag and length prefix (at the largest, 5 bytes).
RESULT_BYTES = (1 + 5) + (1 + 4) + (1 + 5)
# A UTF-8 character takes at most this many bytes.
UTF8_MAX = 4


class PairFields:
    query = "query"
    sequences = "texts"
    top_n = "top_n"

    def sequence(self, index: int) -> str:
        return f"texts[{index}]"


PAIRS = PairFields()


def _head_bytes(model: str) -> int:
    """model and total_tokens, at the largest"""
    return field_bytes(len(model.encode())) + 1 + varint_bytes((1 << 63) - 1)


def rerank_request(request: pb.RerankRequest, model: str, limit: int) -> RerankRequest:
    texts = request.texts

    def measure(indexes: np.ndarray) -> int:
        total = _head_bytes(model) + len(indexes) * field_bytes(RESULT_BYTES)
        if request.return_texts:
            total += UTF8_MAX * sum(len(texts[i]) for i in indexes.tolist())
        return total

    return RerankRequest(PAIRS, ResponseSize(measure, limit, RERANK_ADVICE), request.query, texts,
                         request.top_n if request.HasField("top_n") else None,
                         request.raw_scores, request.truncate)


def rerank_response(reranked: Reranked, request: pb.RerankRequest, model: str) -> pb.RerankResponse:
    response = pb.RerankResponse(model=model, total_tokens=reranked.total_tokens)
    texts = request.texts
    for index, score in zip(reranked.order.tolist(), reranked.scores.tolist(), strict=True):
        response.results.append(pb.RerankResult(
            index=index, score=score, text=texts[index] if request.return_texts else ""))
    return response


def score_request(request: pb.ScoreRequest, model: str, limit: int) -> ScoreRequest:
    if request.mode not in SCORE_MODES:
        what = (pb.ScoreMode.Name(request.mode) if request.mode in pb.ScoreMode.values()
                else f"unknown value {request.mode}")
        raise InvalidArgument("mode", f"{what}; name one: SCORE_MODE_COSINE or SCORE_MODE_MAXSIM")
    size = ResponseSize(lambda lengths: _head_bytes(model) + field_bytes(4 * len(lengths)),
                        limit, SCORE_ADVICE)
    return ScoreRequest(PAIRS, size, request.query, request.texts, SCORE_MODES[request.mode],
                        request.truncate)


def score_response(scored: Scored, model: str) -> pb.ScoreResponse:
    return pb.ScoreResponse(scores=scored.scores.tolist(), model=model,
                            total_tokens=scored.total_tokens)
