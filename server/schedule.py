"""Dynamic batching with memory admission.

Requests queue as sequences of token ids. One worker forms a batch from whatever is
queued, runs it on the inference thread, and hands each sequence its own slice of the
output. Batches group sequences of similar length (sorted neighbours of the oldest
waiting sequence) so little padding is computed, and stay under caps on sequences,
padded tokens and predicted peak memory. The queue is bounded by requests and by
tokens: past either, a request is refused at once instead of waiting without end.
"""

import asyncio
import bisect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from attnserve.server.calls import DEADLINE_SLACK_S
from attnserve.server.errors import DeadlineExceeded, RequestError, ResourceExhausted, Unavailable
from attnserve.server.memory import MemoryProbe, trim_heap
from attnserve.server.memory_model import MemoryModel
from attnserve.server.metrics import Metrics
from attnserve.server.runtime import CPU, Runtime

log = logging.getLogger("attnserve.schedule")

# Padded tokens a batch may compute per real token: beyond it, a sequence waits for a
# batch of its own length instead. At 64 mixed-length callers 1.1 gave 10 % more
# throughput than 1.2 (and 1.3 less): on the CPU, padding costs as much as real work.
MAX_PADDING_RATIO = 1.1
# On the CPU a response is built and sent from the same memory the batches run in, and
# it is held several times over at its peak: the results, the message, protobuf's
# growing encode buffer and the bytes handed to gRPC. Measured on MiniLM (a 37 MiB
# response of attention maps), the process rose 4-5 responses over the batch's own
# peak, beyond the budget; admission counts this many copies of the response.
RESPONSE_COPIES = 4
# After a batch that raised the resident set by this much, the memory it freed goes back
# to the OS once the server has been idle for IDLE_TRIM_S. Not at once: a caller sending
# batch after batch would have each one fault its memory in again (32×128: ~8 % slower);
# meanwhile the next batch and the response reuse the freed memory instead. A batch that
# took this share of the memory budget gives it back at once: kept beside the response
# being built, it would overshoot the budget.
TRIM_AFTER_BYTES = 16 << 20
IDLE_TRIM_S = 0.05
TRIM_NOW_BUDGET_SHARE = 0.25


@dataclass
class SequenceResult:
    hidden: np.ndarray
    """(num_tokens, hidden): a view of the batch output, padding trimmed"""
    attentions: dict[int, np.ndarray]
    """layer -> (heads, num_tokens, num_tokens)"""


@dataclass(eq=False)
class Job:
    """One request's sequences, answered together."""

    sequences: list[np.ndarray]
    layers: tuple[int, ...]
    deadline: float | None
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    response_bytes: int = 0
    results: list[SequenceResult | None] = field(default_factory=list)
    waiting: int = 0
    """sequences still queued"""
    unanswered: int = 0
    """sequences without a result yet"""
    items: list["Waiting"] = field(default_factory=list)


@dataclass(eq=False)
class Waiting:
    job: Job
    index: int

    @property
    def length(self) -> int:
        return len(self.job.sequences[self.index])


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int
    max_queue_requests: int
    max_queue_tokens: int
    memory_budget_bytes: int
    max_wait_s: float


class Scheduler:
    def __init__(self, runtime: Runtime, metrics: Metrics, probe: MemoryProbe,
                 memory_model: MemoryModel, limits: Limits):
        self.runtime = runtime
        self.metrics = metrics
        self.probe = probe
        self.memory_model = memory_model
        self.limits = limits
        manifest = runtime.artifact.manifest
        self.heads = manifest.num_heads
        self.hidden = manifest.hidden_size
        self.pad_id = manifest.pad_token_id
        # On CUDA the budget is the device's; responses live in host memory.
        self.response_copies = RESPONSE_COPIES if runtime.provider == CPU else 0
        # The queue, oldest first, as insertion-ordered dicts used as sets, and the same
        # sequences indexed by (layers, length) -> oldest first: forming a batch, taking
        # it out and dropping a request cost the same however long the queue is (a list
        # scanned and sorted per batch made one request of 50k tiny texts take a minute
        # and stall the event loop).
        self.queue: dict[Waiting, None] = {}
        self.by_length: dict[tuple[int, ...], dict[int, dict[Waiting, None]]] = {}
        self.jobs: dict[Job, None] = {}
        self.queued_jobs = 0
        self.queued_tokens = 0
        self.draining = False
        self.running = False
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        # One inference thread: onnxruntime already spreads a batch over the cores.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="inference")
        self.task: asyncio.Task | None = None
        self.trim_pending = False
        self.idle_trim: asyncio.TimerHandle | None = None
        metrics.queue_depth.set_function(lambda: self.queued_jobs)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    # --- admission -------------------------------------------------------------------

    def predicted_bytes(self, batch: int, seq: int, layers: int) -> float:
        return self.memory_model.predict(batch, seq, self.heads, layers)

    def _admit(self, sequences: list[np.ndarray], layers: tuple[int, ...],
               response_bytes: int = 0) -> None:
        if self.draining:
            raise Unavailable("server is draining: send new work to another replica")
        if self.queued_jobs + 1 > self.limits.max_queue_requests:
            raise ResourceExhausted(
                f"queue full: {self.queued_jobs} requests waiting (limit "
                f"{self.limits.max_queue_requests}); retry with backoff")
        tokens = sum(len(s) for s in sequences)
        if self.queued_tokens + tokens > self.limits.max_queue_tokens:
            raise ResourceExhausted(
                f"queue full: {self.queued_tokens} tokens waiting, this request adds {tokens} "
                f"(limit {self.limits.max_queue_tokens}); retry with backoff or send fewer texts")
        budget = self.limits.memory_budget_bytes
        for index, seq in enumerate(sequences):
            need = self.predicted_bytes(1, len(seq), len(layers))
            if need > budget:
                raise ResourceExhausted(self._too_big(index, len(seq), len(layers), need, budget))
        extra = self.response_copies * response_bytes
        if extra:
            peak = max(self.predicted_bytes(1, len(s), len(layers)) for s in sequences)
            if peak + extra > budget:
                mib = 1 << 20
                raise ResourceExhausted(
                    f"the response, about {response_bytes / mib:.1f} MiB, takes about "
                    f"{extra / mib:.0f} MiB to build and send on top of the batch's "
                    f"{peak / mib:.0f} MiB at peak, over the memory budget of {budget / mib:.0f} "
                    f"MiB; what fits: a response of up to "
                    f"{max(0.0, budget - peak) / self.response_copies / mib:.1f} MiB (send fewer "
                    "texts per request, ask for fewer attention layers or heads, set "
                    "average_heads, or use dtype=DTYPE_FLOAT16)")

    def _alone_bytes(self, seq: int, layers: int) -> float:
        """One sequence alone with its response at the largest (every head, float32 maps,
        token embeddings): what the alternatives a refusal offers must fit in."""
        response = 4 * (layers * self.heads * seq * seq + (seq + 1) * self.hidden)
        return self.predicted_bytes(1, seq, layers) + self.response_copies * response

    def _too_big(self, index: int, length: int, layers: int, need: float, budget: int) -> str:
        fits_len = max((n for n in range(1, length) if self._alone_bytes(n, layers) <= budget),
                       default=0)
        fits_layers = max((k for k in range(layers) if self._alone_bytes(length, k) <= budget),
                          default=0)
        mib = 1 << 20
        return (
            f"sequence {index}: {length} tokens with {layers} attention layer(s) returned needs "
            f"about {need / mib:.0f} MiB at peak, over the memory budget of {budget / mib:.0f} MiB; "
            f"what fits: up to {fits_len} tokens with {layers} layer(s), or {fits_layers} "
            f"layer(s) at {length} tokens"
        )

    async def submit(self, sequences: list[np.ndarray], layers: tuple[int, ...] = (),
                     deadline: float | None = None,
                     response_bytes: int = 0) -> list[SequenceResult]:
        """Queue a request's sequences and wait for their results (in order).
        `response_bytes`: the size of the response the results become, counted against
        the memory budget with the batch they run in."""
        self._admit(sequences, layers, response_bytes)
        job = Job(sequences, layers, deadline, asyncio.get_running_loop().create_future(),
                  response_bytes=response_bytes)
        job.results = [None] * len(sequences)
        job.waiting = job.unanswered = len(sequences)
        job.items = [Waiting(job, i) for i in range(len(sequences))]
        lengths = self.by_length.setdefault(layers, {})
        for w in job.items:
            self.queue[w] = None
            lengths.setdefault(w.length, {})[w] = None
        self.jobs[job] = None
        self.queued_jobs += 1
        self.queued_tokens += sum(len(s) for s in sequences)
        for seq in sequences:
            self.metrics.sequence_length.observe(len(seq))
        self.idle.clear()
        self.wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            # The caller went away (or its deadline passed): free its place at once.
            expired = deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
            self._drop(job, "deadline" if expired else "cancelled", None)
            raise

    # --- the worker ------------------------------------------------------------------

    def _leave_queue(self, items: list[Waiting]) -> None:
        now = time.monotonic()
        for w in items:
            del self.queue[w]
            layers = w.job.layers
            lengths = self.by_length[layers]
            same = lengths[w.length]
            del same[w]
            if not same:
                del lengths[w.length]
                if not lengths:
                    del self.by_length[layers]
            self.queued_tokens -= w.length
            w.job.waiting -= 1
            if w.job.waiting == 0:
                del self.jobs[w.job]
                # Break the cycle job -> items -> job, so the batch outputs its results
                # are views of are freed once the caller is answered, not at the next
                # garbage collection.
                w.job.items = []
                self.queued_jobs -= 1
                self.metrics.stage_duration.labels("queue").observe(now - w.job.enqueued)

    def _drop(self, job: Job, reason: str, error: RequestError | None) -> None:
        mine = [w for w in job.items if w in self.queue]
        if mine:
            self.metrics.dropped.labels(reason).inc(len(mine))
            self._leave_queue(mine)
        if error is not None and not job.future.done():
            job.future.set_exception(error)
        self._update_idle()

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs):
            if job.future.done():
                self._drop(job, "cancelled", None)
            elif job.deadline is not None and now >= job.deadline:
                self._drop(job, "deadline", DeadlineExceeded(
                    "deadline passed while queued; the request was not run"))

    def _fits(self, batch: list[Waiting], layers: int) -> bool:
        count, longest = len(batch), batch[-1].length
        real = sum(w.length for w in batch)
        if (count > self.limits.max_batch_size
                or count * longest > self.limits.max_batch_tokens
                or count * longest > MAX_PADDING_RATIO * real):
            return False
        responses = sum(job.response_bytes for job in {w.job for w in batch})
        need = self.predicted_bytes(count, longest, layers) + self.response_copies * responses
        return need <= self.limits.memory_budget_bytes

    def next_batch(self) -> list[Waiting]:
        """The oldest waiting sequence and its nearest neighbours in length."""
        oldest = next(iter(self.queue))
        layers = oldest.job.layers
        same = self._neighbours(oldest)
        lo = hi = next(i for i, w in enumerate(same) if w is oldest)
        while True:
            grow_down = lo > 0 and self._fits(same[lo - 1:hi + 1], len(layers))
            grow_up = hi + 1 < len(same) and self._fits(same[lo:hi + 2], len(layers))
            if grow_down and (not grow_up or
                              oldest.length - same[lo - 1].length <= same[hi + 1].length - oldest.length):
                lo -= 1
            elif grow_up:
                hi += 1
            else:
                return same[lo:hi + 1]

    def _neighbours(self, oldest: Waiting) -> list[Waiting]:
        """The sequences with oldest's layers sorted by length, cut to the
        max_batch_size - 1 either side of oldest: no batch reaches further. Within each
        length the older sequences sit nearer to oldest, so a growing batch takes them
        first; oldest comes first among its own length, being the oldest of all."""
        reach = self.limits.max_batch_size - 1
        lengths = self.by_length[oldest.job.layers]
        keys = sorted(lengths)
        at = bisect.bisect_left(keys, oldest.length)
        # Nearest length first and, within a length, oldest first: reversed below, the
        # oldest of the nearest length ends up next to `oldest`, where the batch grows.
        below = islice((w for n in reversed(keys[:at]) for w in lengths[n]), reach)
        upward = islice((w for n in keys[at:] for w in lengths[n]), reach + 1)
        return list(below)[::-1] + list(upward)

    def _infer(self, ids: np.ndarray, mask: np.ndarray, layers: tuple[int, ...]):
        """On the inference thread: the batch, its time and its peak memory."""
        baseline = self.probe.start_batch()
        started = time.perf_counter()
        out = self.runtime.run(ids, mask, layers)
        seconds, peak = time.perf_counter() - started, self.probe.batch_peak(baseline)
        if peak >= TRIM_NOW_BUDGET_SHARE * self.limits.memory_budget_bytes:
            trim_heap()
        else:
            self.trim_pending |= peak >= TRIM_AFTER_BYTES
        return out, seconds, peak

    def _trim_when_idle(self) -> None:
        if self.trim_pending:
            self.trim_pending = False
            self.executor.submit(trim_heap)

    async def _run(self, batch: list[Waiting]) -> None:
        self._leave_queue(batch)
        layers = batch[0].job.layers
        count, longest = len(batch), batch[-1].length
        ids = np.full((count, longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((count, longest), dtype=np.int64)
        for row, w in enumerate(batch):
            ids[row, :w.length] = w.job.sequences[w.index]
            mask[row, :w.length] = 1
        loop = asyncio.get_running_loop()
        try:
            out, seconds, peak = await loop.run_in_executor(self.executor, self._infer, ids, mask, layers)
        except Exception as err:  # one failed batch fails its own requests, not the server
            log.exception("event=batch_failed batch=%d seq=%d", count, longest)
            for job in {w.job for w in batch}:
                self._drop(job, "failed", RequestError(f"inference failed: {err}"))
            return
        self._record(count, longest, sum(w.length for w in batch), layers, seconds, peak)
        for row, w in enumerate(batch):
            job = w.job
            if job.future.done():
                continue
            job.results[w.index] = SequenceResult(
                out.hidden[row, :w.length],
                {layer: maps[row, :, :w.length, :w.length] for layer, maps in out.attentions.items()},
            )
            job.unanswered -= 1
            if job.unanswered == 0:
                job.future.set_result(job.results)

    def _record(self, count: int, longest: int, real: int, layers: tuple[int, ...],
                seconds: float, peak: int) -> None:
        m = self.metrics
        bucket, attention = m.bucket(longest), str(bool(layers)).lower()
        m.batch_size.observe(count)
        m.batch_tokens.labels("real").observe(real)
        m.batch_tokens.labels("padded").observe(count * longest)
        m.stage_duration.labels("inference").observe(seconds)
        m.inference_duration.labels(bucket, attention).observe(seconds)
        m.batch_peak_memory.labels(bucket, attention).observe(peak)
        m.batch_predicted_memory.labels(bucket, attention).observe(
            self.predicted_bytes(count, longest, len(layers)))

    def _update_idle(self) -> None:
        if not self.queue and not self.running:
            self.idle.set()

    async def _loop(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            # Let requests that arrive within the gathering window (at least those of the
            # same event-loop tick) join the first batch; later ones queue while it runs.
            await asyncio.sleep(self.limits.max_wait_s)
            if self.idle_trim is not None:
                self.idle_trim.cancel()
            while self.queue:
                self._drop_expired()
                if not self.queue:
                    break
                self.running = True
                try:
                    await self._run(self.next_batch())
                except Exception as err:  # the worker must outlive any one bad batch
                    log.exception("event=scheduler_error")
                    for job in list(self.jobs):
                        self._drop(job, "failed", RequestError(f"scheduler error: {err}"))
                finally:
                    self.running = False
            self._update_idle()
            self.idle_trim = asyncio.get_running_loop().call_later(IDLE_TRIM_S, self._trim_when_idle)

    async def drain(self, timeout: float) -> bool:
        """Refuse new work and wait for what was accepted; True when all of it finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
