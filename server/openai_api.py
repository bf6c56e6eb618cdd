"""POST /v1/embeddings as OpenAI defines it, on the same path as gRPC's Embed: the JSON body
becomes an EmbedRequest (pooled and normalized, as OpenAI's vectors are), the EmbedResponse
becomes OpenAI's list of embeddings (floats, or base64 of little-endian float32), and
errors come back in OpenAI's shape {"error": {"message", "type", "param", "code"}}.

Token-id inputs are the model's own vocabulary (not OpenAI's tiktoken ids), special tokens
included, as gRPC's token_ids are. Beyond OpenAI's fields, `truncate` (default false) cuts
texts longer than the model's positions instead of refusing them."""

import base64
import json
import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.errors import InvalidArgument, NotFound, RequestError
from attnserve.server.holds import Holds
from attnserve.server.http_calls import HttpCalls, float32_json
from attnserve.server.respond import BASE64_FLOAT_BYTES, JSON_FLOAT_BYTES

RPC = "http:/v1/embeddings"
ENCODINGS = ("float", "base64")
INPUT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
# Formatting one 384-float vector as JSON takes ~0.3 ms: past a few, the body is built on a
# thread.
INLINE_EMBEDDINGS = 4
# HTTP status -> OpenAI's error `type` and `code`.
ERROR_KINDS = {
    400: ("invalid_request_error", None),
    404: ("invalid_request_error", "model_not_found"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}
_GRPC_FIELD = re.compile(r"\b(?:texts|token_ids)(?:\[(\d+)\](?:\.ids\[(\d+)\])?)?")

Embed = Callable[..., Awaitable[pb.EmbedResponse]]
"""EncoderService.embed(request, deadline, holds, float_bytes)"""


def openai_names(text: str, single: bool) -> str:
    """gRPC field names in a shared check's message -> the caller's: texts[3] -> input[3],
    token_ids[2].ids[5] -> input[2][5]; a single string or id list is `input` itself."""
    def rename(match: re.Match) -> str:
        sequence, position = match.groups()
        name = "input" if single or sequence is None else f"input[{sequence}]"
        return name if position is None else f"{name}[{position}]"
    return _GRPC_FIELD.sub(rename, text)


def _sequences(value) -> tuple[dict, bool]:
    """EmbedRequest fields for OpenAI's `input`, and whether it was a single item."""
    if isinstance(value, str):
        return {"texts": [value]}, True
    if not isinstance(value, list) or not value:
        raise InvalidArgument("input", f"expected {INPUT_FORMS}, not empty")
    if isinstance(value[0], str):
        if not all(isinstance(v, str) for v in value):
            index = next(i for i, v in enumerate(value) if not isinstance(v, str))
            raise InvalidArgument(f"input[{index}]", "expected a string, like input[0]")
        return {"texts": value}, False
    if isinstance(value[0], list):
        token_ids = []
        for i, ids in enumerate(value):
            try:
                token_ids.append(pb.TokenIds(ids=ids))
            except (TypeError, ValueError) as err:
                raise InvalidArgument(f"input[{i}]", f"expected a list of token ids ({err})") from err
        return {"token_ids": token_ids}, False
    try:
        return {"token_ids": [pb.TokenIds(ids=value)]}, True
    except (TypeError, ValueError) as err:
        raise InvalidArgument("input", f"expected {INPUT_FORMS} ({err})") from err


class OpenAIEmbeddings:
    def __init__(self, calls: HttpCalls, embed: Embed, model: str, dimensions: int):
        self.calls = calls
        self.embed = embed
        self.model = model
        self.dimensions = dimensions

    def parse(self, body) -> tuple[pb.EmbedRequest, str, bool]:
        """(the Embed request, encoding_format, whether `input` was a single item)"""
        if not isinstance(body, dict):
            raise InvalidArgument("body", "expected a JSON object")
        model = body.get("model", self.model)
        if model != self.model:
            raise NotFound(f"model: unknown model {model!r}; this server serves {self.model!r}")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ENCODINGS:
            raise InvalidArgument("encoding_format", f"{encoding!r}; expected 'float' or 'base64'")
        dimensions = body.get("dimensions")
        if dimensions is not None and dimensions != self.dimensions:
            raise InvalidArgument("dimensions", f"{dimensions!r}; this model has one size, "
                                  f"{self.dimensions}: omit dimensions or set it to that")
        truncate = body.get("truncate", False)
        if not isinstance(truncate, bool):
            raise InvalidArgument("truncate", f"{truncate!r}; expected true or false")
        if "input" not in body:
            raise InvalidArgument("input", f"required: {INPUT_FORMS}")
        fields, single = _sequences(body["input"])
        # `user` is accepted and ignored, like any field OpenAI's clients may add.
        return pb.EmbedRequest(**fields, normalize=True, truncate=truncate), encoding, single

    def body(self, response: pb.EmbedResponse, encoding: str) -> bytes:
        items = []
        for index, item in enumerate(response.embeddings):
            data = item.pooled.data  # little-endian float32, as OpenAI's base64 is
            vector = ('"' + base64.b64encode(data).decode("ascii") + '"' if encoding == "base64"
                      else float32_json(data))
            items.append(f'{{"object":"embedding","index":{index},"embedding":{vector}}}')
        tail = json.dumps({"model": self.model, "usage": {"prompt_tokens": response.total_tokens,
                                                          "total_tokens": response.total_tokens}},
                          separators=(",", ":"))
        return ('{"object":"list","data":[' + ",".join(items) + "]," + tail[1:]).encode()

    async def _embed(self, request: web.Request, holds: Holds) -> web.Response:
        self.calls.refuse_unless_ready()
        body = await self.calls.body(request, holds)
        embed_request, encoding, single = await self.calls.decode(body, self.parse)
        try:
            # The size limit counts the floats as this body carries them.
            response = await self.embed(embed_request, None, holds, JSON_FLOAT_BYTES
                                        if encoding == "float" else BASE64_FLOAT_BYTES)
        except InvalidArgument as err:
            raise InvalidArgument(openai_names(err.field, single),
                                  openai_names(err.reason, single)) from err
        if len(response.embeddings) <= INLINE_EMBEDDINGS:
            payload = self.body(response, encoding)
        else:
            payload = await self.calls.off_loop(self.body, response, encoding)
        return web.Response(body=payload, content_type="application/json")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer(RPC, request, lambda holds: self._embed(request, holds),
                                       refusal)


def refusal(err: RequestError, status: int) -> web.Response:
    kind, code = ERROR_KINDS.get(status, ("server_error", None))
    param = err.field if isinstance(err, InvalidArgument) else None
    return web.json_response({"error": {"message": err.message, "type": kind, "param": param,
                                        "code": code}}, status=status)
