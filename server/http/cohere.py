"""The rerank API of Cohere and Jina, through the data plane: POST /v1/rerank (Cohere's v1,
Jina's) and POST /v2/rerank (Cohere's v2), which LangChain's, LlamaIndex's and Haystack's
rerank integrations call, in their bodies, answers and error shape (docs/api.md, "HTTP:
Cohere and Jina"); relevance_score is the classifier's sigmoid, in [0, 1] as theirs."""

import uuid

from aiohttp import web

from attnserve.artifact import RERANKER
from attnserve.server.engine import pairs
from attnserve.server.engine.offload import RESULT_S
from attnserve.server.engine.requests import Fields, RerankRequest
from attnserve.server.errors import RequestError
from attnserve.server.http import schemas as s
from attnserve.server.http.calls import JSON_CHAR_BYTES
from attnserve.server.http.door import Door, encode, json_response, packed
from attnserve.server.memory.ledger import Holds

# A result's JSON around its document: {"index":N,"relevance_score":F,"document":{"text":""}}.
RESULT_BYTES = 96
ADVICE = "set top_n, leave return_documents unset, or send fewer documents"
NAMES = Fields("documents")


class CohereDoor(Door):
    def routes(self) -> list[web.RouteDef]:
        return [self.route("POST", "/v1/rerank", self.rerank), self.route("POST", "/v2/rerank", self.rerank)]

    @staticmethod
    def refusal(err: RequestError, status: int) -> web.Response:
        return json_response(s.CohereError(err.message), status)

    async def rerank(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.CohereRerank)
        model = self.plane.model(body.model, kind=RERANKER)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]

        def measure(indexes) -> int:
            text = sum(len(texts[i]) for i in indexes.tolist()) if body.return_documents else 0
            return 256 + (len(model.name) + text) * JSON_CHAR_BYTES + len(indexes) * RESULT_BYTES

        reranked = await pairs.rerank(model, RerankRequest(
            NAMES, self.size(measure, ADVICE), body.query, texts, body.top_n,
            truncate=bool(body.truncate), max_text_tokens=body.max_tokens_per_doc), holds, None)

        def answer() -> bytes:
            results = [s.CohereResult(i, score, *((s.Document(texts[i]),) if body.return_documents else ()))
                       for i, score in zip(reranked.order.tolist(), reranked.scores.tolist(), strict=True)]
            return encode(s.CohereRanking(str(uuid.uuid4()), model.name, results,
                                          s.CohereUsage(reranked.total_tokens)))

        return await packed(model, len(reranked.order) * RESULT_S, answer)
