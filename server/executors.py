"""Every thread pool of the server, made in one place: which work leaves the event loop,
and for which thread.

The event loop only moves messages; anything that may take long runs on a pool, so a
long text, a big batch or a large response never stalls other calls (health checks
included)."""

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

# A pool's threads all start a task within this long of each other, or `on_every_thread`
# gives up (BrokenBarrierError) rather than hang start-up.
EVERY_THREAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Executors:
    inference: ThreadPoolExecutor
    """the backend's batches, one per thread at a time, as many threads as the backend
    runs batches at once (`Backend.concurrency`: 1 on the CPU, where onnxruntime already
    spreads a batch over the cores and a second thread would only fight it for them)"""
    inference_threads: int
    tokenize: ThreadPoolExecutor
    """texts to token ids"""
    respond: ThreadPoolExecutor
    """batch results to response messages; HTTP bodies (JSON) both ways"""
    scrape: ThreadPoolExecutor
    """/metrics collections (they read the device's memory), never queued behind a response"""


def create_executors(inference_threads: int = 1,
                     bind_inference_thread: Callable[[], None] | None = None) -> Executors:
    """`bind_inference_thread` runs once in each inference thread as it starts."""
    return Executors(
        inference=ThreadPoolExecutor(inference_threads, thread_name_prefix="inference",
                                     initializer=bind_inference_thread),
        inference_threads=inference_threads,
        tokenize=ThreadPoolExecutor(1, thread_name_prefix="tokenize"),
        respond=ThreadPoolExecutor(1, thread_name_prefix="respond"),
        scrape=ThreadPoolExecutor(1, thread_name_prefix="scrape"),
    )


def on_every_thread(pool: ThreadPoolExecutor, threads: int, work: Callable[[], None]) -> list[Future]:
    """`work` once on each of the pool's `threads` threads: every task waits at a barrier
    until all have started, so none finishes early and lets its thread take another."""
    barrier = threading.Barrier(threads)

    def task() -> None:
        barrier.wait(EVERY_THREAD_TIMEOUT_S)
        work()

    return [pool.submit(task) for _ in range(threads)]
