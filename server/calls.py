"""What every RPC shares: in-flight and latency metrics, and errors turned into statuses."""

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from attnserve.server.errors import RequestError
from attnserve.server.metrics import Metrics

log = logging.getLogger("attnserve.calls")

# A caller's own deadline cancels its call from the caller's side, which reaches the server
# a little before the server's copy of the deadline (set when the request arrived) runs
# out: a cancellation this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1


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
        code = err.code
        status = err.status()
        await context.abort(status.code, status.details, status.trailing_metadata)
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
        await context.abort(code, f"internal error: {err.__class__.__name__}")
    finally:
        metrics.inflight.dec()
        metrics.answered(rpc, code.name, time.perf_counter() - started)


class Undecodable:
    """What a request that does not parse is handed on as, so the method can refuse it."""

    def __init__(self, error: Exception):
        self.reason = f"{error.__class__.__name__}: {error}"


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """A request that does not parse (invalid UTF-8 in a string field, truncated or garbage
    bytes) gets INVALID_ARGUMENT, instead of grpc's UNKNOWN and a traceback in the log."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        rpc = details.method.rsplit("/", 1)[-1]
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except (DecodeError, ValueError) as err:
                return Undecodable(err)

        async def refuse(request, context) -> None:
            if isinstance(request, Undecodable):
                self.metrics.answered(rpc, grpc.StatusCode.INVALID_ARGUMENT.name, 0.0)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request: not a valid {rpc} message ({request.reason})")

        async def checked(requests, context):
            async for request in requests:
                await refuse(request, context)
                yield request

        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)

        def incoming(request, context):
            return checked(request, context) if handler.request_streaming else request

        if inspect.isasyncgenfunction(inner):
            async def behaviour(request, context):
                if not handler.request_streaming:
                    await refuse(request, context)
                async for response in inner(incoming(request, context), context):
                    yield response
        else:
            async def behaviour(request, context):
                if not handler.request_streaming:
                    await refuse(request, context)
                return await inner(incoming(request, context), context)
        return handler._replace(request_deserializer=deserialize, **{kind: behaviour})
