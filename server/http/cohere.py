"""The rerank API of Cohere and Jina, through the data plane: POST /v1/rerank (Cohere's v1,
Jina's) and POST /v2/rerank (Cohere's v2), which LangChain's, LlamaIndex's and Haystack's
rerank integrations call. A reranker scores each (query, document) pair; the answer is
`{id, model, results: [{index, relevance_score, document?}], usage: {total_tokens}}`,
highest score first, relevance_score the classifier's sigmoid (in [0, 1], as theirs).
Errors come in Cohere's shape, {"message": "..."}.

`documents`: strings, or objects whose `text` is ranked (Cohere's and Jina's); `top_n`:
the best top_n only; `return_documents` (v1, default false): each result carries its
document as {"text": ...}; `max_tokens_per_doc` (v2): each document cut to at most that
many tokens. `model` names a reranker; omitted, the server's first reranker answers.
Beyond their fields, `truncate` (default false) cuts a pair's document (never its
query) where the pair is longer than the model's positions, instead of refusing it."""

import uuid
from dataclasses import dataclass

import orjson
from aiohttp import web

from attnserve.artifact import RERANKER
from attnserve.server.engine import pairs
from attnserve.server.engine.offload import RESULT_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import Fields, RerankRequest, ResponseSize
from attnserve.server.errors import InvalidArgument, RequestError, quote
from attnserve.server.http.calls import JSON_CHAR_BYTES, HttpCalls
from attnserve.server.memory.ledger import Holds

# A result's JSON around its document: {"index":N,"relevance_score":F,"document":{"text":""}}.
RESULT_BYTES = 96
ADVICE = "set top_n, leave return_documents unset, or send fewer documents"


NAMES = Fields("documents")


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and type(value) is not int:  # bool is an int to Python, not to JSON
        raise InvalidArgument(name, f"{quote(value)}; expected an integer")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(name, f"{quote(value)}; expected true or false")
    return value


def _documents(value) -> list[str]:
    if not isinstance(value, list):
        raise InvalidArgument("documents", "required, a list of strings or of objects with a "
                              "text" if value is None else f"{quote(value)}; expected a list")
    texts = []
    for i, document in enumerate(value):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise InvalidArgument(f"documents[{i}]", f"{quote(document)}; expected a string or "
                                  'an object with a "text" string')
        texts.append(text)
    return texts


@dataclass(frozen=True)
class Parsed:
    model: str | None
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool
    max_tokens_per_doc: int | None
    truncate: bool


def parse(body) -> Parsed:
    if not isinstance(body, dict):
        raise InvalidArgument("body", "expected a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgument("model", f"{quote(model)}; expected a string")
    query = body.get("query")
    if not isinstance(query, str):
        raise InvalidArgument("query", "required, a string" if query is None else
                              f"{quote(query)}; expected a string")
    per_doc = _optional_int(body, "max_tokens_per_doc")
    if per_doc is not None and per_doc < 1:
        raise InvalidArgument("max_tokens_per_doc", f"{per_doc}; expected 1 or more")
    return Parsed(model, query, _documents(body.get("documents")), _optional_int(body, "top_n"),
                  _flag(body, "return_documents"), per_doc, _flag(body, "truncate"))


class RerankHttp:
    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int):
        self.refusal = refusal
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/rerank", self.handle), web.post("/v2/rerank", self.handle)]

    async def _rerank(self, request: web.Request, holds: Holds) -> web.Response:
        parsed = await self.calls.json_body(request, holds, parse)
        model = self.plane.model(parsed.model, kind=RERANKER)
        texts = parsed.documents

        def measure(indexes) -> int:
            text = sum(len(texts[i]) for i in indexes.tolist()) if parsed.return_documents else 0
            return 256 + len(model.name) * JSON_CHAR_BYTES + len(indexes) * RESULT_BYTES \
                + JSON_CHAR_BYTES * text

        reranked = await pairs.rerank(model, RerankRequest(
            NAMES, ResponseSize(measure, self.max_response_bytes, ADVICE), parsed.query, texts,
            parsed.top_n, truncate=parsed.truncate, max_text_tokens=parsed.max_tokens_per_doc),
            holds, None)

        def body() -> bytes:
            results = [{"index": i, "relevance_score": score}
                       | ({"document": {"text": texts[i]}} if parsed.return_documents else {})
                       for i, score in zip(reranked.order.tolist(), reranked.scores.tolist(),
                                           strict=True)]
            return orjson.dumps({"id": str(uuid.uuid4()), "model": model.name, "results": results,
                                 "usage": {"total_tokens": reranked.total_tokens}})

        payload = await model.pack(len(reranked.order) * RESULT_S, body)
        return web.Response(body=payload, content_type="application/json")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer(f"http:{request.path}", request,
                                       lambda holds: self._rerank(request, holds), refusal)


def refusal(err: RequestError, status: int) -> web.Response:
    return web.json_response({"message": err.message}, status=status)
