"""Where one call's time went, from the data plane to the door that answers it: the tokenizing, the wait in
the queue, the inference and the packing of the answer, and the tokens it ran (TEI's x-*-time and
x-compute-tokens headers, gRPC's trailers of the same names, and the spans of a trace are made from it).

A door starts a call's record (`begin`) in the task that serves the call; the data plane and the queue find it
there (`current`), as the metrics find the call's model (Metrics.routed_to), so every door gets the timings of
every call without handing a record through each signature. The queue's job keeps it while its sequences run:
the batch loop, in a task of its own, fills it in as the job's batches are handed out. With --workers the
engine process keeps its own record for the job and sends it back with the results (`to_wire`), and the front
end adds it to the call's (`add_wire`): the monotonic clock is the machine's, the same in every process."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

STAGES = ("tokenize", "queue", "inference", "respond")
# A call's spans past this many are counted, not kept: a request of many batches (or a
# stream of many messages) keeps a bounded record, and a trace a readable one. Its
# batches' spans stop at half of it, leaving room for its other steps.
MAX_SPANS = 64
MAX_BATCH_SPANS = MAX_SPANS // 2


@dataclass(frozen=True)
class Span:
    """One step of a call, on the monotonic clock (time.monotonic())."""

    stage: str
    start: float
    end: float
    attributes: dict[str, int | str | list[int]] = field(default_factory=dict)


@dataclass(eq=False)
class CallTimes:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    """per stage, the seconds the call spent in it (the queue: until its first batch
    started; inference: from then until its last batch ended)"""
    compute_tokens: int = 0
    """tokens run through the model for the call, special tokens included"""
    spans: list[Span] = field(default_factory=list)
    """each step as it happened (inference: one a batch), at most MAX_SPANS"""
    dropped: int = 0
    """steps past MAX_SPANS (batches past MAX_BATCH_SPANS), counted in `seconds` but not kept as spans"""
    batches: int = 0
    """inference spans kept"""

    def add(self, stage: str, start: float, end: float, counted: bool = True, **attributes) -> None:
        """A step of `stage` from `start` to `end`; `counted`: its time counts in `seconds` (a batch's does
        not: the job's span from its first batch to its last does, once)."""
        if counted:
            self.seconds[stage] += end - start
        batch = stage == "inference"
        if len(self.spans) < MAX_SPANS and not (batch and self.batches >= MAX_BATCH_SPANS):
            self.spans.append(Span(stage, start, end, attributes))
            self.batches += batch
        else:
            self.dropped += 1

    def to_wire(self) -> list:
        """For a channel's JSON header (server/workers/messages.py)."""
        return [self.seconds, self.compute_tokens,
                [[s.stage, s.start, s.end, s.attributes] for s in self.spans], self.dropped]

    def add_wire(self, wire: list) -> None:
        """Add what another process's `to_wire` recorded for the same call."""
        seconds, tokens, spans, dropped = wire
        for stage, value in seconds.items():
            self.seconds[stage] += value
        self.compute_tokens += tokens
        for stage, start, end, attributes in spans:
            self.add(stage, start, end, counted=False, **attributes)
        self.dropped += dropped


_CURRENT: ContextVar[CallTimes | None] = ContextVar("attnserve_call_times", default=None)


def begin(times: CallTimes | None = None) -> CallTimes:
    """`times` (or a new record) for the call the running task serves."""
    times = CallTimes() if times is None else times
    _CURRENT.set(times)
    return times


def current() -> CallTimes | None:
    """The record of the call the running task serves, None outside a call."""
    return _CURRENT.get()


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time a step of the current call (if there is one) as `name`."""
    start = time.monotonic()
    try:
        yield
    finally:
        times = _CURRENT.get()
        if times is not None:
            times.add(name, start, time.monotonic())
