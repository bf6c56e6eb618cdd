"""What every RPC shares: in-flight and latency metrics, and errors turned into statuses."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from server.errors import RequestError
from server.metrics import Metrics

log = logging.getLogger("attnserve.calls")


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
        await context.abort(err.code, err.message)
    except asyncio.CancelledError:
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
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
        metrics.requests.labels(rpc, code.name).inc()
        metrics.request_duration.labels(rpc, code.name).observe(time.perf_counter() - started)
