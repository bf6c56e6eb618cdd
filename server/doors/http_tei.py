"""Text Embeddings Inference's HTTP API (TEI 1.9, its router/src/http) through the data
plane: POST /embed, POST / (an embedder's root is /embed, as TEI routes its root by the
model's kind), POST /embed_all, POST /tokenize, POST /decode and GET /info. TEI serves
one model and has no field or header that names one: these routes serve the server's
default model.

Bodies and answers are TEI's. `inputs` is a string, a list of token ids (the model's
vocabulary, special tokens included), or a list of either (of one kind in one request
here); /embed answers a list of vectors (the model's pooling, normalised unless
`normalize` is false), /embed_all each input's token vectors ([CLS] and [SEP] included),
/tokenize each text's tokens {id, text, special, start, stop} (start and stop: UTF-8 byte
offsets into the text, none for a special token), /decode a list of texts.

Errors come in TEI's shape {"error", "error_type"} with TEI's statuses: an empty input
400 Empty, any other bad input 422 Validation (a field the route does not know among
them), 429 Overloaded, 503 Unhealthy, a batch that failed in the backend 424 Backend;
the port's own limits keep their statuses (401, 408, 413, 415) and are typed Validation.

TEI fields the data plane does not take are read and checked, and any value but their
default refused naming the field: truncation_direction (right only), prompt_name (none),
dimensions (the model's one size). `truncate` left out means TEI's `auto_truncate`,
false here (/info says so): a text longer than the model's positions is refused unless
the request sets truncate. /tokenize takes `truncate` too (not a TEI field)."""

from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import web

from attnserve.artifact import HIDDEN_OUTPUT, pooled_output
from attnserve.server.doors.front import SERVER_VERSION
from attnserve.server.doors.http_calls import (
    JSON_FLOAT_BYTES,
    SEQUENCE_FORMS,
    HttpCalls,
    SequenceNames,
    known_fields,
    sequences,
    token_ids,
)
from attnserve.server.doors.tei import Empty, refusal
from attnserve.server.engine.data_plane import DataPlane
from attnserve.server.engine.offload import COPY_BYTE_S, FLOAT_TEXT_S, RESULT_S, TOKEN_S
from attnserve.server.engine.requests import (
    DecodeRequest,
    EmbedRequest,
    ResponseSize,
    TokenizeRequest,
)
from attnserve.server.engine.served_model import ServedModel
from attnserve.server.engine.tokenize import Encoded
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.memory.ledger import Holds

JSON = ("application/json",)
EMBED_FIELDS = ("inputs", "truncate", "truncation_direction", "prompt_name", "normalize",
                "dimensions")
EMBED_ALL_FIELDS = ("inputs", "truncate", "truncation_direction", "prompt_name")
TOKENIZE_FIELDS = ("inputs", "add_special_tokens", "prompt_name", "truncate")
DECODE_FIELDS = ("ids", "skip_special_tokens")
DIRECTIONS = {"Right": "right", "right": "right", "Left": "left", "left": "left"}
DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8"}
# Answer sizes: the brackets and comma around each vector or list, and one token's object
# but its text ({"id":N,"text":"","special":false,"start":N,"stop":N},).
LIST_BYTES = 4
TOKEN_BYTES = 64
ADVICE = "send fewer inputs per request"


def _flag(body: dict, name: str, default: bool, nullable: bool = False) -> bool:
    value = body.get(name, default)
    if value is None and nullable:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(name, f"{quote(value)}; expected true or false")
    return value


def _unsupported(body: dict) -> None:
    """TEI's fields the data plane does not take: only their defaults pass."""
    direction = body.get("truncation_direction", "Right")
    if direction not in DIRECTIONS:
        raise InvalidArgument("truncation_direction", f"{quote(direction)}; expected Right or Left")
    if DIRECTIONS[direction] == "left":
        raise InvalidArgument("truncation_direction", f"{quote(direction)}: this server truncates "
                              "on the right only (a text keeps its start); omit it or send Right")
    prompt = body.get("prompt_name")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgument("prompt_name", f"{quote(prompt)}; expected a string")
        raise InvalidArgument("prompt_name", f"{quote(prompt)}: this server applies no prompts; "
                              "omit prompt_name, or put the prompt before the text")


@dataclass(frozen=True)
class EmbedBody:
    inputs: dict
    """EmbedRequest's texts or token_ids"""
    names: SequenceNames
    truncate: bool
    normalize: bool = True
    dimensions: int | None = None


def _inputs(body: dict) -> tuple[dict, SequenceNames]:
    if "inputs" not in body:
        raise InvalidArgument("inputs", f"required: {SEQUENCE_FORMS}")
    return sequences(body["inputs"], "inputs", Empty)


def parse_embed(body) -> EmbedBody:
    known_fields(body, EMBED_FIELDS)
    _unsupported(body)
    dimensions = body.get("dimensions")
    if dimensions is not None and type(dimensions) is not int:
        raise InvalidArgument("dimensions", f"{quote(dimensions)}; expected an integer")
    inputs, names = _inputs(body)
    return EmbedBody(inputs, names, _flag(body, "truncate", False, nullable=True),
                     _flag(body, "normalize", True), dimensions)


def parse_embed_all(body) -> EmbedBody:
    known_fields(body, EMBED_ALL_FIELDS)
    _unsupported(body)
    inputs, names = _inputs(body)
    return EmbedBody(inputs, names, _flag(body, "truncate", False, nullable=True))


@dataclass(frozen=True)
class TokenizeBody:
    texts: list[str]
    names: SequenceNames
    special_tokens: bool
    truncate: bool


def parse_tokenize(body) -> TokenizeBody:
    known_fields(body, TOKENIZE_FIELDS)
    _unsupported(body)
    if "inputs" not in body:
        raise InvalidArgument("inputs", "required: a string or a list of strings")
    inputs, names = sequences(body["inputs"], "inputs", Empty, ids=False)
    return TokenizeBody(inputs["texts"], names, _flag(body, "add_special_tokens", True),
                        _flag(body, "truncate", False, nullable=True))


def parse_decode(body) -> DecodeRequest:
    known_fields(body, DECODE_FIELDS)
    if "ids" not in body:
        raise InvalidArgument("ids", "required: a list of token ids, or a list of lists of them")
    value = body["ids"]
    if isinstance(value, list) and value and isinstance(value[0], list):
        ids = [token_ids(entry, f"ids[{i}]", Empty) for i, entry in enumerate(value)]
        names = SequenceNames("ids", False)
    else:
        ids, names = [token_ids(value, "ids", Empty)], SequenceNames("ids", True)
    return DecodeRequest(names, ids, _flag(body, "skip_special_tokens", True))


def byte_offsets(text: str) -> np.ndarray:
    """Each code point's UTF-8 offset in `text`, and the text's length in bytes last."""
    if text.isascii():
        return np.arange(len(text) + 1)
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths)])


def tei_tokens(text: str, encoded: Encoded) -> list[dict]:
    """TEI's SimpleTokens: a special token as its own text, the others as the text they
    cover with its UTF-8 offsets."""
    places = byte_offsets(text)
    out = []
    for token_id, token, (start, end), special in zip(encoded.ids.tolist(), encoded.tokens,
                                                      encoded.offsets, encoded.special,
                                                      strict=True):
        if special:
            out.append({"id": token_id, "text": token, "special": True, "start": None,
                        "stop": None})
        else:
            out.append({"id": token_id, "text": text[start:end], "special": False,
                        "start": int(places[start]), "stop": int(places[end])})
    return out


class TeiHttp:
    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int,
                 max_queue_requests: int, max_batch_tokens: int, max_batch_size: int,
                 max_entries: int):
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes
        self.refusal = refusal
        self.limits = {"max_concurrent_requests": max_queue_requests,
                       "max_batch_tokens": max_batch_tokens, "max_batch_requests": max_batch_size,
                       "max_client_batch_size": max_entries}

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/", self.root), web.post("/embed", self.embed),
                web.post("/embed_all", self.embed_all), web.post("/tokenize", self.tokenize),
                web.post("/decode", self.decode), web.get("/info", self.info)]

    async def _body(self, request: web.Request, holds: Holds, parse):
        self.plane.check_ready()
        self.calls.check_type(request, JSON)
        return await self.calls.json(await self.calls.body(request, holds), parse)

    def _size(self, per_sequence: int, per_token: int) -> ResponseSize:
        return ResponseSize(lambda lengths: 2 + len(lengths) * per_sequence + int(lengths.sum())
                            * per_token, self.max_response_bytes, ADVICE)

    # --- /embed, / and /embed_all -------------------------------------------------------

    async def _embed(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self._body(request, holds, parse_embed)
        model = self.plane.model(None)
        hidden = model.manifest.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            raise InvalidArgument("dimensions", f"{body.dimensions}; {model.name!r} has one size, "
                                  f"{hidden}: omit dimensions or set it to that")
        pooled = pooled_output(model.manifest.default_pooling, body.normalize)
        embedded = await model.embed(EmbedRequest(
            names=body.names, size=self._size(LIST_BYTES + hidden * JSON_FLOAT_BYTES, 0),
            truncate=body.truncate, outputs=frozenset({pooled}), **body.inputs), holds, None)
        count = len(embedded.results)
        return await self._answer(model, count * (RESULT_S + hidden * FLOAT_TEXT_S),
                                  [r.pooled[pooled] for r in embedded.results])

    async def _embed_all(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self._body(request, holds, parse_embed_all)
        model = self.plane.model(None)
        hidden = model.manifest.hidden_size
        embedded = await model.embed(EmbedRequest(
            names=body.names, size=self._size(LIST_BYTES, LIST_BYTES + hidden * JSON_FLOAT_BYTES),
            truncate=body.truncate, outputs=frozenset({HIDDEN_OUTPUT}), **body.inputs), holds, None)
        seconds = len(embedded.results) * RESULT_S + embedded.total_tokens * hidden * FLOAT_TEXT_S
        return await self._answer(model, seconds,
                                  [np.ascontiguousarray(r.hidden) for r in embedded.results])

    async def _answer(self, model: ServedModel, seconds: float, arrays: list) -> web.Response:
        payload = await model.pack(seconds, orjson.dumps, arrays, None, orjson.OPT_SERIALIZE_NUMPY)
        return web.Response(body=payload, content_type="application/json")

    async def root(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/", request, lambda h: self._embed(request, h), refusal)

    async def embed(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/embed", request, lambda h: self._embed(request, h),
                                       refusal)

    async def embed_all(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/embed_all", request,
                                       lambda h: self._embed_all(request, h), refusal)

    # --- /tokenize and /decode ----------------------------------------------------------

    def _checked(self, model: ServedModel, holds: Holds, value) -> bytes:
        """`value` as JSON, once it is known to fit the response limit, held until sent."""
        payload = orjson.dumps(value)
        ResponseSize(lambda _: len(payload), self.max_response_bytes, ADVICE).check(None)
        model.hold_response(holds, len(payload))
        return payload

    def _tokens(self, model: ServedModel, holds: Holds, texts: list[str],
                encoded: list[Encoded]) -> bytes:
        return self._checked(model, holds, [tei_tokens(text, e)
                                            for text, e in zip(texts, encoded, strict=True)])

    async def _tokenize(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self._body(request, holds, parse_tokenize)
        model = self.plane.model(None)
        least = len(model.tokenizer.empty.ids) if body.special_tokens else 0
        count = len(body.texts)
        ResponseSize(lambda _: count * (LIST_BYTES + least * TOKEN_BYTES), self.max_response_bytes,
                     ADVICE).check(None, at_least=True)
        encoded = await model.tokenize(TokenizeRequest(
            body.names, body.texts, body.truncate, special_tokens=body.special_tokens), holds)
        tokens = sum(len(e.ids) for e in encoded)
        payload = await model.pack(count * RESULT_S + tokens * TOKEN_S, self._tokens, model, holds,
                                   body.texts, encoded)
        return web.Response(body=payload, content_type="application/json")

    async def _decode(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self._body(request, holds, parse_decode)
        model = self.plane.model(None)
        texts = await model.decode(body, holds)
        payload = await model.pack(sum(map(len, texts)) * COPY_BYTE_S, self._checked, model, holds,
                                   texts)
        return web.Response(body=payload, content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/tokenize", request,
                                       lambda h: self._tokenize(request, h), refusal)

    async def decode(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/decode", request, lambda h: self._decode(request, h),
                                       refusal)

    # --- /info ----------------------------------------------------------------------------

    def _info(self, model: ServedModel) -> dict:
        info = model.model_info()
        return {"model_id": info.model, "model_sha": info.artifact_sha256,
                "model_dtype": DTYPES.get(info.precision, info.precision),
                "served_model_name": info.model,
                "model_type": {"embedding": {"pooling": info.default_pooling}},
                **self.limits, "max_input_length": info.max_positions, "auto_truncate": False,
                "tokenization_workers": 1, "version": SERVER_VERSION, "sha": None,
                "docker_label": None}

    async def info(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            return web.json_response(self._info(self.plane.model(None)))
        return await self.calls.answer("http:/info", request, handle, refusal)
