"""The request queue: admission, the waiting sequences of each priority class indexed by
length, which class the next batch comes from, and what leaves the queue (a batch
starting, a deadline passing, a caller going away).

Admission refuses at once (RESOURCE_EXHAUSTED) what would not be served: past the bounds
on queued requests or tokens of every class together (`admit`, also asked before a
request's sequences are read, with a lower bound of its tokens); the engine has already
checked the request against the memory budget. The batch loop forms each batch around the
sequence `first` names, from its lane's length index (`neighbours`), and `take`s them out
of it; a taken sequence still waits, counted against the bounds and free to leave at once,
until the inference thread `claim`s its batch, and until then a batch of a class that
`first` now ranks below another can be `put_back`.

The rule between classes (`first`: a lower class's sequences count as having arrived
--priority-aging-ms after the later of their arrival and its last batch's start), and why
it starves neither class: docs/operations.md#priority-classes.
"""

import asyncio
import bisect
import enum
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from attnserve.server.config import ServeConfig
from attnserve.server.engine import timings
from attnserve.server.engine.requests import Submission
from attnserve.server.errors import DeadlineExceeded, RequestError, ResourceExhausted, Unavailable
from attnserve.server.memory.budget import ModelMemory
from attnserve.server.metrics import Metrics
from attnserve.server.priority import CLASSES, Priority, of_call
from attnserve.server.runtime.backend import SequenceResult

log = logging.getLogger("attnserve.queue")

# A caller's own deadline cancels its call from the caller's side, which reaches the server
# a little before the server's copy of the deadline (set when the request arrived) runs
# out: a cancellation this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1

# A big request's sequences are queued (and, when its caller leaves, taken out) this many
# at a time, the event loop serving other calls between slices: queued at once, 262,144
# sequences would hold the event loop for 2.5 s.
SUBMIT_SLICE = 2048
# Work of a lower class is admitted only while the queue, with it, stays within this share
# of --max-queue-requests and --max-queue-tokens: the rest is kept for interactive work,
# which an indexer filling the queue would otherwise have refused.
LOWER_CLASS_QUEUE_SHARE = 0.75


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int
    max_queue_requests: int
    max_queue_tokens: int
    memory_budget_bytes: int
    max_wait_s: float
    aging_s: float
    """a lower class's handicap (`RequestQueue.first`)"""
    interactive_window_s: float
    """interactive work is arriving while some waits, or arrived this recently"""
    bulk_batch_s: float
    """while interactive work is arriving, the most a batch of a lower class may be
    predicted to take (0: no cut)"""

    @classmethod
    def of(cls, config: ServeConfig, budget: int) -> "Limits":
        return cls(config.max_batch_size, config.max_batch_tokens, config.max_queue_requests,
                   config.max_queue_tokens, budget, config.max_wait_ms / 1000,
                   config.priority_aging_ms / 1000, config.interactive_window_ms / 1000,
                   config.bulk_batch_ms / 1000)


def check_room(limits: Limits, draining: bool, requests: int, waiting: int, tokens: int,
               at_least: bool = False, priority: Priority | None = None) -> None:
    """Refuse a request of `tokens` (a lower bound, with `at_least`) and class `priority`
    (None: the running call's) that the queue, holding `requests` requests and `waiting`
    tokens, has no room for, or any while draining."""
    if draining:
        raise Unavailable("server is draining: send new work to another replica")
    priority = priority or of_call()
    share, whose = 1.0, ""
    if priority is not CLASSES[0]:
        share = LOWER_CLASS_QUEUE_SHARE
        whose = (f" for {priority.value} work, which may fill {share:.0%} of it (the rest is "
                 f"kept for {CLASSES[0].value} calls)")
    if requests + 1 > share * limits.max_queue_requests:
        raise ResourceExhausted(
            f"queue full{whose}: {requests} requests waiting (limit "
            f"{limits.max_queue_requests}); retry with backoff")
    if waiting + tokens > share * limits.max_queue_tokens:
        raise ResourceExhausted(
            f"queue full{whose}: {waiting} tokens waiting, this request adds "
            f"{'at least ' if at_least else ''}{tokens} (limit {limits.max_queue_tokens}); "
            "retry with backoff or send fewer texts")


@dataclass(eq=False, kw_only=True)
class Job(Submission):
    """One request's sequences, answered together, as the queue keeps them."""

    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    results: list[SequenceResult | None] = field(default_factory=list)
    waiting: int = 0
    """sequences not yet running nor dropped"""
    unanswered: int = 0
    """sequences without a result yet"""
    items: list["Waiting"] = field(default_factory=list)
    """its sequences queued so far (a big request is queued a slice at a time)"""
    queued: int = 0
    """how many of its sequences have been queued, or accounted for as never queued"""
    dropping: bool = False
    """its caller left and its sequences are being taken out a slice at a time"""
    times: timings.CallTimes | None = None
    """its call's record (server/engine/timings.py), told when its batches ran"""
    ran: tuple[float, float] | None = None
    """(the first of its batches' starts, the last of their ends), on the monotonic clock"""

    def batch_ran(self, start: float, end: float, size: int, rows: int, seq: int) -> None:
        """One of its batches ran, from `start` to `end`: `size` sequences padded to [rows, seq]. Its call's
        record gets the batch, and once the job is answered its queue and inference times."""
        first, last = self.ran or (start, end)
        self.ran = min(first, start), max(last, end)
        if self.times is None:
            return
        self.times.add("inference", start, end, counted=False, batch_size=size, padded_shape=[rows, seq])
        if self.unanswered == 0:
            first, last = self.ran
            self.times.add("queue", self.enqueued, first)
            self.times.seconds["inference"] += last - first


class State(enum.Enum):
    QUEUED = "queued"
    """in the length index"""
    TAKEN = "taken"
    """in a batch that is formed and waiting for the inference thread"""
    CLAIMED = "claimed"
    """in a batch the inference thread has started"""
    DROPPED = "dropped"


@dataclass(eq=False, slots=True)
class Waiting:
    job: Job
    index: int
    length: int
    state: State = State.QUEUED


class Lane:
    """One class's queued sequences, oldest first, as ordered dicts used as sets, and the
    same sequences indexed by (layers, length) -> oldest first: forming a batch, taking it
    out and dropping a request cost the same however long the queue is (with a list
    scanned and sorted per batch, one request of 50k tiny texts would take a minute and
    stall the event loop). Ordered dicts, so a batch put back goes back to the front."""

    def __init__(self, handicap: float):
        self.handicap = handicap
        """seconds added to its sequences' arrival when classes are compared"""
        self.index: OrderedDict[Waiting, None] = OrderedDict()
        self.by_length: dict[tuple[int, ...], dict[int, OrderedDict[Waiting, None]]] = {}
        self.jobs = 0
        """requests with sequences waiting (queued or taken)"""
        self.arrived = -math.inf
        """when its latest request arrived, on the monotonic clock"""
        self.started = -math.inf
        """when its latest batch started, on the monotonic clock"""


class RequestQueue:
    def __init__(self, model: str, limits: Limits, memory: ModelMemory, metrics: Metrics):
        self.model, self.limits, self.memory, self.metrics = model, limits, memory, metrics
        self.watch: Callable[[int, int], None] | None = None
        """told the queued counts (requests, tokens) whenever they change"""
        self.lanes = {p: Lane(0.0 if rank == 0 else limits.aging_s) for rank, p in enumerate(CLASSES)}
        """each class's, highest first"""
        self.jobs: dict[Job, None] = {}
        """jobs with sequences waiting (queued or taken)"""
        self.waiting_tokens = 0
        self.unanswered_jobs = 0
        self.draining = False
        self.idle = asyncio.Event()
        """set while every request accepted has been answered"""
        self.idle.set()
        self.changed = asyncio.Event()
        """set when a request arrives or waiting sequences leave (and by the batch loop when
        a batch ends): the batch loop looks again"""
        # Taken -> claimed (the inference thread) races taken -> dropped (the event loop).
        self.claim_lock = threading.Lock()

    # --- admission -------------------------------------------------------------------

    def admit(self, tokens: int, at_least: bool = False, priority: Priority | None = None) -> None:
        """The cheap bounds (check_room), checked before any work on a request's sequences;
        `priority` None: the running call's."""
        check_room(self.limits, self.draining, len(self.jobs), self.waiting_tokens, tokens,
                   at_least, priority)

    def _counted(self) -> None:
        """The counts admission reads changed: tell whoever watches them (--workers)."""
        if self.watch is not None:
            self.watch(len(self.jobs), self.waiting_tokens)

    async def submit(self, submission: Submission) -> list[SequenceResult]:
        """Queue a request's sequences and wait for their results, in order (Submission
        says what each field asks, its class included). A big request is queued a slice at
        a time, so the event loop serves other calls in between."""
        lengths, priority = submission.lengths, submission.priority
        tokens = int(lengths.sum())
        self.admit(tokens, priority=priority)
        job = Job(**vars(submission), future=asyncio.get_running_loop().create_future(),
                  times=timings.current())
        count = len(job.sequences)
        job.results = [None] * count
        job.waiting = job.unanswered = count
        self.jobs[job] = None
        lane = self.lanes[priority]
        lane.jobs += 1
        lane.arrived = job.enqueued
        self.waiting_tokens += tokens
        self._counted()
        self.unanswered_jobs += 1
        self.idle.clear()
        self._keep_free()
        job.future.add_done_callback(self._answered)
        try:
            for start in range(0, count, SUBMIT_SLICE):
                if start:
                    await asyncio.sleep(0)
                    if job.future.done():  # dropped (failed, expired) meanwhile
                        break
                self._enqueue(job, start, lengths[start:start + SUBMIT_SLICE].tolist())
            self._unqueued(job, lengths)
            log.debug("event=queued model=%s priority=%s sequences=%d tokens=%d", self.model,
                      priority.value, count, tokens)
            return await job.future
        except asyncio.CancelledError:
            # The caller went away (or its deadline passed): free its place at once.
            expired = job.deadline is not None and time.monotonic() >= job.deadline - DEADLINE_SLACK_S
            self._unqueued(job, lengths)
            await self._drop_in_slices(job, "deadline" if expired else "cancelled")
            raise

    def _enqueue(self, job: Job, start: int, lengths: list[int]) -> None:
        lane = self.lanes[job.priority]
        by_length = lane.by_length.setdefault(job.layers, {})
        observe = self.metrics.sequence_length.labels(self.model).observe
        for i, length in enumerate(lengths, start):
            w = Waiting(job, i, length)
            job.items.append(w)
            lane.index[w] = None
            by_length.setdefault(length, OrderedDict())[w] = None
            observe(length)
        job.queued += len(lengths)
        self.changed.set()

    def _unqueued(self, job: Job, lengths: np.ndarray) -> None:
        """Account for the sequences of a job that left before all of them were queued."""
        missing = len(lengths) - job.queued
        if missing:
            self.waiting_tokens -= int(lengths[job.queued:].sum())
            self._counted()
            job.queued = len(lengths)
            job.waiting -= missing
            if job.waiting == 0:
                self._forget(job)

    def _keep_free(self) -> None:
        self.memory.keep_free(max((job.alone for job in self.jobs), default=0.0))

    # --- the classes and the length index, for the batch loop ---------------------------

    def first(self) -> Waiting | None:
        """The sequence the next batch grows from: of each class's oldest, the one that
        counts as having arrived the earliest (`key`), the higher class on a tie."""
        oldest = (next(iter(lane.index)) for lane in self.lanes.values() if lane.index)
        return min(oldest, key=self.key, default=None)

    def key(self, w: Waiting) -> float:
        """When `w` counts as having arrived, comparing classes (the module's rule): `first`
        takes the lowest."""
        lane = self.lanes[w.job.priority]
        if not lane.handicap:
            return w.job.enqueued
        return max(w.job.enqueued, lane.started) + lane.handicap

    def top_arriving(self, now: float) -> bool:
        """Whether work of the highest class is arriving: some of it waits (queued, or in a batch formed and
        not started), or a request of it arrived or a batch of it started within --interactive-window-ms. Its
        batch formed, or started, counts: a caller that sends its next call once answered, its last call
        having waited past the window behind a long batch, would otherwise find the lower class's batch formed
        beside its own uncut, and wait as long again."""
        lane = self.lanes[CLASSES[0]]
        recent = max(lane.arrived, lane.started)
        return lane.jobs > 0 or now - recent <= self.limits.interactive_window_s

    def depths(self) -> dict[Priority, int]:
        """Requests with sequences waiting, by class."""
        return {p: lane.jobs for p, lane in self.lanes.items()}

    def neighbours(self, oldest: Waiting, reach: int) -> list[Waiting]:
        """The queued sequences of oldest's class with its layers, sorted by length, cut to `reach` either
        side of oldest. Within each length the older sequences sit nearer to oldest, so a batch growing from
        it takes them first; oldest comes first among its own length, being the oldest of its class."""
        lengths = self.lanes[oldest.job.priority].by_length[oldest.job.layers]
        keys = sorted(lengths)
        at = bisect.bisect_left(keys, oldest.length)
        # Nearest length first and, within a length, oldest first: reversed below, the
        # oldest of the nearest length ends up next to `oldest`.
        below = islice((w for n in reversed(keys[:at]) for w in lengths[n]), reach)
        upward = islice((w for n in keys[at:] for w in lengths[n]), reach + 1)
        return list(below)[::-1] + list(upward)

    def take(self, items: list[Waiting]) -> None:
        """Out of the index into a formed batch; still waiting until claimed."""
        for w in items:
            self._unindex(w)
            w.state = State.TAKEN

    def claim(self, items: list[Waiting]) -> list[Waiting]:
        """On the inference thread, as a batch starts: the sequences still to run (the rest were dropped, or
        put back, while the batch waited). Call `started` with them next, on the event loop."""
        with self.claim_lock:
            claimed = [w for w in items if w.state is State.TAKEN]
            for w in claimed:
                w.state = State.CLAIMED
        return claimed

    def put_back(self, items: list[Waiting]) -> bool:
        """A formed batch's sequences back in their lane, at its front in the order they arrived (they were
        next in line), unless the inference thread has started it: whether it put them back. `items` (the
        batch's own list) is emptied meanwhile, so a `claim` of it later finds nothing to run."""
        with self.claim_lock:
            if any(w.state is State.CLAIMED for w in items):
                return False
            taken = [w for w in items if w.state is State.TAKEN]
            items.clear()
            for w in taken:
                w.state = State.QUEUED
        for w in sorted(taken, key=lambda w: (w.job.enqueued, w.index), reverse=True):
            lane = self.lanes[w.job.priority]
            same = lane.by_length.setdefault(w.job.layers, {}).setdefault(w.length, OrderedDict())
            for index in (lane.index, same):
                index[w] = None
                index.move_to_end(w, last=False)
        return True

    def started(self, items: list[Waiting]) -> None:
        """A batch of these (of one class) started running."""
        self.lanes[items[0].job.priority].started = time.monotonic()
        self._leave(items)

    # --- leaving ---------------------------------------------------------------------

    def _unindex(self, w: Waiting) -> None:
        lane = self.lanes[w.job.priority]
        del lane.index[w]
        lengths = lane.by_length[w.job.layers]
        same = lengths[w.length]
        del same[w]
        if not same:
            del lengths[w.length]
            if not lengths:
                del lane.by_length[w.job.layers]

    def _leave(self, items: list[Waiting]) -> None:
        for w in items:
            job = w.job
            self.waiting_tokens -= w.length
            job.waiting -= 1
            if job.waiting == 0:
                self._forget(job)
        self._counted()

    def _forget(self, job: Job) -> None:
        """A job none of whose sequences waits any longer."""
        del self.jobs[job]
        self.lanes[job.priority].jobs -= 1
        # Break the cycle job -> items -> job, so the batch outputs its results are views
        # of are freed once the caller is answered, not at the next garbage collection.
        job.items = []
        waited = time.monotonic() - job.enqueued
        self.metrics.stage_duration.labels(self.model, "queue").observe(waited)
        self.metrics.queue_wait.labels(self.model, job.priority).observe(waited)
        self._keep_free()

    def drop(self, job: Job, reason: str, error: RequestError | None) -> None:
        """Take the job's waiting sequences out at once, queued or in a formed batch that
        has not started; with `error`, answer the job with it."""
        self._drop_items(job.items, reason)
        if error is not None and not job.future.done():
            job.future.set_exception(error)

    async def _drop_in_slices(self, job: Job, reason: str) -> None:
        """`drop` for a caller that left, a slice at a time: taken out at once, a request
        of 262,144 sequences would stall the event loop for about 1 s."""
        job.dropping = True
        try:
            items = job.items
            for start in range(0, len(items), SUBMIT_SLICE):
                if start:
                    await asyncio.sleep(0)
                self._drop_items(items[start:start + SUBMIT_SLICE], reason)
        finally:
            job.dropping = False  # interrupted, `drop_expired` takes the rest

    def _drop_items(self, items: list[Waiting], reason: str) -> None:
        queued = [w for w in items if w.state is State.QUEUED]
        for w in queued:
            self._unindex(w)
            w.state = State.DROPPED
        with self.claim_lock:
            taken = [w for w in items if w.state is State.TAKEN]
            for w in taken:
                w.state = State.DROPPED
        mine = queued + taken
        if mine:
            self.metrics.dropped.labels(self.model, reason, mine[0].job.priority).inc(len(mine))
            self._leave(mine)
            self.changed.set()

    def drop_expired(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs):
            if job.dropping:
                continue
            if job.future.done():
                self.drop(job, "cancelled", None)
            elif job.deadline is not None and now >= job.deadline:
                self.drop(job, "deadline", DeadlineExceeded(
                    "deadline passed while queued; the request was not run"))

    def fail_all(self, error: RequestError) -> None:
        for job in list(self.jobs):
            self.drop(job, "failed", error)

    def _answered(self, _: asyncio.Future) -> None:
        self.unanswered_jobs -= 1
        if self.unanswered_jobs == 0:
            self.idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new work and wait for what was accepted; True when all of it was answered."""
        self.draining = True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
