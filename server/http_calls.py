"""What every HTTP route shares: the body read within its limit and parsed off the event
loop, errors turned into HTTP statuses, and the same request metrics as the gRPC calls.

The metrics' `code` label carries the gRPC status name for HTTP routes too (OK,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...), so one alert rule and one dashboard panel read
both protocols; the route is in the `rpc` label ("http:/v1/embeddings", ...)."""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TypeVar

import grpc
import numpy as np
from aiohttp import web

from attnserve.server.calls import REQUEST_COPIES, UNCOUNTED_REQUEST_BYTES, trim_after
from attnserve.server.errors import InvalidArgument, RequestError, ResourceExhausted, Unavailable
from attnserve.server.holds import Holds, Ledger
from attnserve.server.metrics import Metrics

log = logging.getLogger("attnserve.http")
T = TypeVar("T")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Bodies up to this size are parsed on the event loop: at ~15 µs per KiB of token ids
# (measured here) that pauses it ~0.25 ms at most, too little to be worth a thread hop.
INLINE_JSON_BYTES = 16 << 10


class BodyTooLarge(ResourceExhausted):
    """413, not 429: the same body will never fit, retrying it is pointless."""


def http_status(err: RequestError) -> int:
    return 413 if isinstance(err, BodyTooLarge) else HTTP_STATUS.get(err.code, 500)


def float32_json(raw: bytes) -> str:
    """Little-endian float32 bytes as a JSON list. Nine significant digits give back the
    same float32 (json.dumps would write a float64's 17), in less than half json.dumps's
    time (0.28 vs 0.65 ms for 384 values) and 40 % fewer bytes; a Python-level loop, so
    another thread gets the GIL back every few milliseconds."""
    values = np.frombuffer(raw, dtype="<f4").tolist()
    return "[" + ",".join(["%.9g" % v for v in values]) + "]"  # noqa: UP031 - faster than f"{v:.9g}"


def _loads(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise InvalidArgument("body", f"not valid JSON ({err})") from err


def _peer(request: web.Request) -> str | None:
    """The connection a call came in on, for its share of the memory ledger."""
    address = request.transport.get_extra_info("peername") if request.transport else None
    return None if not address else f"http:{address[0]}:{address[1]}"


class HttpCalls:
    """Shared by the routes of one server: its metrics, limits, memory ledger and worker
    threads."""

    def __init__(self, metrics: Metrics, executor: Executor, max_body_bytes: int,
                 ready: Callable[[], bool], ledger: Ledger):
        self.metrics = metrics
        self.executor = executor
        self.max_body_bytes = max_body_bytes
        self.ready = ready  # () -> bool: loaded, warmed up and not draining
        self.ledger = ledger

    def refuse_unless_ready(self) -> None:
        """The cheapest refusal first: a starting or draining server reads no body."""
        if not self.ready():
            raise Unavailable("server is not serving (starting or draining): send the request "
                              "to another replica")

    async def off_loop(self, work: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, work, *args)

    async def body(self, request: web.Request, holds: Holds) -> bytes:
        """The whole body, refused (413) past the limit before it is read when the client
        says its length, and as soon as it passes the limit when it does not. A big body
        is held (as received, parsed and converted, as gRPC's requests are) from before
        it is read, when its length is known, until the answer has been sent."""
        limit, length = self.max_body_bytes, request.content_length
        if length is not None and length > limit:
            raise BodyTooLarge(f"body: {length} bytes, over the server's "
                               f"{limit}-byte limit (--http-max-body-bytes)")
        if length is not None and length > UNCOUNTED_REQUEST_BYTES:
            holds.take(REQUEST_COPIES * length, "request")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as err:
            raise BodyTooLarge(f"body: over the server's {limit}-byte limit "
                               "(--http-max-body-bytes)") from err
        if length is None and len(body) > UNCOUNTED_REQUEST_BYTES:
            holds.take(REQUEST_COPIES * len(body), "request")
        return body

    async def decode(self, body: bytes, convert: Callable[[object], T]) -> T:
        """`convert(the parsed JSON)`, on a thread when the body is big: parsing and
        converting take time in proportion to its size."""
        def work() -> T:
            return convert(_loads(body))
        return work() if len(body) <= INLINE_JSON_BYTES else await self.off_loop(work)

    async def answer(self, rpc: str, request: web.Request,
                     handler: Callable[[Holds], Awaitable[web.StreamResponse]],
                     refusal: Callable[[RequestError, int], web.StreamResponse]) -> web.StreamResponse:
        """Run `handler` with the call's memory holds, send its response, and record the
        call as the gRPC calls are recorded; a RequestError is answered with
        `refusal(error, http_status)` in the route's own error shape.

        The response is written here rather than by aiohttp once the handler returns: the
        call's memory (its body, its answer) stays held in the ledger until the answer has
        gone to the socket, so a client that stops reading holds it, inside the budget,
        and its connection's share of it, as a gRPC caller does."""
        started = time.perf_counter()
        self.metrics.inflight.inc()
        code = grpc.StatusCode.OK
        holds = self.ledger.holds(_peer(request))
        try:
            try:
                response = await handler(holds)
            except RequestError as err:
                code = err.code
                response = refusal(err, http_status(err))
            except Exception as err:
                if isinstance(err, asyncio.CancelledError):
                    raise
                code = grpc.StatusCode.INTERNAL
                log.exception("event=internal_error rpc=%s", rpc)
                response = refusal(RequestError(f"internal error: {err.__class__.__name__}"), 500)
            if not self.ready():
                response.force_close()  # a draining server sends keep-alive clients elsewhere
            await response.prepare(request)
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            holds.release()
            trim_after(holds, self.executor, asyncio.get_running_loop())
            self.metrics.inflight.dec()
            self.metrics.answered(rpc, code.name, time.perf_counter() - started)
