"""POST /v1/embeddings as OpenAI defines it, through the data plane: the JSON body becomes an
EmbedRequest for vectors of the model's pooling, normalised (as OpenAI's are), and the result
becomes OpenAI's list of embeddings (floats, or base64 of little-endian float32); errors
come back in OpenAI's shape {"error": {"message", "type", "param", "code"}}. `model` names
one of the server's models, as GET /v1/models lists them; without it, the server's
default (its first) answers, as TEI's, Infinity's and vLLM's do.

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
counts the tokens run through the model, every window's or chunk's."""

import base64
import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from attnserve.artifact import pooled_output
from attnserve.server.doors.http_calls import HttpCalls
from attnserve.server.engine.data_plane import DataPlane
from attnserve.server.engine.errors import InvalidArgument, RequestError, quote
from attnserve.server.engine.offload import FLOAT_TEXT_S, RESULT_S
from attnserve.server.engine.requests import (
    Chunking,
    ChunkingMode,
    Embedded,
    EmbedRequest,
    ResponseSize,
    TruncationDirection,
)
from attnserve.server.engine.served_model import ServedModel
from attnserve.server.memory.ledger import Holds

RPC = "http:/v1/embeddings"
ENCODINGS = ("float", "base64")
INPUT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
# The most a float32 takes in the body: orjson's shortest repr (-1.1754944e-38) and a comma.
FLOAT_BYTES = 16
# ... and as base64: 4 bytes are 5⅓ characters.
BASE64_FLOAT_BYTES = 6
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


class InputNames:
    """OpenAI's names: `input[3]`, `input[3][5]`; a single string or id list is `input`."""

    sequences = "input"
    chunking = "chunking"

    def __init__(self, single: bool):
        self.single = single

    def sequence(self, index: int) -> str:
        return "input" if self.single else f"input[{index}]"

    def token(self, index: int, position: int) -> str:
        return f"{self.sequence(index)}[{position}]"


SINGLE, LIST = InputNames(True), InputNames(False)


def _ids(value, field: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument(field, "expected a non-empty list of token ids")
    for j, token in enumerate(value):
        if type(token) is not int:  # bool is an int to Python, not to JSON
            raise InvalidArgument(f"{field}[{j}]", f"{quote(token)} is not a token id (an integer)")
    return value


def _inputs(value) -> tuple[dict, InputNames]:
    """EmbedRequest fields for OpenAI's `input`, and its names."""
    if isinstance(value, str):
        if not value:
            raise InvalidArgument("input", "an empty string; send text to embed")
        return {"texts": [value]}, SINGLE
    if not isinstance(value, list) or not value:
        raise InvalidArgument("input", f"expected {INPUT_FORMS}, not empty")
    first = value[0]
    if isinstance(first, str):
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise InvalidArgument(f"input[{i}]", "expected a string, like input[0]")
            if not text:
                raise InvalidArgument(f"input[{i}]", "an empty string; send text to embed")
        return {"texts": value}, LIST
    if isinstance(first, list):
        return {"token_ids": [_ids(ids, f"input[{i}]") for i, ids in enumerate(value)]}, LIST
    if type(first) is int:
        return {"token_ids": [_ids(value, "input")]}, SINGLE
    raise InvalidArgument("input", f"expected {INPUT_FORMS}")


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
    encoding: str
    dimensions: int
    """0: the model's size"""
    truncate: bool
    truncation_direction: TruncationDirection
    prompt_name: str | None
    chunking: Chunking | None
    inputs: dict
    """EmbedRequest's texts or token_ids"""
    names: InputNames


def parse(body) -> Parsed:
    if not isinstance(body, dict):
        raise InvalidArgument("body", "expected a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgument("model", f"{quote(model)}; expected a string")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise InvalidArgument("encoding_format", f"{quote(encoding)}; expected 'float' or "
                              "'base64'")
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
        raise InvalidArgument("input", f"required: {INPUT_FORMS}")
    chunking = None if body.get("chunking") is None else _chunking(body["chunking"])
    fields, names = _inputs(body["input"])
    return Parsed(model, encoding, dimensions or 0, truncate, DIRECTIONS[side.lower()],
                  prompt_name, chunking, fields, names)


class OpenAIEmbeddings:
    """POST /v1/embeddings, and the models listed as OpenAI lists them: GET /v1/models and
    GET /v1/models/{model}."""

    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int):
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes
        self.created = int(time.time())
        """when the models were loaded: OpenAI's `created` of each model"""

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/embeddings", self.handle), web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model:.+}", self.get_model)]

    def request(self, parsed: Parsed, model: ServedModel) -> EmbedRequest:
        """The model's request for a parsed body: the response's size depends on the model."""
        hidden = model.manifest.hidden_size
        per_float = FLOAT_BYTES if parsed.encoding == "float" else BASE64_FLOAT_BYTES
        item = ITEM_BYTES + hidden * per_float
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

    def _vector(self, vector, encoding: str):
        return (base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if encoding == "base64" else vector)

    def body(self, model: ServedModel, embedded: Embedded, encoding: str) -> bytes:
        name = pooled(model)
        data = [{"object": "embedding", "index": index,
                 "embedding": self._vector(result.pooled[name], encoding)}
                for index, result in enumerate(embedded.results)]
        for text_index, text in enumerate(embedded.chunked):
            for (start, end), count, vector in zip(text.spans.tolist(), text.token_counts.tolist(),
                                                   text.vectors, strict=True):
                data.append({"object": "embedding", "index": len(data),
                             "embedding": self._vector(vector, encoding),
                             "input_index": text_index, "start": start, "end": end,
                             "num_tokens": count})
        tokens = embedded.total_tokens
        return orjson.dumps({"object": "list", "data": data, "model": model.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                            option=orjson.OPT_SERIALIZE_NUMPY)

    async def _embed(self, request: web.Request, holds: Holds) -> web.Response:
        self.plane.check_ready()
        self.calls.check_type(request, ("application/json",))
        body = await self.calls.body(request, holds)
        parsed = await self.calls.json(body, parse)
        model = self.plane.model(parsed.model)
        embedded = await model.embed(self.request(parsed, model), holds, None)
        count = len(embedded.results) + int(embedded.chunk_counts.sum())
        hidden = model.manifest.hidden_size
        payload = await model.pack(count * (RESULT_S + hidden * FLOAT_TEXT_S), self.body,
                                   model, embedded, parsed.encoding)
        return web.Response(body=payload, content_type="application/json")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer(RPC, request, lambda holds: self._embed(request, holds),
                                       refusal)

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
