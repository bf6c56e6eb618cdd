"""What a call carries besides its request, the same for every door: its request id (the
caller's X-Request-Id, or a new one), where its time went (server/engine/timings.py), and,
with --otlp-endpoint, the trace it belongs to (server/tracing.py).

A door begins a call where the call comes in (the HTTP middleware, the gRPC interceptor),
in the task that serves it; every log line of the call then ends with its request id
(server/logs.py). Its answer carries the id and TEI's timing headers (`metadata`: HTTP
headers, gRPC trailing metadata), and once it has gone, `end` hands the call's spans to
the tracing."""

import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from attnserve.server.engine import timings
from attnserve.server.logs import set_request_id
from attnserve.server.tracing import Tracing

REQUEST_ID = "x-request-id"
TRACEPARENT = "traceparent"
MAX_REQUEST_ID_CHARS = 128
# An id is echoed only when every character of it can travel in an HTTP header and in
# gRPC's ASCII metadata, and says nothing to a terminal reading the log.
_ECHOED = re.compile(r"[\x20-\x7e]+")
# TEI's names; the times in whole milliseconds, as TEI writes them.
TIME_HEADERS = (("x-tokenization-time", "tokenize"), ("x-queue-time", "queue"),
                ("x-inference-time", "inference"))
TOTAL_TIME, COMPUTE_TOKENS = "x-total-time", "x-compute-tokens"


def request_id(given: str | None) -> str:
    """The caller's id when it can be echoed (1 to 128 printable ASCII characters), else a
    new one: an id past that length, or with a control character, is replaced."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and _ECHOED.fullmatch(given):
        return given
    return uuid.uuid4().hex


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))


@dataclass(eq=False)
class Call:
    name: str
    """the call's span name: `POST /v1/embeddings`, `attnserve.v1.EncoderService/Embed`"""
    request_id: str
    parent: object | None = None
    """the caller's trace context (Tracing.parent), None for a trace of the call's own"""
    started: float = field(default_factory=time.monotonic)
    times: timings.CallTimes = field(default_factory=timings.CallTimes)
    code: str = "OK"
    """the gRPC code name of its answer (front.CallRecord)"""
    model: str = ""
    """the model it was routed to, "" for none"""

    def metadata(self) -> list[tuple[str, str]]:
        """The request id and TEI's timing headers, as they stand now."""
        times = self.times
        return [(REQUEST_ID, self.request_id),
                (TOTAL_TIME, _ms(time.monotonic() - self.started)),
                *((name, _ms(times.seconds[stage])) for name, stage in TIME_HEADERS),
                (COMPUTE_TOKENS, str(times.compute_tokens))]


_CALL: ContextVar[Call | None] = ContextVar("attnserve_call", default=None)


def begin(name: str, given_id: str | None, traceparent: str | None,
          tracing: Tracing | None) -> Call:
    """The call the running task serves, from the caller's X-Request-Id and traceparent."""
    call = Call(name, request_id(given_id),
                None if tracing is None else tracing.parent(traceparent))
    _CALL.set(call)
    timings.begin(call.times)
    set_request_id(call.request_id)
    return call


def current() -> Call | None:
    return _CALL.get()


def end(call: Call, tracing: Tracing | None, attributes: dict) -> None:
    """The call has been answered: its spans, with `attributes` (the protocol's) on its
    own, to the collector."""
    if tracing is None:
        return
    tracing.export(call.name, call.parent, call.started, call.times.spans,
                   None if call.code == "OK" else call.code,
                   attributes | {"attnserve.request_id": call.request_id,
                                 "attnserve.code": call.code,
                                 "attnserve.compute_tokens": call.times.compute_tokens,
                                 "attnserve.steps_dropped": call.times.dropped},
                   {"attnserve.model": call.model} if call.model else {})
