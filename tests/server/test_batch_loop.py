"""The request queue and the batch loop in-process, on a real onnxruntime backend over the
tiny artifact: how batches are formed (caps, padding ratio, oldest first), that the next
batch is formed and queued for the inference thread while one runs, and that a request
leaving a formed batch frees its place at once and is never run.

Orders and counters only: a gate in front of the real backend holds a batch running for
as long as a test needs, so nothing depends on how fast this machine is."""

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.artifact import load_artifact
from attnserve.server.engine.batch_loop import MAX_PADDING_RATIO
from attnserve.server.engine.queue import Limits, State
from attnserve.server.engine.requests import Submission
from attnserve.server.engine.runner import ModelRunner
from attnserve.server.errors import RequestError, ResourceExhausted
from attnserve.server.memory.batch_time import BatchTimes, TimeModel, TimeModels
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.model import MemoryModel
from attnserve.server.memory.probe import MemoryProbe
from attnserve.server.metrics import Metrics
from attnserve.server.priority import DEFAULT, Priority
from attnserve.server.runtime.backend import HIDDEN_ONLY
from attnserve.server.runtime.onnx import OrtBackend

WAIT_S = 30  # bound on any wait: a broken loop fails the test instead of hanging it
# a + b·batch·seq bytes: a batch's predicted memory is its padded tokens plus 1000.
LINEAR = MemoryModel(a=1000.0, b=1.0, c=0.0, d=0.0, source="test")


# The tiny artifact, loaded once the module's backend fixture has run.
ARTIFACT: list = []


@pytest.fixture(scope="module")
def backend(tiny_artifact):
    ARTIFACT[:] = [load_artifact(tiny_artifact)]
    return OrtBackend(ARTIFACT[0], device="cpu", intra_op_threads=1)


class Gated:
    """The real backend, with a record of every batch it ran and, on request, a batch
    held at the gate (on the inference thread) until the test opens it."""

    def __init__(self, backend: OrtBackend, hold: int | None = None):
        self.backend = backend
        self.provider, self.precision = backend.provider, backend.precision
        self.concurrency, self.max_in_flight = backend.concurrency, backend.max_in_flight
        self.beside, self.bind_thread = backend.beside, backend.bind_thread
        self.hold = hold
        self.held = threading.Event()
        self.gate = threading.Event()
        self.runs: list[tuple[int, int]] = []
        self.fail_at_length: int | None = None

    def padded_shape(self, batch, longest):
        return self.backend.padded_shape(batch, longest)

    def release_memory(self):
        self.backend.release_memory()

    def run(self, input_ids, attention_mask, layers=(), outputs=HIDDEN_ONLY, token_type_ids=None):
        call = len(self.runs)
        self.runs.append(input_ids.shape)
        if call == self.hold:
            self.held.set()
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if attention_mask.sum(axis=1).max() == self.fail_at_length:
            raise RuntimeError("this batch fails")
        return self.backend.run(input_ids, attention_mask, layers, outputs, token_type_ids)


MODEL = "tiny"


def assembled(backend, budget: int = 1 << 40, times: TimeModels | None = None,
              **caps) -> ModelRunner:
    """The server's own runner of one model (queue, batch loop, inference thread) on
    `backend`, its batch loop not started; `times`: its time model (None: measured batch
    times)."""
    limits = Limits(**{"max_batch_size": 64, "max_batch_tokens": 16384,
                       "max_queue_requests": 1024, "max_queue_tokens": 1 << 20,
                       "memory_budget_bytes": budget, "max_wait_s": 0.0, "aging_s": 1.0,
                       "interactive_window_s": 1.0, "bulk_batch_s": 0.0, **caps})
    memory = MemoryBudget(budget, responses_in_budget=False).for_model(MODEL, LINEAR, heads=4,
                                                                       hidden=32)
    return ModelRunner(MODEL, ARTIFACT[0], backend, memory, limits, Metrics(128),
                       MemoryProbe(cuda=False), BatchTimes(times, heads=4, missing="test"))


def submit(core: ModelRunner, lengths: list[int], layers: tuple[int, ...] = (),
           priority: Priority = DEFAULT) -> asyncio.Task:
    sequences = [np.arange(1000, 1000 + n, dtype=np.int64) for n in lengths]
    return asyncio.get_running_loop().create_task(core.queue.submit(
        Submission(sequences, layers=layers, priority=priority)))


def sample(core: ModelRunner, name: str, **labels) -> float:
    return core.metrics.registry.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


async def until(condition, what: str) -> None:
    for _ in range(WAIT_S * 100):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def check_rows(backend: OrtBackend, lengths: list[int], results) -> None:
    """Each result is what the backend gives its sequence run alone."""
    for n, result in zip(lengths, results, strict=True):
        ids = np.arange(1000, 1000 + n, dtype=np.int64)[None]
        alone = backend.run(ids, np.ones_like(ids)).hidden[0]
        np.testing.assert_allclose(result.hidden, alone, atol=1e-5)


# --- forming ---------------------------------------------------------------------------

async def formed(backend, lengths: list[int], **caps) -> tuple[list[int], ModelRunner]:
    """The first batch the loop would form from requests of one sequence each, queued
    in this order: its lengths, shortest first."""
    core = assembled(backend, **caps)
    tasks = [submit(core, [n]) for n in lengths]
    await asyncio.sleep(0)  # every submit has queued
    oldest = core.queue.first()
    batch = core.batch_loop.next_batch(oldest)
    assert oldest in batch
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return [w.length for w in batch], core


def test_a_batch_groups_the_oldest_with_its_nearest_lengths_within_the_caps(backend):
    async def main():
        # Padding ratio: 10 and 11 (22 padded for 21 real) fit; 16 would pad 10 to 16.
        lengths, _ = await formed(backend, [10, 40, 16, 11, 90])
        assert lengths == [10, 11]
        # Sequence cap.
        lengths, _ = await formed(backend, [20] * 9, max_batch_size=4)
        assert lengths == [20] * 4
        # Padded-token cap: 3 × 20 = 60 > 50.
        lengths, _ = await formed(backend, [20] * 5, max_batch_tokens=50)
        assert lengths == [20, 20]
        # Memory: each sequence of 20 adds 20 bytes to the model's 1000.
        lengths, _ = await formed(backend, [20] * 5, budget=1000 + 3 * 20)
        assert lengths == [20] * 3
    asyncio.run(main())


def test_among_equal_lengths_the_oldest_go_first(backend):
    async def main():
        core = assembled(backend, max_batch_size=2)
        tasks = [submit(core, [n]) for n in (8, 8, 8, 9)]
        await asyncio.sleep(0)
        queued = list(core.queue.lanes[DEFAULT].index)
        batch = core.batch_loop.next_batch(core.queue.first())
        assert batch == queued[:2]  # the two oldest 8s, not the newest
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(main())


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 128), min_size=1, max_size=40),
       max_batch_size=st.integers(1, 16), max_batch_tokens=st.integers(128, 2048))
def test_every_batch_formed_respects_the_caps_and_the_padding_ratio(
        backend, lengths, max_batch_size, max_batch_tokens):
    async def main():
        batch, _ = await formed(backend, lengths, max_batch_size=max_batch_size,
                                max_batch_tokens=max_batch_tokens)
        assert batch[0] <= lengths[0] <= batch[-1]  # the oldest is in it
        if len(batch) > 1:
            assert len(batch) <= max_batch_size
            assert len(batch) * batch[-1] <= max_batch_tokens
            assert len(batch) * batch[-1] <= MAX_PADDING_RATIO * sum(batch)
        # Neighbours in length: nothing left out lies strictly between its ends.
        rest = sorted(lengths)
        for n in batch:
            rest.remove(n)
        assert not [n for n in rest if batch[0] < n < batch[-1]]
    asyncio.run(main())


# --- in flight -------------------------------------------------------------------------

def test_the_next_batch_is_formed_while_one_runs_and_needs_no_event_loop_to_start(backend):
    async def main():
        gated = Gated(backend, hold=0)
        core = assembled(gated, max_batch_size=1)
        first, second = submit(core, [12]), submit(core, [7])
        core.batch_loop.start()
        await until(lambda: gated.held.is_set() and len(core.queue.jobs) == 1,
                    "the first batch runs")
        # While the first batch is held running, the second has been formed, padded and
        # handed to the inference thread, and is still waiting: counted in the queue.
        assert len(core.batch_loop.in_flight) == 2
        (waiting,) = [b for b in core.batch_loop.in_flight if b.items[0].state is State.TAKEN]
        assert waiting.input_ids.shape == (1, 7) and core.queue.waiting_tokens == 7
        # The inference thread goes on to it while this event loop is blocked: it never
        # waits for the loop between batches.
        gated.gate.set()
        for _ in range(WAIT_S * 100):
            if len(gated.runs) == 2:
                break
            time.sleep(0.01)  # blocks the event loop
        assert gated.runs == [(1, 12), (1, 7)]
        check_rows(backend, [12], await first)
        check_rows(backend, [7], await second)
        assert sample(core, "attnserve_batch_size_count") == 2
    asyncio.run(main())


def test_batches_in_flight_share_the_memory_budget(backend):
    async def main():
        gated = Gated(backend, hold=0)
        # 1000 + 100 bytes each: either fits alone, both do not.
        core = assembled(gated, budget=1500, max_batch_size=1)
        first, second = submit(core, [100]), submit(core, [100])
        core.batch_loop.start()
        await until(gated.held.is_set, "the first batch runs")
        # Forming stopped at the first batch, in the same pass: the second waits queued.
        assert len(core.batch_loop.in_flight) == 1
        assert [w.state for w in core.queue.lanes[DEFAULT].index] == [State.QUEUED]
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert gated.runs == [(1, 100), (1, 100)]
    asyncio.run(main())


def test_leaving_a_formed_batch_frees_the_place_at_once_and_skips_the_sequence(backend):
    async def main():
        gated = Gated(backend, hold=0)
        core = assembled(gated)
        running = submit(core, [5])
        # Another layer set: a batch of their own, formed while the first runs.
        leaving, staying = submit(core, [19], (0,)), submit(core, [20], (0,))
        core.batch_loop.start()
        await until(lambda: gated.held.is_set() and len(core.queue.jobs) == 2,
                    "the first batch runs")
        assert [len(b.items) for b in core.batch_loop.in_flight] == [1, 2]
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert len(core.queue.jobs) == 1 and core.queue.waiting_tokens == 20
        gated.gate.set()
        check_rows(backend, [5], await running)
        results = await staying
        check_rows(backend, [20], results)
        assert 0 in results[0].attentions
        # The second batch ran without the cancelled row.
        assert gated.runs == [(1, 5), (1, 20)]
        assert sample(core, "attnserve_dropped_sequences_total", reason="cancelled",
                      priority="interactive") == 1
        assert sample(core, "attnserve_batch_size_count") == 2
    asyncio.run(main())


def test_a_batch_whose_callers_all_left_never_runs(backend):
    async def main():
        gated = Gated(backend, hold=0)
        core = assembled(gated)
        running = submit(core, [5])
        leaving = submit(core, [9], (0,))
        core.batch_loop.start()
        await until(lambda: len(core.batch_loop.in_flight) == 2, "the second batch formed")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        # Its slot is free again: a new request gets a batch formed at once.
        later = submit(core, [6], (1,))
        await until(lambda: any(b.items[0].job.layers == (1,) for b in core.batch_loop.in_flight),
                    "a batch formed in the freed slot")
        gated.gate.set()
        await running
        check_rows(backend, [6], await later)
        assert gated.runs == [(1, 5), (1, 6)]
        assert sample(core, "attnserve_batch_size_count") == 2
    asyncio.run(main())


def test_a_failed_batch_fails_only_its_own_requests_and_the_loop_goes_on(backend):
    async def main():
        gated = Gated(backend)
        gated.fail_at_length = 33
        core = assembled(gated)
        ok, failing = submit(core, [4]), submit(core, [33], (0,))
        core.batch_loop.start()
        check_rows(backend, [4], await asyncio.wait_for(ok, WAIT_S))
        with pytest.raises(RequestError, match="inference failed: this batch fails"):
            await asyncio.wait_for(failing, WAIT_S)
        check_rows(backend, [8], await asyncio.wait_for(submit(core, [8]), WAIT_S))
        assert len(core.queue.jobs) == 0 and not core.batch_loop.in_flight
    asyncio.run(main())


# --- priority classes ------------------------------------------------------------------

BULK, INTERACTIVE = Priority.BULK, Priority.INTERACTIVE
# A time model of a millisecond per padded token: a batch of n sequences of 20 tokens is
# predicted to take n × 20 ms.
MS_A_TOKEN = TimeModel(a=0.0, b=1e-3, c=0.0, d=0.0, source="test")
MS_A_TOKEN_MODELS = TimeModels(MS_A_TOKEN, MS_A_TOKEN)


async def drop_all(tasks) -> None:
    """Their callers leave, once every one has queued."""
    await asyncio.sleep(0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_each_batch_grows_from_the_highest_class_unless_a_lower_one_has_aged(backend):
    """Interactive work goes before bulk work that arrived before it, unless that bulk work
    arrived more than the aging time earlier; a tie between classes goes to the higher."""
    async def main():
        for aging, first in ((3600.0, INTERACTIVE), (0.0, BULK)):
            core = assembled(backend, aging_s=aging)
            bulk = submit(core, [20], priority=BULK)
            await asyncio.sleep(0.01)  # the interactive request arrives strictly later
            interactive = submit(core, [8], priority=INTERACTIVE)
            await asyncio.sleep(0)
            assert core.queue.first().job.priority is first, aging
            assert core.queue.depths() == {INTERACTIVE: 1, BULK: 1}
            await drop_all([bulk, interactive])
            assert core.queue.depths() == {INTERACTIVE: 0, BULK: 0}
    asyncio.run(main())


def test_a_bulk_backlog_older_than_the_aging_time_still_yields_while_its_batches_run(backend):
    """A bulk backlog that has waited past the aging time does not rank before new
    interactive work while bulk batches are starting (4 bulk callers keeping more queued
    than the server runs in the aging time would otherwise push every interactive request
    behind all of it); interactive work that arrives more than the aging time after the
    last bulk batch started goes after the bulk work, so a stream of it never starves bulk."""
    async def main():
        aging = 0.05
        core = assembled(backend, aging_s=aging, max_batch_size=1)
        bulk = submit(core, [20, 20, 20], priority=BULK)
        await asyncio.sleep(2 * aging)  # the bulk request has waited past the aging time
        queue = core.queue
        items = [queue.first()]
        queue.take(items)
        queue.started(queue.claim(items))  # one of its batches starts now
        interactive = submit(core, [8], priority=INTERACTIVE)
        await asyncio.sleep(0)
        assert queue.first().job.priority is INTERACTIVE
        items = [queue.first()]
        queue.take(items)
        queue.started(queue.claim(items))  # the interactive request runs
        await asyncio.sleep(2 * aging)
        later = submit(core, [8], priority=INTERACTIVE)
        await asyncio.sleep(0)
        assert queue.first().job.priority is BULK
        await drop_all([bulk, interactive, later])
    asyncio.run(main())


@pytest.mark.parametrize("beside", [True, False], ids=["thread beside", "no thread beside"])
def test_an_interactive_request_queued_behind_bulk_work_runs_in_the_next_batch(backend, beside):
    """Bulk work runs in two batches, the second formed and waiting while the first is held
    running. An interactive request arriving then runs on the thread beside (Backend.beside),
    answered while the bulk batch is still held; without that thread, it puts the waiting
    bulk batch back and runs next, before it."""
    async def main():
        gated = Gated(backend, hold=0)
        gated.beside = beside
        core = assembled(gated, max_batch_size=2)
        bulk = submit(core, [20] * 4, priority=BULK)
        core.batch_loop.start()
        await until(lambda: gated.held.is_set() and len(core.batch_loop.in_flight) == 2,
                    "one bulk batch runs, the next waits formed")
        interactive = submit(core, [8], priority=INTERACTIVE)
        if beside:
            check_rows(backend, [8], await asyncio.wait_for(interactive, WAIT_S))
            assert not gated.gate.is_set() and not bulk.done()
        else:
            await until(lambda: any(b.priority is INTERACTIVE for b in core.batch_loop.in_flight),
                        "the interactive batch is formed")
            # The bulk batch that had not started is back in the queue, at its front.
            assert [w.state for w in core.queue.lanes[BULK].index] == [State.QUEUED] * 2
        gated.gate.set()
        check_rows(backend, [8], await asyncio.wait_for(interactive, WAIT_S))
        check_rows(backend, [20] * 4, await asyncio.wait_for(bulk, WAIT_S))
        assert gated.runs == [(2, 20), (1, 8), (2, 20)]
        assert sample(core, "attnserve_queue_wait_seconds_count", priority="bulk") == 1
        assert sample(core, "attnserve_queue_wait_seconds_count", priority="interactive") == 1
    asyncio.run(main())


def test_bulk_batches_are_cut_by_their_predicted_time_while_interactive_work_arrives(backend):
    """A cut of 50 ms and a time model of 20 ms per sequence of 20 tokens: while
    interactive work is arriving a bulk batch holds 2 sequences, else all 6; interactive
    batches are never cut."""
    async def main():
        core = assembled(backend, times=MS_A_TOKEN_MODELS, bulk_batch_s=0.05,
                         interactive_window_s=3600.0)
        bulk = submit(core, [20] * 6, priority=BULK)
        await asyncio.sleep(0)
        assert len(core.batch_loop.next_batch(core.queue.first())) == 6
        # An interactive request arrives (and its caller leaves): interactive work is
        # arriving for the window that follows.
        await drop_all([submit(core, [8], priority=INTERACTIVE)])
        assert core.queue.top_arriving(time.monotonic())
        assert [w.length for w in core.batch_loop.next_batch(core.queue.first())] == [20, 20]
        interactive = submit(core, [20] * 6, priority=INTERACTIVE)
        await asyncio.sleep(0)
        batch = core.batch_loop.next_batch(core.queue.first())
        assert len(batch) == 6 and batch[0].job.priority is INTERACTIVE
        await drop_all([bulk, interactive])
    asyncio.run(main())


def test_interactive_work_formed_or_started_counts_as_arriving(backend):
    """Interactive work counts as arriving while its batch is formed and for the window
    after that batch starts, however long before it arrived: a caller that sends its next
    call once answered then finds the bulk batch formed beside its own cut, not whole."""
    async def main():
        core = assembled(backend, bulk_batch_s=0.05, interactive_window_s=0.5)
        interactive = submit(core, [8], priority=INTERACTIVE)
        await asyncio.sleep(0.6)  # it arrived more than the window ago, and still waits
        items = core.batch_loop.next_batch(core.queue.first())
        core.queue.take(items)  # formed, not started
        assert core.queue.top_arriving(time.monotonic())
        core.queue.started(core.queue.claim(items))
        assert core.queue.top_arriving(time.monotonic())
        await asyncio.sleep(0.6)
        assert not core.queue.top_arriving(time.monotonic())
        await drop_all([interactive])
    asyncio.run(main())


def test_without_a_time_model_the_cut_follows_the_batches_run(backend):
    """No fit: a bulk batch of a length bucket nothing has run at yet is one sequence; once
    a batch there has run, it is sized by its seconds per padded token."""
    async def main():
        core = assembled(backend, bulk_batch_s=0.05, interactive_window_s=3600.0)
        assert core.times.source == "measured batch times (test)"
        await drop_all([submit(core, [8], priority=INTERACTIVE)])
        bulk = submit(core, [20] * 6, priority=BULK)
        await asyncio.sleep(0)
        assert len(core.batch_loop.next_batch(core.queue.first())) == 1
        core.times.ran(1, 20, 0, 0.02)  # a batch of one sequence of 20 tokens took 20 ms
        assert len(core.batch_loop.next_batch(core.queue.first())) == 2
        # Another length bucket, with maps, is still unknown.
        assert core.times.predict(1, 40, 0) is None and core.times.predict(1, 20, 2) is None
        await drop_all([bulk])
    asyncio.run(main())


def test_bulk_work_finishes_under_a_steady_interactive_stream(backend):
    """Interactive requests always waiting (eight outstanding, two a batch), and a bulk
    request of several batches: aging lets the bulk one through (with an aging time past
    the stream's length it would wait for the stream to end). The stream is bounded; the
    test asserts the bulk request finished during it, never how long it took."""
    async def main():
        core = assembled(backend, max_batch_size=2, aging_s=0.05)
        bulk = submit(core, [20] * 8, priority=BULK)
        stream = [submit(core, [8], priority=INTERACTIVE) for _ in range(8)]
        core.batch_loop.start()
        for _ in range(5000):
            if bulk.done():
                break
            await stream.pop(0)
            stream.append(submit(core, [8], priority=INTERACTIVE))
        assert bulk.done(), "the bulk request starved"
        check_rows(backend, [20] * 8, bulk.result())
        await asyncio.gather(*stream)
    asyncio.run(main())


def test_bulk_work_fills_three_quarters_of_the_queue_and_interactive_work_the_rest(backend):
    """With room for 4 requests: a bulk request past the third is refused, saying the rest
    is kept for interactive calls, and an interactive request still gets the last place."""
    async def main():
        core = assembled(backend, max_queue_requests=4)
        bulk = [submit(core, [8], priority=BULK) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="for bulk work, which may fill 75% of it "
                                                    r"\(the rest is kept for interactive calls\)"):
            await submit(core, [8], priority=BULK)
        interactive = submit(core, [8], priority=INTERACTIVE)
        await asyncio.sleep(0)
        assert core.queue.depths() == {INTERACTIVE: 1, BULK: 3}
        with pytest.raises(ResourceExhausted, match=r"queue full: 4 requests waiting \(limit 4\)"):
            await submit(core, [8], priority=INTERACTIVE)
        await drop_all([*bulk, interactive])
    asyncio.run(main())
