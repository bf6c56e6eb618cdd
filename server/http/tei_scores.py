"""text-embeddings-inference's scoring routes, through the data plane: POST /rerank (a
reranker scores each (query, text) pair; `[{index, score, text?}]`, highest score first)
and POST /similarity (an embedding model's cosine of the source sentence's pooled vector
and each sentence's; `[score, ...]` in the sentences' order). Errors come in TEI's shape,
{"error": "...", "error_type": "..."}.

Neither route names a model, as TEI serves one: each is answered by the first model of
the kind it takes (the first reranker, the first embedding model), or, beyond TEI's
fields, by the one `model` names."""

from dataclasses import dataclass

import orjson
from aiohttp import web

from attnserve.artifact import EMBEDDER, RERANKER
from attnserve.server.engine import pairs
from attnserve.server.engine.offload import RESULT_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import (
    Fields,
    RerankRequest,
    ResponseSize,
    ScoreMode,
    ScoreRequest,
)
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.http.calls import JSON_CHAR_BYTES, HttpCalls
from attnserve.server.http.tei_shape import refusal
from attnserve.server.memory.ledger import Holds

# A result's JSON around its text: {"index":N,"score":F,"text":""}, and a score's text.
RESULT_BYTES = 64
SCORE_BYTES = 16
ADVICE = "send fewer texts, or leave return_text unset"


RERANK = Fields("texts")
SIMILARITY = Fields("inputs.sentences", query="inputs.source_sentence")


def _dict(value, field: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(field, "expected a JSON object")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise InvalidArgument(name, f"{quote(value)}; expected true or false")
    return value


def _string(value, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(field, "required, a string" if value is None else
                              f"{quote(value)}; expected a string")
    return value


def _strings(value, names: Fields) -> list[str]:
    if not isinstance(value, list):
        raise InvalidArgument(names.sequences, "required, a list of strings" if value is None
                              else f"{quote(value)}; expected a list of strings")
    for i, text in enumerate(value):
        _string(text, names.sequence(i))
    return value


def _model(body: dict) -> str | None:
    model = body.get("model")
    return None if model is None else _string(model, "model")


@dataclass(frozen=True)
class Rerank:
    model: str | None
    query: str
    texts: list[str]
    truncate: bool
    raw_scores: bool
    return_text: bool

    @classmethod
    def parse(cls, body) -> "Rerank":
        body = _dict(body, "body")
        query = _string(body.get("query"), "query")
        return cls(_model(body), query, _strings(body.get("texts"), RERANK), _flag(body, "truncate"),
                   _flag(body, "raw_scores"), _flag(body, "return_text"))


@dataclass(frozen=True)
class Similarity:
    model: str | None
    source: str
    sentences: list[str]
    truncate: bool

    @classmethod
    def parse(cls, body) -> "Similarity":
        body = _dict(body, "body")
        inputs = _dict(body.get("inputs"), "inputs")
        source = _string(inputs.get("source_sentence"), SIMILARITY.query)
        return cls(_model(body), source, _strings(inputs.get("sentences"), SIMILARITY),
                   _flag(body, "truncate"))


class TeiScores:
    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int):
        self.refusal = refusal
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/rerank", self.rerank), web.post("/similarity", self.similarity)]

    async def _rerank(self, request: web.Request, holds: Holds) -> web.Response:
        parsed = await self.calls.json_body(request, holds, Rerank.parse)
        model = self.plane.model(parsed.model, kind=RERANKER)
        texts = parsed.texts

        def measure(indexes) -> int:
            text = sum(len(texts[i]) for i in indexes.tolist()) if parsed.return_text else 0
            return 64 + len(indexes) * RESULT_BYTES + JSON_CHAR_BYTES * text

        reranked = await pairs.rerank(model, RerankRequest(
            RERANK, ResponseSize(measure, self.max_response_bytes, ADVICE), parsed.query, texts,
            raw_scores=parsed.raw_scores, truncate=parsed.truncate), holds, None)

        def body() -> bytes:
            return orjson.dumps([
                {"index": i, "score": score} | ({"text": texts[i]} if parsed.return_text else {})
                for i, score in zip(reranked.order.tolist(), reranked.scores.tolist(), strict=True)])

        payload = await model.pack(len(texts) * RESULT_S, body)
        return web.Response(body=payload, content_type="application/json")

    async def _similarity(self, request: web.Request, holds: Holds) -> web.Response:
        parsed = await self.calls.json_body(request, holds, Similarity.parse)
        model = self.plane.model(parsed.model, kind=EMBEDDER)
        size = ResponseSize(lambda lengths: 64 + len(lengths) * SCORE_BYTES,
                            self.max_response_bytes, "send fewer sentences")
        scored = await pairs.score(model, ScoreRequest(SIMILARITY, size, parsed.source, parsed.sentences,
                                                ScoreMode.COSINE, parsed.truncate), holds, None)
        payload = await model.pack(len(scored.scores) * RESULT_S, orjson.dumps,
                                   scored.scores.tolist())
        return web.Response(body=payload, content_type="application/json")

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/rerank", request,
                                       lambda holds: self._rerank(request, holds), refusal)

    async def similarity(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/similarity", request,
                                       lambda holds: self._similarity(request, holds), refusal)
