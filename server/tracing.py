"""Traces, with --otlp-endpoint: one span per call, with a child for every step it took,
sent to an OpenTelemetry collector over OTLP/gRPC (docs/operations.md, "Traces"). They are
made once the call has been answered, from its timings (engine/timings.py), so nothing on
the call's own path waits for them. Without --otlp-endpoint OpenTelemetry is never
imported: the doors hold None in place of a Tracing."""

import logging
import time

from attnserve.server.engine.timings import Span

log = logging.getLogger("attnserve.server")


class Tracing:
    """The server's tracer and its exporter to the collector at `endpoint`
    (http://host:port, or https:// for TLS)."""

    def __init__(self, endpoint: str):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace, self.kind, self.status, self.codes = trace, SpanKind, Status, StatusCode
        self.provider = TracerProvider(resource=Resource.create({"service.name": "attnserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("attnserve")
        self.propagator = TraceContextTextMapPropagator()
        log.info("event=tracing endpoint=%s", endpoint)

    def parent(self, traceparent: str | None):
        """The caller's trace context; None (no valid `traceparent`): a trace of its own."""
        if not traceparent:
            return None
        context = self.propagator.extract({"traceparent": traceparent})
        span = self.trace.get_current_span(context).get_span_context()
        return context if span.is_valid else None

    def export(self, name: str, parent, started: float, spans: list[Span], error: str | None,
               attributes: dict, common: dict) -> None:
        """One call's span, `name`, from `started` (monotonic) to now, with `attributes`,
        and its steps' `spans` beneath it; `common` goes on every span; `error`: its
        status when it failed."""
        # The monotonic clock's reading, on the wall clock the collector keeps.
        offset = time.time_ns() - time.monotonic_ns()

        def ns(monotonic: float) -> int:
            return int(monotonic * 1e9) + offset

        root = self.tracer.start_span(name, context=parent, kind=self.kind.SERVER,
                                      start_time=ns(started), attributes=common | attributes)
        context = self.trace.set_span_in_context(root)
        for step in spans:
            child = self.tracer.start_span(
                step.stage, context=context, start_time=ns(step.start),
                attributes=common | {f"attnserve.{k}": v for k, v in step.attributes.items()})
            child.end(end_time=ns(step.end))
        if error is not None:
            root.set_status(self.status(self.codes.ERROR, error))
        root.end(end_time=ns(time.monotonic()))

    def shutdown(self) -> None:
        """Send what is left (blocks until the collector has it, or gives up)."""
        self.provider.shutdown()
