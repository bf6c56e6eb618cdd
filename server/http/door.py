"""What every HTTP door is: one protocol's routes on the HTTP port, each handler answered as a
call (its record, its memory held until the answer is sent: HttpCalls.answer), its
refusals in the protocol's error shape, its answers encoded from their schemas."""

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import msgspec
import orjson
from aiohttp import web

from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import ResponseSize
from attnserve.server.errors import RequestError
from attnserve.server.http.calls import HttpCalls
from attnserve.server.http.schemas import KServeError
from attnserve.server.memory.ledger import Holds

Handler = Callable[[web.Request, Holds], Awaitable[web.StreamResponse]]
encode = msgspec.json.Encoder().encode


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(body), status=status, content_type="application/json")


async def packed(model: ServedModel, seconds: float, build: Callable[..., bytes], *args) -> web.Response:
    return web.Response(body=await model.pack(seconds, build, *args), content_type="application/json")


def numbers(value: object) -> msgspec.Raw:
    """`value`, its arrays as JSON numbers: a float32 as the shortest text that reads back as it."""
    return msgspec.Raw(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))


class Door(ABC):
    """A protocol's routes, from `routes()`; `refusal` its error shape ({"error": message}
    unless the protocol says otherwise)."""

    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int):
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes

    @abstractmethod
    def routes(self) -> list[web.RouteDef]:
        """The protocol's routes, each through `calls`."""

    @staticmethod
    def refusal(err: RequestError, status: int) -> web.Response:
        return json_response(KServeError(err.message), status)

    def size(self, measure: Callable, advice: str) -> ResponseSize:
        return ResponseSize(measure, self.max_response_bytes, advice)

    def route(self, method: str, path: str, handler: Handler, rpc: str | None = None) -> web.RouteDef:
        """`handler(request, holds)` on `path`, answered as the call `rpc` (the metrics' rpc
        label; default `http:` and the path)."""
        name = rpc or f"http:{path}"

        async def answer(request: web.Request) -> web.StreamResponse:
            return await self.calls.answer(name, request, lambda holds: handler(request, holds), self.refusal)
        return web.route(method, path, answer)
