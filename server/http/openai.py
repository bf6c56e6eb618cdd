"""POST /v1/embeddings as OpenAI defines it, through the data plane: the JSON body becomes an
EmbedRequest for vectors of the model's pooling, normalised (as OpenAI's are), and the result
becomes OpenAI's list of embeddings (floats, or base64 of little-endian float32); errors
come back in OpenAI's shape {"error": {"message", "type", "param", "code"}}, a field the
route does not know among them. `model` names one of the server's models, as GET
/v1/models lists them; without it, the server's default (its first) answers, as TEI's,
Infinity's and vLLM's do. Infinity serves the same API without /v1 (POST /embeddings,
GET /models), with a few fields of its own both ways: those routes are here too, on the
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
(server/doors/http_vectors.py)."""

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import web

from attnserve.artifact import pooled_output
from attnserve.server.engine import embed
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import FLOAT_TEXT_S, RESULT_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import (
    Chunking,
    ChunkingMode,
    Embedded,
    EmbedRequest,
    Fields,
    ResponseSize,
    TruncationDirection,
)
from attnserve.server.errors import InvalidArgument, RequestError, quote
from attnserve.server.http.calls import (
    SEQUENCE_FORMS,
    HttpCalls,
    known_fields,
    sequences,
)
from attnserve.server.http.vectors import VectorFormat
from attnserve.server.memory.ledger import Holds

RPC = "http:/v1/embeddings"
INFINITY_RPC = "http:/embeddings"
FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "truncate",
          "truncation_direction", "prompt_name", "chunking", "embedding_types", "embedding_dtype")
# Infinity's body: OpenAI's, and the inputs' modality.
INFINITY_FIELDS = (*FIELDS, "modality")
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
CHUNKED_ADVICE = "raise chunking.max_tokens, use encoding_format=base64, or send less text"
CHUNKING_MODES = {"late": ChunkingMode.LATE, "isolated": ChunkingMode.ISOLATED}
CHUNKING_FIELDS = ("max_tokens", "mode", "window_overlap")
# TEI's names, which its own clients write "Left" and "Right".
DIRECTIONS = {"left": TruncationDirection.LEFT, "right": TruncationDirection.RIGHT}
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


def _chunking(value) -> Chunking:
    if not isinstance(value, dict):
        raise InvalidArgument("chunking", f"{quote(value)}; expected an object with max_tokens "
                              "and, optionally, mode and window_overlap")
    for name in value:
        if name not in CHUNKING_FIELDS:
            raise InvalidArgument("chunking", f"unknown field {quote(name)}; known: "
                                  f"{', '.join(CHUNKING_FIELDS)}")
    numbers = {}
    for name, default in (("max_tokens", None), ("window_overlap", 0)):
        number = value.get(name, default)
        if type(number) is not int:  # bool is an int to Python, not to JSON
            raise InvalidArgument(f"chunking.{name}", f"{quote(number)}; expected an integer")
        numbers[name] = number
    mode = value.get("mode", "late")
    if not isinstance(mode, str) or mode not in CHUNKING_MODES:
        raise InvalidArgument("chunking.mode", f"{quote(mode)}; expected 'late' or 'isolated'")
    return Chunking(numbers["max_tokens"], CHUNKING_MODES[mode], numbers["window_overlap"])


@dataclass(frozen=True)
class Parsed:
    """A body's fields, read and checked but for what depends on the model it names."""

    model: str | None
    vectors: VectorFormat
    dimensions: int
    """0: the model's size"""
    truncate: bool
    truncation_direction: TruncationDirection
    prompt_name: str | None
    chunking: Chunking | None
    inputs: dict
    """EmbedRequest's texts or token_ids"""
    names: Fields


def parse(body) -> Parsed:
    known_fields(body, FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgument("model", f"{quote(model)}; expected a string")
    vectors = VectorFormat.parse(body)
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise InvalidArgument("dimensions", f"{quote(dimensions)}; expected a positive integer")
    truncate = body.get("truncate", False)
    if not isinstance(truncate, bool):
        raise InvalidArgument("truncate", f"{quote(truncate)}; expected true or false")
    side = body.get("truncation_direction") or "right"
    if not isinstance(side, str) or side.lower() not in DIRECTIONS:
        raise InvalidArgument("truncation_direction", f"{quote(side)}; expected 'left' or 'right'")
    prompt_name = body.get("prompt_name")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise InvalidArgument("prompt_name", f"{quote(prompt_name)}; expected a string")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidArgument("user", f"{quote(user)}; expected a string")
    if "input" not in body:
        raise InvalidArgument("input", f"required: {SEQUENCE_FORMS}")
    chunking = None if body.get("chunking") is None else _chunking(body["chunking"])
    inputs, names = sequences(body["input"], "input")
    return Parsed(model, vectors, dimensions or 0, truncate, DIRECTIONS[side.lower()],
                  prompt_name, chunking, inputs, names)


def parse_infinity(body) -> Parsed:
    """Infinity's body: OpenAI's, with text as its only modality, its name for no model,
    and dimensions 0 for the model's own size."""
    known_fields(body, INFINITY_FIELDS)
    modality = body.get("modality", "text")
    if modality != "text":
        raise InvalidArgument("modality", f"{quote(modality)}; this server embeds text only")
    # Infinity's ways of saying "not set", each of its own type (dimensions false is no 0).
    unset = {"modality": "text", "model": INFINITY_DEFAULT_MODEL, "dimensions": 0}
    return parse({name: value for name, value in body.items() if name not in unset
                  or type(value) is not type(unset[name]) or value != unset[name]})


class OpenAIEmbeddings:
    """POST /v1/embeddings, and the models listed as OpenAI lists them: GET /v1/models and
    GET /v1/models/{model}; Infinity's POST /embeddings and GET /models, OpenAI's without
    /v1, their bodies Infinity's (the answer's `id` and `created`, each model's `backend`,
    `capabilities` and `stats`)."""

    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int):
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes
        self.created = int(time.time())
        """when the models were loaded: OpenAI's `created` of each model"""

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/embeddings", self.handle), web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model:.+}", self.get_model),
                web.post("/embeddings", self.infinity_embeddings),
                web.get("/models", self.infinity_models)]

    def request(self, parsed: Parsed, model: ServedModel) -> EmbedRequest:
        """The model's request for a parsed body: the response's size depends on the model."""
        hidden = model.manifest.hidden_size
        item = ITEM_BYTES + parsed.vectors.vector_bytes(hidden)
        head = 256 + len(model.name.encode()) * 6
        if parsed.chunking is None:
            size = ResponseSize(lambda lengths: head + len(lengths) * item,
                                self.max_response_bytes, ADVICE)
        else:
            size = ResponseSize(lambda counts: head + int(counts.sum()) * (item + CHUNK_ITEM_BYTES),
                                self.max_response_bytes, CHUNKED_ADVICE)
        return EmbedRequest(names=parsed.names, size=size, truncate=parsed.truncate,
                            truncation_direction=parsed.truncation_direction,
                            prompt_name=parsed.prompt_name, outputs=frozenset({pooled(model)}),
                            dimensions=parsed.dimensions, chunking=parsed.chunking,
                            normalize=True, **parsed.inputs)

    def body(self, model: ServedModel, embedded: Embedded, vectors: VectorFormat, ranges: dict,
             more: dict) -> bytes:
        """`more`: fields beside OpenAI's."""
        name = pooled(model)
        pooled_vectors = [result.pooled[name] for result in embedded.results]
        pooled_vectors += [vector for text in embedded.chunked for vector in text.vectors]
        fields = iter(vectors.fields(np.stack(pooled_vectors), ranges) if pooled_vectors else ())
        data = [{"object": "embedding", "index": index, **next(fields)}
                for index in range(len(embedded.results))]
        for text_index, text in enumerate(embedded.chunked):
            for (start, end), count in zip(text.spans.tolist(), text.token_counts.tolist(),
                                           strict=True):
                data.append({"object": "embedding", "index": len(data), **next(fields),
                             "input_index": text_index, "start": start, "end": end,
                             "num_tokens": count})
        tokens = embedded.total_tokens
        return orjson.dumps({"object": "list", "data": data, "model": model.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, **more},
                            option=orjson.OPT_SERIALIZE_NUMPY)

    async def _embed(self, request: web.Request, holds: Holds, read=parse,
                     more: Callable[[], dict] = dict) -> web.Response:
        """`read`: the body's parser; `more()`: the answer's fields beside OpenAI's."""
        parsed = await self.calls.json_body(request, holds, read)
        model = self.plane.model(parsed.model)
        embedded = await embed.embed(model, self.request(parsed, model), holds, None)
        count = len(embedded.results) + int(embedded.chunk_counts.sum())
        hidden = model.manifest.hidden_size
        ranges = parsed.vectors.ranges(model.manifest, model.name, pooled(model), parsed.dimensions)
        payload = await model.pack(count * (RESULT_S + hidden * FLOAT_TEXT_S), self.body,
                                   model, embedded, parsed.vectors, ranges, more())
        return web.Response(body=payload, content_type="application/json")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer(RPC, request, lambda holds: self._embed(request, holds),
                                       refusal)

    async def infinity_embeddings(self, request: web.Request) -> web.StreamResponse:
        def more() -> dict:
            return {"id": f"attnserve-{uuid.uuid4()}", "created": int(time.time())}
        return await self.calls.answer(
            INFINITY_RPC, request, lambda holds: self._embed(request, holds, parse_infinity, more),
            refusal)

    async def infinity_models(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            return web.json_response({"object": "list", "data": [
                {**self._model_object(m), "owned_by": INFINITY_OWNER,
                 "backend": m.placement.platform, "capabilities": ["embed"], "stats": {}}
                for m in self.plane.models.values()]})
        return await self.calls.answer("http:/models", request, handle, refusal)

    def _model_object(self, model: ServedModel) -> dict:
        return {"id": model.name, "object": "model", "created": self.created,
                "owned_by": OWNED_BY}

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            return web.json_response({"object": "list", "data": [
                self._model_object(m) for m in self.plane.models.values()]})
        return await self.calls.answer("http:/v1/models", request, handle, refusal)

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            name = request.match_info["model"]
            return web.json_response(self._model_object(self.plane.model(name)))
        return await self.calls.answer("http:/v1/models/{model}", request, handle, refusal)


def pooled(model: ServedModel) -> str:
    """The vector OpenAI's door answers with: the model's own pooling, normalised."""
    return pooled_output(model.manifest.default_pooling, True)


def refusal(err: RequestError, status: int) -> web.Response:
    kind, code = ERROR_KINDS.get(status, ("server_error", None))
    return web.json_response({"error": {"message": err.message, "type": kind, "param": err.field,
                                        "code": code}}, status=status)
