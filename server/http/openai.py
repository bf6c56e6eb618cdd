"""OpenAI's POST /v1/embeddings and GET /v1/models, Infinity's (OpenAI's without /v1, with its `id`,
`created`, `backend`, `capabilities` and `stats`) and vLLM's /classify, through the data plane, in their
bodies, answers and error shapes, with attnserve's fields beside OpenAI's (docs/api.md, "HTTP: OpenAI",
"HTTP: Infinity" and "Classification"). `model` names one of the server's models; without it, the
default (the first) answers, as TEI's, Infinity's and vLLM's do. Vectors: server/http/vectors.py."""

import time
import uuid
from functools import partial

import numpy as np
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
    SparseRequest,
)
from attnserve.server.errors import InvalidArgument, RequestError, quote
from attnserve.server.http import schemas as s
from attnserve.server.http.calls import JSON_CHAR_BYTES, JSON_FLOAT_BYTES
from attnserve.server.http.door import Door, encode, json_response, numbers, packed
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
ERROR_KINDS = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
               404: ("invalid_request_error", "model_not_found"), 408: ("invalid_request_error", "timeout"),
               413: ("invalid_request_error", "request_too_large"),
               415: ("invalid_request_error", "unsupported_media_type"),
               429: ("requests", "rate_limit_exceeded"), 500: ("server_error", None),
               503: ("server_error", "service_unavailable"), 504: ("server_error", "timeout")}


class OpenAIDoor(Door):
    def __init__(self, *args):
        super().__init__(*args)
        self.created = int(time.time())
        """when the models were loaded: OpenAI's `created` of each model"""

    def routes(self) -> list[web.RouteDef]:
        return [self.route("POST", "/v1/embeddings", self.embeddings),
                self.route("GET", "/v1/models", self.list_models),
                self.route("GET", "/v1/models/{model:.+}", self.get_model, "http:/v1/models/{model}"),
                self.route("POST", "/embeddings", partial(self.embeddings, schema=s.InfinityEmbeddings)),
                self.route("POST", "/classify", self.classify),
                self.route("GET", "/models", partial(self.list_models, infinity=True))]

    @staticmethod
    def refusal(err: RequestError, status: int) -> web.Response:
        kind, code = ERROR_KINDS.get(status, ("server_error", None))
        return json_response(s.OpenAIError(s.OpenAIErrorDetail(err.message, kind, err.field, code)), status)

    def _request(self, body: s.Embeddings, model: ServedModel, vectors: VectorFormat) -> EmbedRequest:
        """The model's request for a body: the response's size depends on the model."""
        item = ITEM_BYTES + vectors.vector_bytes(model.manifest.embedding_size)
        head = head_bytes(model)
        if body.chunking is None:
            size = self.size(lambda lengths: head + len(lengths) * item, ADVICE)
            chunking = None
        else:
            size = self.size(lambda counts: head + int(counts.sum()) * (item + CHUNK_ITEM_BYTES),
                             CHUNKED_ADVICE)
            chunking = Chunking(body.chunking.max_tokens, ChunkingMode(body.chunking.mode),
                                body.chunking.window_overlap)
        inputs, names = s.sequences(body.input, "input")
        return EmbedRequest(names=names, size=size, truncate=body.truncate, prompt_name=body.prompt_name,
                            truncation_direction=s.direction(body.truncation_direction),
                            outputs=frozenset({pooled(model)}), dimensions=body.dimensions or 0,
                            chunking=chunking, normalize=True, **inputs)

    def _answer(self, model: ServedModel, embedded: Embedded, vectors: VectorFormat,
                ranges: dict, infinity: bool) -> bytes:
        name = pooled(model)
        pooled_vectors = [result.pooled[name] for result in embedded.results]
        pooled_vectors += [vector for text in embedded.chunked for vector in text.vectors]
        fields = iter(vectors.fields(np.stack(pooled_vectors), ranges) if pooled_vectors else ())
        data = [s.Embedding("embedding", index, *next(fields)) for index in range(len(embedded.results))]
        for text_index, text in enumerate(embedded.chunked):
            for (start, end), count in zip(text.spans.tolist(), text.token_counts.tolist(), strict=True):
                data.append(s.Embedding("embedding", len(data), *next(fields), text_index, start, end, count))
        return embedding_list(model, data, embedded.total_tokens, infinity)

    async def embeddings(self, request: web.Request, holds: Holds,
                         schema: type[s.Embeddings] = s.Embeddings) -> web.Response:
        body = await self.calls.json_body(request, holds, schema)
        infinity = schema is s.InfinityEmbeddings
        if infinity:
            if body.modality != "text":
                raise InvalidArgument("modality", f"{quote(body.modality)}; this server embeds text only")
            body.model = None if body.model == INFINITY_DEFAULT_MODEL else body.model
        model = self.plane.model(body.model)
        if "sparse" in (body.embedding_types or ()):
            return await self._sparse(body, model, holds, infinity)
        if body.sparse_top_k is not None:
            raise InvalidArgument("sparse_top_k", 'cuts sparse vectors: ask for embedding_types ["sparse"]')
        vectors = VectorFormat.of(body)
        embedded = await embed.embed(model, self._request(body, model, vectors), holds, None)
        count = len(embedded.results) + int(embedded.chunk_counts.sum())
        ranges = vectors.ranges(model.manifest, model.name, pooled(model), body.dimensions or 0)
        return await packed(model, count * (RESULT_S + model.manifest.embedding_size * FLOAT_TEXT_S),
                            self._answer, model, embedded, vectors, ranges, infinity)

    async def classify(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.Classify)
        if body.messages is not None:
            raise InvalidArgument("messages", "chat messages are not classified here; send the "
                                  "texts in `input`")
        if body.truncate_prompt_tokens not in (None, -1):
            raise InvalidArgument("truncate_prompt_tokens", f"{body.truncate_prompt_tokens}; "
                                  "expected -1 (cut at the model's positions) or none")
        model = self.plane.model(body.model, kind=CLASSIFIER)
        inputs, names = s.sequences(body.input, "input", ids=False)
        labels = model.manifest.labels
        item = (CLASS_BYTES + max(map(len, labels), default=0) * JSON_CHAR_BYTES
                + len(labels) * JSON_FLOAT_BYTES)
        head = head_bytes(model)
        classified = await classify.classify(model, ClassifyRequest(
            names, self.size(lambda counts: head + len(counts) * item, "send fewer inputs per request"),
            inputs["texts"], activation="none" if body.use_activation is False else None,
            truncate=body.truncate_prompt_tokens == -1,
            truncation_direction=s.direction(body.truncation_side)), holds, None)

        def answer() -> bytes:
            tokens = classified.total_tokens
            return encode(s.Classification(
                f"classify-{uuid.uuid4().hex}", "list", int(time.time()), model.name,
                [s.ClassifyData(i, labels[int(row.argmax())], row.tolist(), len(labels))
                 for i, row in enumerate(classified.scores)], s.ClassifyUsage(tokens, tokens)))

        return await packed(model, classified.scores.size * RESULT_S, answer)

    async def _sparse(self, body: s.Embeddings, model: ServedModel, holds: Holds,
                      infinity: bool) -> web.Response:
        """embedding_types ["sparse"]: each text's sparse vector as `embeddings.sparse`,
        {"indices", "values"} (the field names of Qdrant's, Pinecone's and fastembed's)."""
        if body.embedding_types != ["sparse"]:
            raise InvalidArgument("embedding_types", f"{body.embedding_types}: a sparse vector "
                                  "comes alone (the served SPLADE models have no dense vectors)")
        for name in ("chunking", "dimensions"):
            if getattr(body, name) is not None:
                raise InvalidArgument(name, "applies to dense vectors, not sparse ones")
        inputs, names = s.sequences(body.input, "input", ids=False)
        head = head_bytes(model)
        size = self.size(lambda counts: head + len(counts) * ITEM_BYTES
                         + int(counts.sum()) * SPARSE_ENTRY_BYTES, "set sparse_top_k, or send fewer inputs")
        embedded = await sparse.embed_sparse(model, SparseRequest(
            names, size, inputs["texts"], body.truncate, s.direction(body.truncation_direction),
            body.prompt_name, body.sparse_top_k), holds, None)

        def answer() -> bytes:
            empty = numbers(np.zeros(0, np.float32))
            data = [s.Embedding("embedding", i, empty,
                                {"sparse": numbers({"indices": indices, "values": values})})
                for i, (indices, values) in enumerate(zip(embedded.indices, embedded.values, strict=True))]
            return embedding_list(model, data, embedded.total_tokens, infinity)

        return await packed(model, embedded.response_bytes * COPY_BYTE_S, answer)

    def _model(self, model: ServedModel, infinity: bool = False) -> s.Model:
        owner = (INFINITY_OWNER, model.placement.platform, ["embed"], {}) if infinity else (OWNED_BY,)
        return s.Model(model.name, "model", self.created, *owner)

    async def list_models(self, request: web.Request, holds: Holds, infinity: bool = False) -> web.Response:
        return json_response(s.ModelList("list", [self._model(m, infinity)
                                                  for m in self.plane.models.values()]))

    async def get_model(self, request: web.Request, holds: Holds) -> web.Response:
        return json_response(self._model(self.plane.model(request.match_info["model"])))


def embedding_list(model: ServedModel, data: list[s.Embedding], tokens: int, infinity: bool) -> bytes:
    """The answer of /v1/embeddings, or with Infinity's `id` and `created`, /embeddings."""
    return encode(s.EmbeddingList("list", data, model.name, s.Usage(tokens, tokens), *(
        (f"attnserve-{uuid.uuid4()}", int(time.time())) if infinity else ())))


def head_bytes(model: ServedModel) -> int:
    """A list answer's object, usage and ids around its items, with the model's name
    escaped at its longest."""
    return 256 + len(model.name.encode()) * JSON_CHAR_BYTES


def pooled(model: ServedModel) -> str:
    """The vector OpenAI's door answers with: the model's own pooling, normalised."""
    return pooled_output(model.manifest.default_pooling, True)
