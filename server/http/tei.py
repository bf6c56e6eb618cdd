"""Text Embeddings Inference's HTTP API (TEI 1.9, its router/src/http) through the data
plane: POST /embed, POST / (TEI routes its root by the model's kind: an embedder's is
/embed, a reranker's /rerank), POST /embed_all, POST /tokenize, POST /decode and GET /info. TEI serves
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

`prompt_name` names one of the model's prompts, put before each text (none named: the
model's default prompt, if it has one); /tokenize's tokens then include the prompt's, with
offsets into the prompt and the text, as TEI gives them. `truncation_direction` Left cuts
a long text at its start; `dimensions` one of the model's Matryoshka sizes. `truncate` left
out means TEI's `auto_truncate`, false here (/info says so): a text longer than the model's
positions is refused unless the request sets truncate. /tokenize takes `truncate` too (not
a TEI field)."""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import web

from attnserve.artifact import HIDDEN_OUTPUT, RERANKER, pooled_output
from attnserve.server.call import SERVER_VERSION
from attnserve.server.engine import embed
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, FLOAT_TEXT_S, RESULT_S, TOKEN_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import (
    DecodeRequest,
    EmbedRequest,
    Fields,
    ModelInfo,
    ResponseSize,
    TokenizeRequest,
    TruncationDirection,
)
from attnserve.server.engine.tokenize import Encoded
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.http.calls import (
    JSON_FLOAT_BYTES,
    SEQUENCE_FORMS,
    HttpCalls,
    known_fields,
    sequences,
    token_ids,
)
from attnserve.server.http.tei_shape import Empty, refusal
from attnserve.server.memory.ledger import Holds

EMBED_FIELDS = ("inputs", "truncate", "truncation_direction", "prompt_name", "normalize",
                "dimensions")
EMBED_ALL_FIELDS = ("inputs", "truncate", "truncation_direction", "prompt_name")
TOKENIZE_FIELDS = ("inputs", "add_special_tokens", "prompt_name", "truncate")
DECODE_FIELDS = ("ids", "skip_special_tokens")
DIRECTIONS = {"Right": TruncationDirection.RIGHT, "right": TruncationDirection.RIGHT,
              "Left": TruncationDirection.LEFT, "left": TruncationDirection.LEFT}
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


def _direction(body: dict) -> TruncationDirection:
    direction = body.get("truncation_direction")
    if direction is None:
        return TruncationDirection.RIGHT
    if not isinstance(direction, str) or direction not in DIRECTIONS:
        raise InvalidArgument("truncation_direction", f"{quote(direction)}; expected Right or Left")
    return DIRECTIONS[direction]


def _prompt_name(body: dict) -> str | None:
    prompt = body.get("prompt_name")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidArgument("prompt_name", f"{quote(prompt)}; expected a string")
    return prompt


@dataclass(frozen=True)
class EmbedBody:
    inputs: dict
    """EmbedRequest's texts or token_ids"""
    names: Fields
    truncate: bool
    direction: TruncationDirection
    prompt_name: str | None
    normalize: bool = True
    dimensions: int = 0
    """0: the model's hidden size"""


def _inputs(body: dict) -> tuple[dict, Fields]:
    if "inputs" not in body:
        raise InvalidArgument("inputs", f"required: {SEQUENCE_FORMS}")
    return sequences(body["inputs"], "inputs", Empty)


def parse_embed(body) -> EmbedBody:
    known_fields(body, EMBED_FIELDS)
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise InvalidArgument("dimensions", f"{quote(dimensions)}; expected a positive integer")
    inputs, names = _inputs(body)
    return EmbedBody(inputs, names, _flag(body, "truncate", False, nullable=True),
                     _direction(body), _prompt_name(body), _flag(body, "normalize", True),
                     dimensions or 0)


def parse_embed_all(body) -> EmbedBody:
    known_fields(body, EMBED_ALL_FIELDS)
    inputs, names = _inputs(body)
    return EmbedBody(inputs, names, _flag(body, "truncate", False, nullable=True),
                     _direction(body), _prompt_name(body))


@dataclass(frozen=True)
class TokenizeBody:
    texts: list[str]
    names: Fields
    special_tokens: bool
    truncate: bool
    prompt_name: str | None


def parse_tokenize(body) -> TokenizeBody:
    known_fields(body, TOKENIZE_FIELDS)
    if "inputs" not in body:
        raise InvalidArgument("inputs", "required: a string or a list of strings")
    inputs, names = sequences(body["inputs"], "inputs", Empty, ids=False)
    return TokenizeBody(inputs["texts"], names, _flag(body, "add_special_tokens", True),
                        _flag(body, "truncate", False, nullable=True), _prompt_name(body))


def parse_decode(body) -> DecodeRequest:
    known_fields(body, DECODE_FIELDS)
    if "ids" not in body:
        raise InvalidArgument("ids", "required: a list of token ids, or a list of lists of them")
    value = body["ids"]
    if isinstance(value, list) and value and isinstance(value[0], list):
        ids = [token_ids(entry, f"ids[{i}]", Empty) for i, entry in enumerate(value)]
        names = Fields("ids")
    else:
        ids, names = [token_ids(value, "ids", Empty)], Fields("ids", single=True)
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
                 max_entries: int, rerank: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """`rerank`: TEI's /rerank, the root of a server whose default model is a reranker."""
        self.calls = calls
        self.rerank = rerank
        self.plane = plane
        self.max_response_bytes = max_response_bytes
        self.refusal = refusal
        self.limits = {"max_concurrent_requests": max_queue_requests,
                       "max_batch_tokens": max_batch_tokens, "max_batch_requests": max_batch_size,
                       "max_client_batch_size": max_entries}

    def routes(self) -> list[web.RouteDef]:
        root = self.rerank if self.plane.default.kind == RERANKER else self.root
        return [web.post("/", root), web.post("/embed", self.embed),
                web.post("/embed_all", self.embed_all), web.post("/tokenize", self.tokenize),
                web.post("/decode", self.decode), web.get("/info", self.info)]

    def _size(self, per_sequence: int, per_token: int) -> ResponseSize:
        return ResponseSize(lambda lengths: 2 + len(lengths) * per_sequence + int(lengths.sum())
                            * per_token, self.max_response_bytes, ADVICE)

    # --- /embed, / and /embed_all -------------------------------------------------------

    async def _embed(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, parse_embed)
        model = self.plane.model(None)
        size = body.dimensions or model.manifest.hidden_size
        pooled = pooled_output(model.manifest.default_pooling, body.normalize)
        embedded = await embed.embed(model, EmbedRequest(
            names=body.names, size=self._size(LIST_BYTES + size * JSON_FLOAT_BYTES, 0),
            truncate=body.truncate, truncation_direction=body.direction,
            prompt_name=body.prompt_name, outputs=frozenset({pooled}),
            dimensions=body.dimensions, **body.inputs), holds, None)
        count = len(embedded.results)
        return await self._answer(model, count * (RESULT_S + size * FLOAT_TEXT_S),
                                  [r.pooled[pooled] for r in embedded.results])

    async def _embed_all(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, parse_embed_all)
        model = self.plane.model(None)
        hidden = model.manifest.hidden_size
        embedded = await embed.embed(model, EmbedRequest(
            names=body.names, size=self._size(LIST_BYTES, LIST_BYTES + hidden * JSON_FLOAT_BYTES),
            truncate=body.truncate, truncation_direction=body.direction,
            prompt_name=body.prompt_name, outputs=frozenset({HIDDEN_OUTPUT}), **body.inputs),
            holds, None)
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

    def _tokens(self, model: ServedModel, holds: Holds, lead: str, texts: list[str],
                encoded: list[Encoded]) -> bytes:
        """`lead`: the prompt before each text, whose tokens' offsets are into it and the text."""
        return self._checked(model, holds, [tei_tokens(lead + text, e)
                                            for text, e in zip(texts, encoded, strict=True)])

    async def _tokenize(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, parse_tokenize)
        model = self.plane.model(None)
        least = len(model.tokenizer.empty.ids) if body.special_tokens else 0
        count = len(body.texts)
        ResponseSize(lambda _: count * (LIST_BYTES + least * TOKEN_BYTES), self.max_response_bytes,
                     ADVICE).check(None, at_least=True)
        encoded = await embed.tokenize(model, TokenizeRequest(
            body.names, body.texts, body.truncate, prompt_name=body.prompt_name,
            special_tokens=body.special_tokens), holds)
        prompt = model.prompt(body.prompt_name)
        tokens = sum(len(e.ids) for e in encoded)
        payload = await model.pack(count * RESULT_S + tokens * TOKEN_S, self._tokens, model, holds,
                                   prompt.text if prompt else "", body.texts, encoded)
        return web.Response(body=payload, content_type="application/json")

    async def _decode(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, parse_decode)
        model = self.plane.model(None)
        texts = await embed.decode(model, body, holds)
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
                "model_type": self._model_type(info),
                **self.limits, "max_input_length": info.max_positions, "auto_truncate": False,
                "tokenization_workers": 1, "version": SERVER_VERSION, "sha": None,
                "docker_label": None}

    @staticmethod
    def _model_type(info: ModelInfo) -> dict:
        if info.kind == RERANKER:
            return {"reranker": {"id2label": {str(i): label for i, label in enumerate(info.labels)},
                                 "label2id": {label: i for i, label in enumerate(info.labels)}}}
        return {"embedding": {"pooling": info.default_pooling}}

    async def info(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            return web.json_response(self._info(self.plane.model(None)))
        return await self.calls.answer("http:/info", request, handle, refusal)
