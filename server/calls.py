"""What every RPC shares: in-flight and latency metrics, errors turned into statuses, and
requests decoded off the event loop with their memory held until the answer is sent."""

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from attnserve.server.errors import RequestError, ResourceExhausted
from attnserve.server.holds import Holds, Ledger
from attnserve.server.memory import trim_heap
from attnserve.server.metrics import Metrics
from attnserve.server.wire import INLINE_BYTES, TooLarge, TooMany, decode_in_slices

log = logging.getLogger("attnserve.calls")

# A caller's own deadline cancels its call from the caller's side, which reaches the server
# a little before the server's copy of the deadline (set when the request arrived) runs
# out: a cancellation this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1
# A request is held this many times over while its call lasts: the bytes gRPC received,
# the parsed message, and the Python objects made from it (texts as str, ids as arrays).
REQUEST_COPIES = 3
# A request this small is not counted: health checks and the like are never refused for
# memory (1,000 streams of a connection hold at most 16 MiB of them).
UNCOUNTED_REQUEST_BYTES = 16 << 10
# A call that held this much gives the heap's free pages back to the OS once it is over,
# after a moment for gRPC to free what it sent.
TRIM_AFTER_BYTES = 16 << 20
TRIM_DELAY_S = 0.05


def trim_after(holds: Holds, pool: Executor, loop: asyncio.AbstractEventLoop) -> None:
    """Once a call that held much is over (its memory given back, but kept by the heap),
    hand the heap's free pages back to the OS, after a moment for the sender to free
    what it sent. Safe from any thread."""
    if holds.peak >= TRIM_AFTER_BYTES:
        loop.call_soon_threadsafe(loop.call_later, TRIM_DELAY_S, pool.submit, trim_heap)


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's deadline on the monotonic clock, or None."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def answer(metrics: Metrics, rpc: str, context: grpc.aio.ServicerContext,
                 handler: Callable[[], Awaitable]):
    """Run `handler`, record the call, and turn a RequestError into its status code."""
    started = time.perf_counter()
    metrics.inflight.inc()
    code = grpc.StatusCode.OK
    try:
        return await handler()
    except RequestError as err:
        code, refusal = err.code, err
    except asyncio.CancelledError:
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= DEADLINE_SLACK_S
        code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        raise
    except Exception as err:
        if isinstance(err, grpc.aio.AbortError):
            raise
        code = grpc.StatusCode.INTERNAL
        log.exception("event=internal_error rpc=%s", rpc)
        refusal = RequestError(f"internal error: {err.__class__.__name__}")
    finally:
        metrics.inflight.dec()
        metrics.answered(rpc, code.name, time.perf_counter() - started)
    # Sent once counted, so a caller that sees the refusal finds it in /metrics.
    status = refusal.status()
    await context.abort(status.code, status.details, status.trailing_metadata)


class Undecodable:
    """What a request that does not parse is handed on as, so the method can refuse it."""

    def __init__(self, error: Exception):
        self.reason = f"{error.__class__.__name__}: {error}"


@dataclass(frozen=True)
class Received:
    """A request as gRPC hands it to the method, with its size on the wire."""

    message: object
    """the parsed request, or Undecoded, or Undecodable"""
    nbytes: int


class Undecoded:
    """A request too big to parse on the event loop, as it came: parsed on a thread, in
    slices (server/wire.py), once its memory is held."""

    def __init__(self, data: bytes):
        self.data = data

    def decode(self, cls: type[Message], max_entries: int) -> Message | Undecodable:
        try:
            return decode_in_slices(cls, self.data, max_entries)
        except (TooMany, TooLarge) as err:
            raise ResourceExhausted(f"request: {err}; send fewer or smaller entries per "
                                    "request") from err
        except (DecodeError, ValueError) as err:
            return Undecodable(err)


_holds: ContextVar[Holds | None] = ContextVar("attnserve_call_holds", default=None)


def call_holds() -> Holds | None:
    """The memory the current gRPC call holds (released once its answer is sent), or
    None outside a call the DecodeRequests interceptor saw (the HTTP routes)."""
    return _holds.get()


class DecodeRequests(grpc.aio.ServerInterceptor):
    """Every call's requests parsed without stalling the event loop, and its memory held
    against the budget until its answer has been sent.

    A request that does not parse (invalid UTF-8 in a string field, truncated or garbage
    bytes) gets INVALID_ARGUMENT, instead of grpc's UNKNOWN and a traceback in the log.
    Each request's bytes (but a small one's), as received, parsed and copied, are taken
    from the ledger first (RESOURCE_EXHAUSTED at once when they do not fit, or when its
    connection holds its share). A big one (over wire.INLINE_BYTES) is then parsed on `pool` a slice at a
    time, refused by its entry counts before any of it is parsed. The call's Holds
    (`call_holds()`) are released when gRPC reports the call over: for a unary call,
    once the response has been written to the caller."""

    def __init__(self, metrics: Metrics, ledger: Ledger, pool: Executor, max_entries: int):
        self.metrics = metrics
        self.ledger = ledger
        self.pool = pool
        self.max_entries = max_entries

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        rpc = details.method.rsplit("/", 1)[-1]
        parse = handler.request_deserializer
        message_class = getattr(parse, "__self__", None)
        sliceable = isinstance(message_class, type) and issubclass(message_class, Message)

        def deserialize(data: bytes) -> Received:
            if sliceable and len(data) > INLINE_BYTES:
                return Received(Undecoded(data), len(data))
            try:
                return Received(parse(data), len(data))
            except (DecodeError, ValueError) as err:
                return Received(Undecodable(err), len(data))

        async def refuse(code: grpc.StatusCode, message: str, context) -> None:
            self.metrics.answered(rpc, code.name, 0.0)
            await context.abort(code, message)

        async def decoded(received: Received, context, holds: Holds):
            """The request parsed, or the call refused; returns (request, bytes held)."""
            request, held = received.message, 0
            try:
                if received.nbytes > UNCOUNTED_REQUEST_BYTES:
                    held = REQUEST_COPIES * received.nbytes
                    holds.take(held, "request")
                if isinstance(request, Undecoded):
                    request = await asyncio.get_running_loop().run_in_executor(
                        self.pool, request.decode, message_class, self.max_entries)
            except RequestError as err:
                await refuse(err.code, err.message, context)
            if isinstance(request, Undecodable):
                await refuse(grpc.StatusCode.INVALID_ARGUMENT,
                             f"request: not a valid {rpc} message ({request.reason})", context)
            return request, held

        def start(context) -> Holds:
            holds = self.ledger.holds(context.peer())
            _holds.set(holds)
            loop = asyncio.get_running_loop()

            def over(_) -> None:
                holds.release()
                trim_after(holds, self.pool, loop)

            context.add_done_callback(over)
            return holds

        async def checked(requests, context, holds: Holds):
            async for request in requests:
                request, held = await decoded(request, context, holds)
                yield request
                holds.give_back(held)  # the handler asked for the next: done with this one

        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)

        if inspect.isasyncgenfunction(inner):
            async def behaviour(request, context):
                holds = start(context)
                if handler.request_streaming:
                    request = checked(request, context, holds)
                else:
                    request, _ = await decoded(request, context, holds)
                async for response in inner(request, context):
                    yield response
        else:
            async def behaviour(request, context):
                holds = start(context)
                if handler.request_streaming:
                    request = checked(request, context, holds)
                else:
                    request, _ = await decoded(request, context, holds)
                return await inner(request, context)
        return handler._replace(request_deserializer=deserialize, **{kind: behaviour})


class QuietHungUpCalls(logging.Filter):
    """gRPC logs an ERROR with a traceback each time a caller hangs up while its answer
    is still being sent (ExecuteBatchError): the caller's doing, not a fault of the
    server, and a flood of tracebacks any caller could cause at will. One key=value line
    at INFO instead. Installed on gRPC's logger (`grpc._cython.cygrpc`)."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            record.msg = "event=send_failed reason=caller_gone method=%s"
            record.args = (message[len(self.PREFIX):].strip(" []"),)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True
