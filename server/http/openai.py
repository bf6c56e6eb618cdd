"""POST /v1/embeddings as OpenAI defines it, through the data plane: the JSON body becomes an
EmbedRequest for vectors of the model's pooling, normalised (as OpenAI's are), and the result
becomes OpenAI's list of embeddings (floats, or base64 of little-endian float32); errors
come back in OpenAI's shape {"error": {"message", "type", "param", "code"}}, and a field the
route does not know is refused, as OpenAI's API refuses it. `model` names one of the
server's models, as GET /v1/models lists them; without it, the server's default (its
first) answers, as TEI's, Infinity's and vLLM's do. Infinity serves the same API without
/v1 (POST /embeddings, GET /models), with a few fields of its own both ways and, as its
pydantic models, no refusal of fields it does not know: those routes are here too, on the
same code.

Token-id inputs are the model's own vocabulary (not OpenAI's tiktoken ids), special tokens
included, as gRPC's token_ids are. `dimensions` cuts the vectors to one of the model's
Matryoshka sizes. Beyond OpenAI's fields, `truncate` (default false) cuts texts longer than
the model's positions instead of refusing them, at their end or, with
`truncation_direction` "left", at their start; `prompt_name` names one of the model's
prompts to put before every text (default: the server's default prompt); and `chunking`
({"max_tokens": N, "mode": "late" or "isolated", "window_overlap": N}, as attnserve.v1's
Chunking) embeds each text as chunks: `data` then holds one item per chunk, in order,
each with OpenAI's fields and `input_index` (the text it is a chunk of), `start` and `end`
(code points into that text, end exclusive) and `num_tokens`. The `openai` client keeps
fields it does not know (`model_extra`) and sends this one as `extra_body`. `usage`
counts the tokens run through the model, every window's or chunk's. `embedding_types`
(Cohere's) and `embedding_dtype` choose how the vectors are written
(server/http/vectors.py)."""

import time
import uuid

import msgspec
import numpy as np
import orjson
from aiohttp import web

from attnserve.artifact import CLASSIFIER, pooled_output
from attnserve.server.engine import classify, embed, sparse
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, FLOAT_TEXT_S, RESULT_S
from attnserve.server.engine.requests import (
    Chunking,
    ChunkingMode,
    ClassifyRequest,
    Embedded,
    EmbedRequest,
    ResponseSize,
    SparseEmbedded,
    SparseRequest,
    TruncationDirection,
)
from attnserve.server.errors import InvalidArgument, RequestError, quote
from attnserve.server.http.calls import JSON_CHAR_BYTES, JSON_FLOAT_BYTES
from attnserve.server.http.door import Door, encode, json_response, numbers
from attnserve.server.http.schemas import (
    Classification,
    Classify,
    ClassifyData,
    ClassifyUsage,
    Embedding,
    EmbeddingList,
    Embeddings,
    InfinityEmbeddings,
    Model,
    ModelList,
    OpenAIError,
    OpenAIErrorDetail,
    Usage,
    sequences,
)
from attnserve.server.http.vectors import VectorFormat
from attnserve.server.memory.ledger import Holds

# The model Infinity's clients name when they name none.
INFINITY_DEFAULT_MODEL = "default/not-specified"
# Infinity's model objects say who owns them as a constant its own client insists on.
INFINITY_OWNER = "infinity"
ITEM_BYTES = 64
"""{"object":"embedding","index":N,"embedding":...} around each vector"""
CHUNK_ITEM_BYTES = 128
""","input_index":N,"start":N,"end":N,"num_tokens":N in a chunk's item"""
ADVICE = "send fewer inputs per request, or use encoding_format=base64"
OWNED_BY = "attnserve"
SPARSE_ENTRY_BYTES = 23
"""a sparse entry's id and weight as numbers, with their commas, at the longest"""
CLASS_BYTES = 160
"""{"index":N,"label":"","probs":[],"num_classes":N} around an input's scores, and its label"""
CHUNKED_ADVICE = "raise chunking.max_tokens, use encoding_format=base64, or send less text"
# HTTP status -> OpenAI's error `type` and `code`.
ERROR_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    408: ("invalid_request_error", "timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


class OpenAIDoor(Door):
    """POST /v1/embeddings, and the models listed as OpenAI lists them: GET /v1/models and
    GET /v1/models/{model}; Infinity's POST /embeddings and GET /models, OpenAI's without
    /v1, their bodies Infinity's (the answer's `id` and `created`, each model's `backend`,
    `capabilities` and `stats`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.created = int(time.time())
        """when the models were loaded: OpenAI's `created` of each model"""

    def routes(self) -> list[web.RouteDef]:
        return [self.route("POST", "/v1/embeddings", self.embeddings),
                self.route("GET", "/v1/models", self.list_models),
                self.route("GET", "/v1/models/{model:.+}", self.get_model,
                           "http:/v1/models/{model}"),
                self.route("POST", "/embeddings", self.infinity_embeddings),
                self.route("POST", "/classify", self.classify),
                self.route("GET", "/models", self.infinity_models)]

    @staticmethod
    def refusal(err: RequestError, status: int) -> web.Response:
        kind, code = ERROR_KINDS.get(status, ("server_error", None))
        return json_response(OpenAIError(OpenAIErrorDetail(err.message, kind, err.field, code)),
                             status)

    def _request(self, body: Embeddings, model: ServedModel, vectors: VectorFormat) -> EmbedRequest:
        """The model's request for a body: the response's size depends on the model."""
        item = ITEM_BYTES + vectors.vector_bytes(model.manifest.embedding_size)
        head = head_bytes(model)
        if body.chunking is None:
            size = ResponseSize(lambda lengths: head + len(lengths) * item,
                                self.max_response_bytes, ADVICE)
            chunking = None
        else:
            size = ResponseSize(lambda counts: head + int(counts.sum()) * (item + CHUNK_ITEM_BYTES),
                                self.max_response_bytes, CHUNKED_ADVICE)
            chunking = Chunking(body.chunking.max_tokens, ChunkingMode(body.chunking.mode),
                                body.chunking.window_overlap)
        inputs, names = sequences(body.input, "input")
        return EmbedRequest(names=names, size=size, truncate=body.truncate,
                            truncation_direction=TruncationDirection(
                                (body.truncation_direction or "right").lower()),
                            prompt_name=body.prompt_name, outputs=frozenset({pooled(model)}),
                            dimensions=body.dimensions or 0, chunking=chunking, normalize=True,
                            **inputs)

    def _answer(self, model: ServedModel, embedded: Embedded, vectors: VectorFormat,
                ranges: dict, infinity: bool) -> bytes:
        name = pooled(model)
        pooled_vectors = [result.pooled[name] for result in embedded.results]
        pooled_vectors += [vector for text in embedded.chunked for vector in text.vectors]
        fields = iter(vectors.fields(np.stack(pooled_vectors), ranges) if pooled_vectors else ())
        data = [Embedding("embedding", index, *next(fields))
                for index in range(len(embedded.results))]
        for text_index, text in enumerate(embedded.chunked):
            for (start, end), count in zip(text.spans.tolist(), text.token_counts.tolist(),
                                           strict=True):
                data.append(Embedding("embedding", len(data), *next(fields), text_index, start, end,
                                      count))
        tokens = embedded.total_tokens
        return encode(EmbeddingList(
            "list", data, model.name, Usage(tokens, tokens),
            *((f"attnserve-{uuid.uuid4()}", int(time.time())) if infinity else ())))

    async def embeddings(self, request: web.Request, holds: Holds,
                         schema: type[Embeddings] = Embeddings) -> web.Response:
        body = await self.calls.json_body(request, holds, schema)
        infinity = schema is InfinityEmbeddings
        if infinity:
            if body.modality != "text":
                raise InvalidArgument("modality", f"{quote(body.modality)}; this server embeds "
                                      "text only")
            body.model = None if body.model == INFINITY_DEFAULT_MODEL else body.model
        model = self.plane.model(body.model)
        if "sparse" in (body.embedding_types or ()):
            return await self._sparse(body, model, holds, infinity)
        if body.sparse_top_k is not None:
            raise InvalidArgument("sparse_top_k", "cuts sparse vectors: ask for embedding_types "
                                  '["sparse"]')
        vectors = VectorFormat.of(body)
        embedded = await embed.embed(model, self._request(body, model, vectors), holds, None)
        count = len(embedded.results) + int(embedded.chunk_counts.sum())
        size = model.manifest.embedding_size
        ranges = vectors.ranges(model.manifest, model.name, pooled(model), body.dimensions or 0)
        payload = await model.pack(count * (RESULT_S + size * FLOAT_TEXT_S), self._answer,
                                   model, embedded, vectors, ranges, infinity)
        return web.Response(body=payload, content_type="application/json")

    async def classify(self, request: web.Request, holds: Holds) -> web.Response:
        """vLLM's /classify: each text's score of every label, by label id, and its best
        label."""
        body = await self.calls.json_body(request, holds, Classify)
        if body.messages is not None:
            raise InvalidArgument("messages", "chat messages are not classified here; send the "
                                  "texts in `input`")
        if body.truncate_prompt_tokens not in (None, -1):
            raise InvalidArgument("truncate_prompt_tokens", f"{body.truncate_prompt_tokens}; "
                                  "expected -1 (cut at the model's positions) or none")
        model = self.plane.model(body.model, kind=CLASSIFIER)
        inputs, names = sequences(body.input, "input", ids=False)
        labels = model.manifest.labels
        item = CLASS_BYTES + max(map(len, labels), default=0) * 6 + len(labels) * JSON_FLOAT_BYTES
        head = head_bytes(model)
        classified = await classify.classify(model, ClassifyRequest(
            names, ResponseSize(
                lambda counts: head + len(counts) * item, self.max_response_bytes,
                "send fewer inputs per request"),
            inputs["texts"], activation="none" if body.use_activation is False else None,
            truncate=body.truncate_prompt_tokens == -1,
            truncation_direction=TruncationDirection(body.truncation_side or "right")),
            holds, None)

        def answer() -> bytes:
            tokens = classified.total_tokens
            return encode(Classification(
                f"classify-{uuid.uuid4().hex}", "list", int(time.time()), model.name,
                [ClassifyData(i, labels[int(row.argmax())], row.tolist(), len(labels))
                 for i, row in enumerate(classified.scores)], ClassifyUsage(tokens, tokens)))

        return web.Response(body=await model.pack(classified.scores.size * RESULT_S, answer),
                            content_type="application/json")

    async def _sparse(self, body: Embeddings, model: ServedModel, holds: Holds,
                      infinity: bool) -> web.Response:
        """embedding_types ["sparse"]: each text's sparse vector as `embeddings.sparse`,
        {"indices", "values"} (the field names of Qdrant's, Pinecone's and fastembed's)."""
        if body.embedding_types != ["sparse"]:
            raise InvalidArgument("embedding_types", f"{body.embedding_types}: a sparse vector "
                                  "comes alone (the served SPLADE models have no dense vectors)")
        for name in ("chunking", "dimensions"):
            if getattr(body, name) is not None:
                raise InvalidArgument(name, "applies to dense vectors, not sparse ones")
        inputs, names = sequences(body.input, "input", ids=False)
        head = head_bytes(model)
        embedded = await sparse.embed_sparse(model, SparseRequest(
            names, ResponseSize(lambda counts: head + len(counts) * ITEM_BYTES
                                + int(counts.sum()) * SPARSE_ENTRY_BYTES,
                                self.max_response_bytes, "set sparse_top_k, or send fewer inputs"),
            inputs["texts"], body.truncate, TruncationDirection(
                (body.truncation_direction or "right").lower()), body.prompt_name,
            body.sparse_top_k), holds, None)
        payload = await model.pack(embedded.response_bytes * COPY_BYTE_S, self._sparse_answer,
                                   model, embedded, infinity)
        return web.Response(body=payload, content_type="application/json")

    @staticmethod
    def _sparse_answer(model: ServedModel, embedded: SparseEmbedded, infinity: bool) -> bytes:
        empty = numbers(np.zeros(0, np.float32))
        data = [Embedding("embedding", i, empty, {"sparse": msgspec.Raw(orjson.dumps(
            {"indices": indices, "values": values}, option=orjson.OPT_SERIALIZE_NUMPY))})
            for i, (indices, values) in enumerate(zip(embedded.indices, embedded.values,
                                                      strict=True))]
        tokens = embedded.total_tokens
        return encode(EmbeddingList(
            "list", data, model.name, Usage(tokens, tokens),
            *((f"attnserve-{uuid.uuid4()}", int(time.time())) if infinity else ())))

    async def infinity_embeddings(self, request: web.Request, holds: Holds) -> web.Response:
        return await self.embeddings(request, holds, InfinityEmbeddings)

    def _model(self, model: ServedModel, infinity: bool = False) -> Model:
        if not infinity:
            return Model(model.name, "model", self.created, OWNED_BY)
        return Model(model.name, "model", self.created, INFINITY_OWNER, model.placement.platform,
                     ["embed"], {})

    async def list_models(self, request: web.Request, holds: Holds,
                          infinity: bool = False) -> web.Response:
        return json_response(ModelList("list", [self._model(m, infinity)
                                                for m in self.plane.models.values()]))

    async def infinity_models(self, request: web.Request, holds: Holds) -> web.Response:
        return await self.list_models(request, holds, infinity=True)

    async def get_model(self, request: web.Request, holds: Holds) -> web.Response:
        return json_response(self._model(self.plane.model(request.match_info["model"])))


def head_bytes(model: ServedModel) -> int:
    """A list answer's object, usage and ids around its items, with the model's name
    escaped at its longest."""
    return 256 + len(model.name.encode()) * JSON_CHAR_BYTES


def pooled(model: ServedModel) -> str:
    """The vector OpenAI's door answers with: the model's own pooling, normalised."""
    return pooled_output(model.manifest.default_pooling, True)

