"""The batch loop: forms batches from the request queue, each grown from the sequence
RequestQueue.first names with its nearest neighbours in length of its class, pads them to
the shape the backend runs them at, runs up to the backend's `max_in_flight` of them on
the inference threads, forming the next while they run, and hands each sequence its slice
of the output (docs/architecture.md#a-request-thread-by-thread; how no interactive request
waits long behind bulk work: docs/operations.md#priority-classes). A batch brings back
only the outputs its requests need, and the token embeddings where a request names token
spans (late chunking, a vector that leaves out a prompt), whose means are pooled on the
inference thread; each request keeps only what it asked for.
"""

import asyncio
import itertools
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, TOKEN_OUTPUTS
from attnserve.server.engine.queue import Limits, RequestQueue, State, Waiting
from attnserve.server.errors import RequestError
from attnserve.server.host import TRIM_AFTER_BYTES
from attnserve.server.memory.batch_time import BatchTimes
from attnserve.server.memory.budget import ModelMemory
from attnserve.server.memory.probe import MemoryProbe
from attnserve.server.metrics import Metrics
from attnserve.server.priority import CLASSES, Priority
from attnserve.server.runtime.backend import Backend, BatchOutput, Outputs, SequenceResult, Shape

log = logging.getLogger("attnserve.batch_loop")

# Padded tokens a batch may compute per real token: beyond it, a sequence waits for a
# batch of its own length instead. At 64 mixed-length callers 1.1 gave 10 % more
# throughput than 1.2 (and 1.3 less): on the CPU, padding costs as much as real work.
MAX_PADDING_RATIO = 1.1
# After a batch that raised the resident set by TRIM_AFTER_BYTES, the memory it freed goes
# back to the OS once the server has been idle for IDLE_TRIM_S. Not at once: a caller sending
# batch after batch would have each one fault its memory in again (32×128: ~8 % slower);
# meanwhile the next batch and the response reuse the freed memory instead. A batch that
# took this share of the memory budget gives it back at once: kept beside the response
# being built, it would overshoot the budget.
IDLE_TRIM_S = 0.05
TRIM_NOW_BUDGET_SHARE = 0.25
# Without the allocation hook (MemoryProbe.exact: every batch measured), measuring a
# batch's memory is not free: reading glibc's count before and after it costs 0.5 ms of
# a 1×16 call's 7 ms, and the probe's sampling thread reads while it runs (see
# memory/probe.py: SAMPLE_MAX_SHARE). A batch predicted to take this much runs for about 0.1 s or
# more on the CPU (1×512: 16 MiB, 0.11 s), so measuring it costs under 1 %: every such
# batch is measured. Of the smaller ones, the first of each length bucket (with or
# without maps) and every SMALL_MEASURE_EVERY-th after it: enough for the dashboard's
# measured/predicted panel, which compares the same batches.
MEASURE_ALL_FROM_BYTES = 16 << 20
SMALL_MEASURE_EVERY = 16


def pad(items: list[Waiting], shape: Shape, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(input_ids, attention_mask, token_type_ids) of `shape`, one sequence a row from the
    left, its first `attended` (Submission.attended) tokens unmasked, token type 1 from its
    second segment to its end (no token types when no sequence has a second segment); rows
    past the sequences are all padding, masked out."""
    ids = np.full(shape, pad_id, dtype=np.int64)
    mask = np.zeros(shape, dtype=np.int64)
    types = None if all(w.job.segments is None for w in items) else np.zeros(shape, dtype=np.int64)
    for row, w in enumerate(items):
        job, i = w.job, w.index
        ids[row, :w.length] = job.sequences[i]
        mask[row, :w.length if job.attended is None else job.attended[i]] = 1
        if types is not None and job.segments is not None:
            types[row, job.segments[i]:w.length] = 1
    return ids, mask, types


def span_means(hidden: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """float32 [spans, hidden]: the mean of `hidden`'s rows over each [start, end) of
    `spans` (none empty), summed in float64. A mean a span: 2-4.5x as fast as one
    np.add.reduceat over them all (one span of 128 rows of 384: 50 against 113 µs; 64
    spans of 512 rows: 0.69 against 1.2 ms; 2-core Intel Xeon, 2026-12-01)."""
    return np.stack([hidden[start:end].mean(axis=0, dtype=np.float64)
                     for start, end in spans.tolist()]).astype(np.float32)


@dataclass(eq=False)
class Batch:
    items: list[Waiting]
    """shortest first"""
    layers: tuple[int, ...]
    outputs: Outputs
    """every output its requests need"""
    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray | None
    holds: float
    """predicted peak bytes, responses included, held against the budget while in flight"""
    priority: Priority
    key: float
    """when the sequence it grew from counts as having arrived (RequestQueue.key)"""
    beside: bool = False
    """it runs on the beside thread (BatchLoop._fill)"""


@dataclass
class Ran:
    """A batch as the inference thread ran it."""

    items: list[Waiting]
    """the sequences run, one a row"""
    output: BatchOutput
    shape: Shape
    """as run, padding included"""
    seconds: float
    started: float
    """when it started, on the monotonic clock"""
    peak: int | None
    """bytes it added at its peak; None when not measured (see MEASURE_ALL_FROM_BYTES)"""
    predicted: float
    """the memory model's peak for the shape as run"""
    span_means: dict[int, np.ndarray]
    """row -> span_means of the rows whose requests named spans"""


class BatchLoop:
    def __init__(self, model: str, queue: RequestQueue, backend: Backend, inference: Executor,
                 beside: Executor | None, metrics: Metrics, probe: MemoryProbe, limits: Limits,
                 memory: ModelMemory, times: BatchTimes, pad_id: int):
        """`inference`: the backend's inference threads; `beside`: the thread that runs
        the highest class's batches beside a lower class's (None: the backend has none)."""
        self.model, self.queue, self.backend, self.pad_id = model, queue, backend, pad_id
        self.inference, self.beside, self.metrics, self.probe = inference, beside, metrics, probe
        self.limits, self.memory, self.times = limits, memory, times
        self.in_flight: dict[Batch, asyncio.Task] = {}
        self.trim_pending = False
        self.small_batches: dict[tuple[str, bool], itertools.count] = {}
        self.idle_trim: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Another model's batch ending may leave room for one of ours that waits for it.
        self.memory.on_freed(self.queue.changed.set)
        self.task = self.loop.create_task(self._run_forever(), name="batch-loop")

    # --- forming ---------------------------------------------------------------------

    def _fits(self, batch: list[Waiting], layers: int, cut_s: float | None) -> bool:
        count, longest = len(batch), batch[-1].length
        real = sum(w.length for w in batch)
        rows, seq = self.backend.padded_shape(count, longest)
        # The padding ratio counts the lengths mixed, not the backend's shape buckets: a
        # bucket's padding is the price of a shape already run.
        if (count > self.limits.max_batch_size
                or rows * seq > self.limits.max_batch_tokens
                or count * longest > MAX_PADDING_RATIO * real):
            return False
        if cut_s is not None:
            # Nothing predicts it yet (no time model, no batch of its length run): it
            # stays the one sequence it grew from, which then tells.
            predicted = self.times.predict(rows, seq, layers)
            if predicted is None or predicted > cut_s:
                return False
        # Responses are not in a batch's bytes: the memory ledger holds them from admission
        # until sent (server/memory/ledger.py), and `room()` is the budget less what it holds.
        return self.memory.batch_bytes(rows, seq, layers) <= self.memory.room()

    def next_batch(self, oldest: Waiting) -> list[Waiting]:
        """The sequence the batch grows from (RequestQueue.first) and its nearest
        neighbours in length of its class, shortest first; of a lower class while
        interactive work is arriving, cut to what --bulk-batch-ms predicts."""
        layers, bulk_s = len(oldest.job.layers), self.limits.bulk_batch_s
        cut_s = (bulk_s if bulk_s and oldest.job.priority is not CLASSES[0]
                 and self.queue.top_arriving(time.monotonic()) else None)
        same = self.queue.neighbours(oldest, self.limits.max_batch_size - 1)
        lo = hi = next(i for i, w in enumerate(same) if w is oldest)
        while True:
            grow_down = lo > 0 and self._fits(same[lo - 1:hi + 1], layers, cut_s)
            grow_up = hi + 1 < len(same) and self._fits(same[lo:hi + 2], layers, cut_s)
            if grow_down and (not grow_up or
                              oldest.length - same[lo - 1].length <= same[hi + 1].length - oldest.length):
                lo -= 1
            elif grow_up:
                hi += 1
            else:
                return same[lo:hi + 1]

    def _live(self) -> list[Batch]:
        """The batches in flight that will run: not every sequence dropped while it waited, nor put back."""
        return [b for b in self.in_flight if any(w.state is not State.DROPPED for w in b.items)]

    def _form(self, oldest: Waiting) -> Batch | None:
        """The next batch, grown from `oldest` (RequestQueue.first), taken out of the queue and padded; None
        while it would not fit in the memory budget beside the batches in flight, this model's and the others'
        (it waits for them instead of running smaller)."""
        items = self.next_batch(oldest)
        layers = oldest.job.layers
        shape = self.backend.padded_shape(len(items), items[-1].length)
        need = self.memory.batch_bytes(*shape, len(layers))
        held = sum(b.holds for b in self._live()) + self.memory.others_in_flight()
        if held and held + need > self.memory.room():
            self.metrics.memory_waits.labels(self.model).inc()
            return None
        self.queue.take(items)
        jobs = {w.job for w in items}
        outputs = frozenset().union(*(job.outputs for job in jobs))
        if any(job.spans is not None for job in jobs):
            outputs |= {HIDDEN_OUTPUT}
        return Batch(items, layers, outputs, *pad(items, shape, self.pad_id), need,
                     oldest.job.priority, self.queue.key(oldest))

    def _put_back_outranked(self) -> None:
        """A formed batch that has not started goes back to the queue when the next batch
        would grow from a sequence of another class that counts as having arrived before
        the batch's own (interactive work arriving behind formed bulk work), which would
        otherwise wait for it as well as for the batch running."""
        live = self._live()
        first = self.queue.first() if live else None
        if first is None:
            return
        key, put_back = self.queue.key(first), False
        for batch in live:
            if (batch.priority is not first.job.priority and key < batch.key
                    and self.queue.put_back(batch.items)):
                batch.holds, put_back = 0.0, True
        if put_back:
            self.memory.in_flight(sum(b.holds for b in self.in_flight))

    # --- on the inference thread -------------------------------------------------------

    def _infer(self, batch: Batch) -> Ran | None:
        """Run what is left of the batch; None when nothing is."""
        items = self.queue.claim(batch.items)
        if not items:
            return None
        log.debug("event=batch_started model=%s priority=%s sequences=%d", self.model,
                  batch.priority.value, len(items))
        self.loop.call_soon_threadsafe(self.queue.started, items)
        ids, mask, types = batch.input_ids, batch.attention_mask, batch.token_type_ids
        if len(items) < len(batch.items):  # some callers left while it waited: run the rest
            shape = self.backend.padded_shape(len(items), items[-1].length)
            ids, mask, types = pad(items, shape, self.pad_id)
        rows, seq = ids.shape
        predicted = self.memory.batch_bytes(rows, seq, len(batch.layers))
        # The probe measures one batch at a time: a batch beside another goes unmeasured
        # (and what it allocates counts in the other's peak, a small batch's bytes).
        measure = not batch.beside and (
            self.probe.exact or predicted >= MEASURE_ALL_FROM_BYTES
            or next(self.small_batches.setdefault(
                (self.metrics.bucket(seq), bool(batch.layers)), itertools.count()))
            % SMALL_MEASURE_EVERY == 0)
        if measure:
            baseline = self.probe.start_batch()
        started_at, started = time.monotonic(), time.perf_counter()
        out = self.backend.run(ids, mask, batch.layers, batch.outputs, types)
        seconds = time.perf_counter() - started
        peak = self.probe.batch_peak(baseline) if measure else None
        if log.isEnabledFor(logging.DEBUG):  # what a cut bulk batch took against its bound
            log.debug("event=batch_ran model=%s priority=%s batch=%d seq=%d seconds=%.4f "
                      "predicted_seconds=%s", self.model, batch.priority.value, rows, seq,
                      seconds, self.times.predict(rows, seq, len(batch.layers)))
        # Here rather than on the event loop: a batch of long sequences takes milliseconds.
        means = self._span_means(items, out.hidden)
        took = predicted if peak is None else peak
        if took >= TRIM_NOW_BUDGET_SHARE * self.memory.budget:
            self.backend.release_memory()
        else:
            self.trim_pending |= took >= TRIM_AFTER_BYTES
        return Ran(items, out, ids.shape, seconds, started_at, peak, predicted, means)

    def _span_means(self, items: list[Waiting], hidden: np.ndarray | None) -> dict[int, np.ndarray]:
        """row -> the means of the spans its request named, through the model's Dense
        layers (the backend's `project`), as the graph's pooled vectors went."""
        rows = {row: span_means(hidden[row], w.job.spans[w.index])
                for row, w in enumerate(items) if w.job.spans is not None}
        if not rows:
            return {}
        projected = self.backend.project(np.concatenate(list(rows.values())))
        ends = np.cumsum([len(means) for means in rows.values()])
        return dict(zip(rows, np.split(projected, ends[:-1]), strict=True))

    def _trim_when_idle(self) -> None:
        if self.trim_pending:
            self.trim_pending = False
            self.inference.submit(self.backend.release_memory)

    # --- handing out -----------------------------------------------------------------

    async def _run(self, batch: Batch) -> None:
        try:
            try:
                threads = self.beside if batch.beside else self.inference
                ran = await self.loop.run_in_executor(threads, self._infer, batch)
            except Exception as err:  # one failed batch fails its own requests, not the server
                log.exception("event=batch_failed batch=%d seq=%d", *batch.input_ids.shape)
                self._fail(batch, f"inference failed: {err}")
                return
            if ran is not None:
                self._record(ran, batch.layers)
                self._hand_out(ran)
        except Exception as err:  # the loop must outlive any one bad batch
            log.exception("event=batch_loop_error")
            self._fail(batch, f"scheduler error: {err}")
        finally:
            del self.in_flight[batch]
            self.memory.in_flight(sum(b.holds for b in self.in_flight))
            self.queue.changed.set()

    def _fail(self, batch: Batch, reason: str) -> None:
        for job in {w.job for w in batch.items}:
            self.queue.drop(job, "failed", RequestError(reason))

    def _hand_out(self, ran: Ran) -> None:
        """Each sequence its row of the outputs its request asked for, trimmed to its length."""
        out = ran.output
        jobs = {w.job: None for w in ran.items}
        for row, w in enumerate(ran.items):
            job = w.job
            if job.future.done():
                continue
            job.results[w.index] = SequenceResult(
                out.hidden[row, :w.length] if HIDDEN_OUTPUT in job.outputs else None,
                {layer: maps[row, :, :w.length, :w.length] for layer, maps in out.attentions.items()},
                {name: out.pooled[name][row, :w.length] if name in TOKEN_OUTPUTS
                 else out.pooled[name][row] for name in job.outputs if name in out.pooled},
                ran.span_means.get(row),
            )
            job.unanswered -= 1
        rows, seq = ran.shape
        for job in jobs:
            if job.future.done():
                continue
            job.batch_ran(ran.started, ran.started + ran.seconds, len(ran.items), rows, seq)
            if job.unanswered == 0:
                job.future.set_result(job.results)

    def _record(self, ran: Ran, layers: tuple[int, ...]) -> None:
        m, model = self.metrics, self.model
        count, (rows, seq) = len(ran.items), ran.shape
        bucket, attention = m.bucket(seq), str(bool(layers)).lower()
        m.batch_size.labels(model).observe(count)
        m.batch_tokens.labels(model, "real").observe(sum(w.length for w in ran.items))
        m.batch_tokens.labels(model, "padded").observe(rows * seq)
        m.stage_duration.labels(model, "inference").observe(ran.seconds)
        self.times.ran(rows, seq, len(layers), ran.seconds)
        m.inference_duration.labels(model, bucket, attention).observe(ran.seconds)
        if ran.peak is not None:
            m.batch_peak_memory.labels(model, bucket, attention).observe(ran.peak)
            m.batch_predicted_memory.labels(model, bucket, attention).observe(ran.predicted)
        if ran.output.new_shape:
            m.unseen_shape_runs.labels(model, "attention" if layers else "embeddings").inc()

    # --- the loop --------------------------------------------------------------------

    def _fill(self) -> None:
        """Hand batches over until the backend has as many as it can use, or none is left to form. A batch of
        the highest class runs on the beside thread while a batch of a lower class is in flight (waiting for
        that thread, if its last batch still runs, rather than behind the lower class's)."""
        self.queue.drop_expired()
        self._put_back_outranked()
        while (first := self.queue.first()) is not None:
            live = self._live()
            beside = (self.beside is not None and first.job.priority is CLASSES[0]
                      and any(b.priority is not CLASSES[0] for b in live))
            if beside and any(b.beside for b in live):
                return
            if not beside and sum(not b.beside for b in live) >= self.backend.max_in_flight:
                return
            batch = self._form(first)
            if batch is None:
                return
            batch.beside = beside
            log.debug("event=batch_formed model=%s priority=%s sequences=%d beside=%s", self.model,
                      batch.priority.value, len(batch.items), "true" if beside else "false")
            self.in_flight[batch] = self.loop.create_task(self._run(batch), name="batch")
            self.memory.in_flight(sum(b.holds for b in self.in_flight))

    async def _run_forever(self) -> None:
        changed = self.queue.changed
        while True:
            await changed.wait()
            changed.clear()
            # Let requests that arrive within the gathering window (at least those of the
            # same event-loop tick) join the first batch; later ones wait for a free slot.
            await asyncio.sleep(0 if self.in_flight else self.limits.max_wait_s)
            if self.idle_trim is not None:
                self.idle_trim.cancel()
            try:
                self._fill()
            except Exception as err:  # the loop must outlive any one bad batch
                log.exception("event=batch_loop_error")
                self.queue.fail_all(RequestError(f"scheduler error: {err}"))
            if not self.in_flight and self.queue.first() is None:
                self.idle_trim = self.loop.call_later(IDLE_TRIM_S, self._trim_when_idle)
