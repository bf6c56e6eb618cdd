"""What every call shares, whatever its door, written once: its record (in-flight gauge,
latency and count by status, the `code` label a gRPC status name for every door), how an
exception becomes the status a caller gets, the server's name and version, and what a
call carries besides its request: its request id, where its time went (engine/timings.py;
TEI's timing headers) and, with --otlp-endpoint, its trace (tracing.py). A door begins a
call in the task that serves it (the HTTP middleware, the gRPC interceptor); every log
line of the call then ends with its request id (logs.py). docs/api.md lists the headers."""

import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from attnserve.server.engine import timings
from attnserve.server.errors import RequestError
from attnserve.server.logs import CURRENT_REQUEST_ID
from attnserve.server.metrics import Metrics, call_model
from attnserve.server.tracing import Tracing

log = logging.getLogger("attnserve.calls")

OK, CANCELLED = "OK", "CANCELLED"
SERVER_NAME = "attnserve"
SERVER_VERSION = "0.1.0"

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
    """The caller's id if it can be echoed (1-128 printable ASCII characters), else a new one."""
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
    """the gRPC code name of its answer (CallRecord)"""
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


def begin_call(name: str, given_id: str | None, traceparent: str | None, tracing: Tracing | None) -> Call:
    """The call the running task serves, from the caller's X-Request-Id and traceparent."""
    call = Call(name, request_id(given_id), None if tracing is None else tracing.parent(traceparent))
    _CALL.set(call)
    timings.begin(call.times)
    CURRENT_REQUEST_ID.set(call.request_id)
    return call


def current_call() -> Call | None:
    return _CALL.get()


def finish_call(call: Call, tracing: Tracing | None, attributes: dict) -> None:
    """The call has been answered: its spans, with `attributes` (the protocol's) on its
    own, to the collector."""
    if tracing is None:
        return
    tracing.export(call.name, call.parent, call.started, call.times.spans,
                   None if call.code == "OK" else call.code,
                   attributes | {"attnserve.request_id": call.request_id, "attnserve.code": call.code,
                                 "attnserve.compute_tokens": call.times.compute_tokens,
                                 "attnserve.steps_dropped": call.times.dropped},
                   {"attnserve.model": call.model} if call.model else {})


class CallRecord:
    """One call from its start to its answer: counted in flight meanwhile, then by
    status and latency. `refusal(err)` turns what the call raised into the error to
    answer with: a RequestError as it is (the caller's mistake, logged at DEBUG), anything
    else as INTERNAL with a short message (the server's fault, logged at ERROR with its
    traceback)."""

    def __init__(self, metrics: Metrics, rpc: str):
        self.metrics, self.rpc, self.code, self.started = metrics, rpc, OK, time.perf_counter()
        self.model = call_model()
        """the model the call was routed to (metrics.routed_to), "" for none"""
        self.call = current_call()
        metrics.inflight.labels("").inc()

    def refusal(self, err: Exception) -> RequestError:
        if not isinstance(err, RequestError):
            log.error("event=internal_error rpc=%s", self.rpc, exc_info=err)
            err = RequestError(f"internal error: {err.__class__.__name__}")
        else:
            log.debug("event=refused rpc=%s code=%s message=%r", self.rpc, err.code.name, err.message)
        self.code = err.code.name
        return err

    def end(self) -> None:
        if self.call is not None:
            self.call.code, self.call.model = self.code, self.model[0] or self.call.model
        self.metrics.inflight.labels(self.model[0]).dec()
        self.metrics.answered(self.rpc, self.code, time.perf_counter() - self.started, self.model[0])
