"""What every gRPC call shares: its record and status (server/call.py), the API
key, its request decoded off the event loop with its memory held until the answer is
sent, and its request id, timings and trace (server/call.py): the id and
TEI's timings go back in the trailing metadata (`x-request-id`, `x-total-time`, ...)."""

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextvars import ContextVar
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from attnserve.server.call import (
    CANCELLED,
    REQUEST_ID,
    TRACEPARENT,
    CallRecord,
    begin_call,
    current_call,
    finish_call,
)
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.queue import DEADLINE_SLACK_S
from attnserve.server.errors import (
    InvalidArgument,
    RequestError,
    ResourceExhausted,
    RetryLater,
    Unauthenticated,
)
from attnserve.server.grpc.wire import INLINE_BYTES, NestedTooLarge, TooManyEntries, decode_in_slices
from attnserve.server.keys import ApiKeys
from attnserve.server.memory.ledger import Holds
from attnserve.server.metrics import Metrics
from attnserve.server.priority import HEADER, asked
from attnserve.server.tracing import Tracing

RETRY_AFTER = "retry-after"
"""trailing metadata: seconds to wait before retrying, as HTTP's Retry-After"""

# Methods of probes and tools, never traced.
UNTRACED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Methods answered without an API key: health and reflection, and the Open Inference
# Protocol's own health calls.
OPEN_METHODS = (*UNTRACED_METHODS, "/inference.GRPCInferenceService/ServerLive",
                "/inference.GRPCInferenceService/ServerReady", "/inference.GRPCInferenceService/ModelReady")


def status_of(err: RequestError) -> grpc.Status:
    """The status to abort with: the code and message, and for a field at fault a
    google.rpc.BadRequest, so a client can read the field without parsing the message
    (grpc_status.rpc_status.from_call)."""
    proto = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=err.message)
    if isinstance(err, InvalidArgument):
        proto.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.reason)]))
    status = rpc_status.to_status(proto)
    if isinstance(err, RetryLater):
        status = status._replace(trailing_metadata=(*status.trailing_metadata,
                                                    (RETRY_AFTER, str(err.retry_after_s))))
    return status


async def abort(context: grpc.aio.ServicerContext, err: RequestError) -> None:
    """End the call with `err`'s status, its trailing metadata the call's id and timings too."""
    status, call = status_of(err), current_call()
    await context.abort(status.code, status.details, tuple(status.trailing_metadata)
                        + (() if call is None else tuple(call.metadata())))


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def answer(metrics: Metrics, rpc: str, context: grpc.aio.ServicerContext,
                 handler: Callable[[], Awaitable], priority: str = ""):
    """Run `handler`, record the call, and answer what it raised with its status.
    `priority`: the class the request names in its `priority` field, if any (its own while
    it runs: server/priority.py's `asked`)."""
    record = CallRecord(metrics, rpc)
    restore = None
    try:
        if priority:
            restore = asked(priority, "priority")
        return await handler()
    except asyncio.CancelledError:
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= DEADLINE_SLACK_S
        record.code = "DEADLINE_EXCEEDED" if expired else CANCELLED
        raise
    except grpc.aio.AbortError:
        raise
    except Exception as err:  # noqa: BLE001 - every failure is answered, never raised on
        refusal = record.refusal(err)
    finally:
        record.end()
        if restore is not None:
            restore()
    # Sent once counted, so a caller that sees the refusal finds it in /metrics.
    await abort(context, refusal)


def answered(method):
    """A servicer method run by `answer`, under its request's `priority` class if it has one."""
    async def call(self, request, context):
        return await answer(self.metrics, method.__name__, context, lambda: method(self, request, context),
                            getattr(request, "priority", ""))
    return call


class Received(NamedTuple):
    """A request as gRPC hands it to the method, with its size on the wire: parsed; or, too
    big to parse on the event loop, as it came (`data`: parsed on a thread, in slices,
    server/grpc/wire.py, once its memory is held); or the error it did not parse with
    (`error`), so the method can refuse it."""

    message: Message | None
    nbytes: int
    data: bytes | None = None
    error: Exception | None = None


_holds: ContextVar[Holds | None] = ContextVar("attnserve_call_holds", default=None)


def call_holds() -> Holds:
    """The memory the current gRPC call holds, released once its answer is sent."""
    holds = _holds.get()
    assert holds is not None, "a gRPC method called outside the DecodeRequests interceptor"
    return holds


class DecodeRequests(grpc.aio.ServerInterceptor):
    """Every call's API key checked, its requests parsed without stalling the event
    loop, and its memory held against the budget until its answer has been sent.

    A call without a valid key (when keys are configured) gets UNAUTHENTICATED before its
    request is read; health, reflection and the KServe health calls need none. A request
    that does not parse (invalid UTF-8 in a string field, truncated or garbage bytes)
    gets INVALID_ARGUMENT, instead of grpc's UNKNOWN and a traceback in the log. Each
    request's bytes (but a small one's), as received, parsed and copied, are taken from
    the ledger first (RESOURCE_EXHAUSTED at once when they do not fit, or when its
    connection holds its share). A big one (over wire.INLINE_BYTES) is then parsed
    on `pool` a slice at a time, refused by its entry counts before any of it is parsed.
    The call's Holds (`call_holds()`) are released when gRPC reports the call over: for a
    unary call, once the response has been written to the caller."""

    def __init__(self, metrics: Metrics, plane: DataPlane, pool: Executor, max_entries: int,
                 keys: ApiKeys, tracing: Tracing | None = None):
        self.metrics, self.plane, self.pool, self.max_entries, self.keys, self.tracing = (
            metrics, plane, pool, max_entries, keys, tracing)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        rpc = details.method.rsplit("/", 1)[-1]
        key = refused = None  # the call's key (none when keys are off or the method is open), or its refusal
        if self.keys and not details.method.startswith(OPEN_METHODS):
            given = next((value for name, value in details.invocation_metadata or ()
                          if name == "authorization"), None)
            try:
                key = self.keys.check(given if isinstance(given, str) else None)
            except Unauthenticated as err:
                refused = err
        parse = handler.request_deserializer
        message_class = getattr(parse, "__self__", None)
        sliceable = isinstance(message_class, type) and issubclass(message_class, Message)

        def deserialize(data: bytes) -> Received:
            if sliceable and len(data) > INLINE_BYTES:
                return Received(None, len(data), data=data)
            try:
                return Received(parse(data), len(data))
            except (DecodeError, ValueError) as err:
                return Received(None, len(data), error=err)

        async def refuse(err: RequestError, context) -> None:
            self.metrics.answered(rpc, err.code.name, 0.0)
            current_call().code = err.code.name  # refused inside `running`, which began the call
            await abort(context, err)

        async def decoded(received: Received, context, holds: Holds):
            """The request parsed, or the call refused; returns (request, bytes held)."""
            request, error, held = received.message, received.error, 0
            try:
                held = self.plane.hold_request(holds, received.nbytes)
                if received.data is not None:
                    request = await asyncio.get_running_loop().run_in_executor(
                        self.pool, decode_in_slices, message_class, received.data, self.max_entries)
            except (TooManyEntries, NestedTooLarge) as err:
                await refuse(ResourceExhausted(f"request: {err}; send fewer or smaller entries per request"),
                             context)
            except (DecodeError, ValueError) as err:
                error = err
            except RequestError as err:
                await refuse(err, context)
            if error is not None:
                await refuse(InvalidArgument("request", f"not a valid {rpc} message "
                                             f"({error.__class__.__name__}: {error})"), context)
            return request, held

        async def checked(requests, context, holds: Holds):
            async for request in requests:
                request, held = await decoded(request, context, holds)
                self.plane.answer_owed(holds)
                yield request
                # The handler asked for the next: this one's answer has been written.
                self.plane.answer_sent(holds)
                holds.give_back(held)

        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)
        method = details.method
        tracing = None if method.startswith(UNTRACED_METHODS) else self.tracing
        service = method.lstrip("/").rpartition("/")[0]

        @contextlib.asynccontextmanager
        async def running(context):
            """The call begun, then refused (its key) or its class set and its place under its
            key's cap taken (ApiKeys.admit); at its end that place given back and, if it
            returned (a refusal has sent its trailers already), its id and timings sent."""
            # A metadata name sent twice: the first, as HTTP's headers.get takes it.
            given = dict(reversed([pair for pair in context.invocation_metadata() or ()
                                   if isinstance(pair[1], str)]))
            call = begin_call(method.lstrip("/"), given.get(REQUEST_ID), given.get(TRACEPARENT), tracing)
            answered, release = False, None
            try:
                if refused is not None:
                    await refuse(refused, context)
                try:
                    release = self.keys.admit(key, given.get(HEADER), HEADER)
                except RequestError as err:
                    await refuse(err, context)
                yield
                answered = True
            finally:
                if release is not None:
                    release()
                if answered:
                    context.set_trailing_metadata(tuple(call.metadata()))
                finish_call(call, tracing, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc})

        async def received(request, context):
            """The call's request (or requests) read, with its Holds, given back when gRPC
            reports the call over; its answer owed until then (each of a stream's until the
            method asks for the next request; none for a stream of answers to one request)."""
            holds = self.plane.holds(context.peer())
            _holds.set(holds)
            loop = asyncio.get_running_loop()
            context.add_done_callback(lambda _: self.plane.end_call(holds, loop))
            if handler.request_streaming:
                return checked(request, context, holds)
            if not handler.response_streaming:  # a stream of answers (health's Watch) may never end
                self.plane.answer_owed(holds)
            return (await decoded(request, context, holds))[0]

        if inspect.isasyncgenfunction(inner):
            async def behaviour(request, context):
                async with running(context):
                    async for response in inner(await received(request, context), context):
                        yield response
        else:
            async def behaviour(request, context):
                async with running(context):
                    return await inner(await received(request, context), context)
        # A call refused its key is answered before its request is read.
        return handler._replace(request_deserializer=deserialize if refused is None else lambda data: None,
                                **{kind: behaviour})
