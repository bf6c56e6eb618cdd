"""What every door shares, written once: the server's name and version, the record of
each call (in-flight gauge, latency and count by status), how an exception becomes the
status a caller gets, the log line a refusal makes, and the API keys.

The metrics' `code` label carries the gRPC status name for every door (OK,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...), so one alert rule and one dashboard panel read
both protocols; an HTTP route is in the `rpc` label ("http:/v1/embeddings", ...), and the
model a call was routed to in the `model` label."""

import hmac
import logging
import time
from pathlib import Path

from attnserve.server.doors import call_context
from attnserve.server.errors import RequestError, Unauthenticated
from attnserve.server.metrics import Metrics, call_model

log = logging.getLogger("attnserve.calls")

OK, CANCELLED = "OK", "CANCELLED"
SERVER_NAME = "attnserve"
SERVER_VERSION = "0.1.0"


class CallRecord:
    """One call from its start to its answer: counted in flight meanwhile, then by
    status and latency. `refusal(err)` turns what the call raised into the error to
    answer with: a RequestError as it is (the caller's mistake, logged at DEBUG), anything
    else as INTERNAL with a short message (the server's fault, logged at ERROR with its
    traceback)."""

    def __init__(self, metrics: Metrics, rpc: str):
        self.metrics = metrics
        self.rpc = rpc
        self.code = OK
        self.started = time.perf_counter()
        self.model = call_model()
        """the model the call was routed to (metrics.routed_to), "" for none"""
        self.call = call_context.current()
        metrics.inflight.inc()

    def refusal(self, err: Exception) -> RequestError:
        if not isinstance(err, RequestError):
            log.error("event=internal_error rpc=%s", self.rpc, exc_info=err)
            err = RequestError(f"internal error: {err.__class__.__name__}")
        else:
            log.debug("event=refused rpc=%s code=%s message=%r", self.rpc, err.code.name,
                      err.message)
        self.code = err.code.name
        return err

    def end(self) -> None:
        if self.call is not None:
            self.call.code, self.call.model = self.code, self.model[0] or self.call.model
        self.metrics.inflight.dec()
        self.metrics.answered(self.rpc, self.code, time.perf_counter() - self.started,
                              self.model[0])


class ApiKeys:
    """The keys a caller may present (`Authorization: Bearer <key>`, on gRPC as the
    `authorization` metadata), from --api-key and --api-key-file (one key a line, as a
    Kubernetes Secret mounts it). Compared in constant time. With no key configured,
    every call is let through."""

    def __init__(self, key: str | None, key_file: Path | None):
        keys = [key] if key else []
        if key_file is not None:
            found = [line.strip() for line in key_file.read_text().splitlines() if line.strip()]
            if not found:
                raise ValueError(f"--api-key-file {key_file}: holds no key")
            keys += found
        self.keys = [k.encode() for k in keys]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless `authorization` carries a configured key."""
        if not self.keys:
            return
        if authorization is None:
            raise Unauthenticated("authorization: missing; send 'Authorization: Bearer <api key>'")
        scheme, _, presented = authorization.strip().partition(" ")
        given = presented.strip().encode("utf-8", "surrogateescape")
        # Every key compared, whether or not an earlier one matched: the time taken says
        # nothing about which key, or how much of one, was right.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(key, given)
        if scheme.lower() != "bearer" or not matched:
            raise Unauthenticated("authorization: not a valid API key")
