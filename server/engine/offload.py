"""Every thread pool of the server, and the one rule for which work leaves the event loop:
work that grows with a request's size (tokenizing, reading ids, parsing a big body, packing
a response) runs inline only while its estimated time is under INLINE_S, else on a pool,
so a big request never stalls other calls (health checks included), while the many small
calls skip the hop to a thread and back (~50 µs of the loop's time and a thread wake-up).
Costs are in the units below, measured with the default model on a 2-core AMD EPYC (Zen 3)
on 2026-12-01.
"""

import asyncio
import threading
from collections.abc import Callable, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

INLINE_S = 0.5e-3
"""work estimated to take less than this runs on the event loop"""
# Cost per unit of work, in seconds.
TEXT_S = 5e-6
"""tokenizing one text, its characters aside (encode_batch)"""
TEXT_CHAR_S = 0.3e-6
"""tokenizing one character of English text"""
ID_SEQUENCE_S = 8e-6
"""reading and range-checking one caller-supplied sequence of ids, its ids aside"""
TOKEN_ID_S = 0.01e-6
"""reading and range-checking one caller-supplied token id"""
DECODE_ID_S = 1.8e-6
"""decoding one token id back to text (decode_batch, random ids of the vocabulary: 1.5-1.8
µs, measured on a 2-core Intel Xeon on 2026-12-01)"""
JSON_BYTE_S = 0.05e-6
"""parsing one byte of a JSON body (orjson; densest case: lists of one id)"""
RESULT_S = 4e-6
"""packing one sequence's result into a response, its arrays aside"""
TOKEN_S = 0.2e-6
"""packing one token of a tokenization (its id, text and offsets)"""
COPY_BYTE_S = 0.05e-9
"""copying one byte of an array into a response (tobytes, protobuf's copy)"""
FLOAT_TEXT_S = 0.02e-6
"""writing one float as JSON text (orjson)"""
CUT_CHAR_S = 0.3e-6
"""cutting one character of a tokenized text into chunks (server/engine/chunk_cuts.py); at its worst, CJK text
cut into 8-token chunks (0.28 µs; English into 128-token chunks: 0.05 µs), measured on a 2-core Intel Xeon"""
CHUNK_S = 5e-6
"""planning one chunk: its window, its sequence or span, its vector (3.2 µs, on the same Xeon)"""
MAXSIM_S = 2e-9
"""MaxSim: one query token against one text token, per hidden dimension (a float32 matmul
at 0.5 GFLOP/s: an estimate, not measured)"""
POOLED_S = 8e-6
"""one pooled vector taken from its span's mean or cut to a Matryoshka size, and
normalised (6-7 µs for 384 and 1,024 values on a 2-core Intel Xeon)"""
SPAN_S = 0.3e-6
"""one sequence's token span for a vector that leaves a prompt out (on the same Xeon)"""
SUBMIT_S = 1.2e-6
"""with --workers: one sequence put into a front end's message to the engine process (100 ms
for 87,381 sequences of 3 ids on the same Xeon)"""
RECEIVE_S = 4e-6
"""with --workers: one sequence's result taken out of the engine process's message (330 ms
for 87,381 on the same Xeon)"""
# A pool's threads all start a task within this long of each other, or `on_every_thread`
# gives up (BrokenBarrierError) rather than hang start-up.
EVERY_THREAD_TIMEOUT_S = 600.0


def cost(items: Sized, per_item_s: float, per_unit_s: float, units: Callable[[object], int] = len) -> float:
    """The time of work over `items`, at `per_item_s` each and `per_unit_s` per unit of
    each (`units(item)`); the units of more items than could run inline are not counted,
    so that estimating stays cheap whatever the request's size."""
    fixed = len(items) * per_item_s
    if fixed >= INLINE_S:
        return fixed
    return fixed + per_unit_s * sum(map(units, items))


def inference_pool(model: str, threads: int = 1,
                   bind_inference_thread: Callable[[], None] | None = None) -> ThreadPoolExecutor:
    """One model's batches, one per thread at a time, as many threads as its backend runs
    batches at once (`Backend.concurrency`: 1 on the CPU, where onnxruntime already spreads
    a batch over the cores and a second thread would only fight it for them)."""
    return ThreadPoolExecutor(threads, thread_name_prefix=f"inference-{model}",
                              initializer=bind_inference_thread)


class Offload:
    """Request-side work (bodies parsed, texts tokenized, ids read) and response-side work
    (results packed into messages and bodies), inline when cheap, else on its pool: one
    thread each, shared by every door and model of the process."""

    def __init__(self):
        self.requests_pool = ThreadPoolExecutor(1, thread_name_prefix="requests")
        self.responses_pool = ThreadPoolExecutor(1, thread_name_prefix="responses")

    async def request(self, seconds: float, work: Callable[..., T], *args) -> T:
        if seconds < INLINE_S:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.requests_pool, work, *args)

    async def response(self, seconds: float, work: Callable[..., T], *args) -> T:
        if seconds < INLINE_S:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.responses_pool, work, *args)


def on_every_thread(pool: ThreadPoolExecutor, threads: int, work: Callable[[], None]) -> list[Future]:
    """`work` once on each of the pool's `threads` threads: every task waits at a barrier
    until all have started, so none finishes early and lets its thread take another."""
    barrier = threading.Barrier(threads)

    def task() -> None:
        barrier.wait(EVERY_THREAD_TIMEOUT_S)
        work()

    return [pool.submit(task) for _ in range(threads)]
