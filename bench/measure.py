"""The one timing loop, its summaries, and the other load on the machine while it ran."""

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Reps:
    """How long to repeat a measurement: at least `min_reps` and `min_seconds`, at most
    `max_reps`; `warmup` calls first, untimed."""

    min_reps: int
    max_reps: int
    min_seconds: float
    warmup: int = 1
    max_seconds: float = 12.0
    """past this, 3 repetitions are enough (the 32 × 512 rows take seconds a call)"""


class Budget:
    """A run's time limit: a phase that would not fit in what is left is skipped, and what
    was measured before it is still reported."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def enough(self, seconds: float) -> bool:
        return self.left() > seconds


def time_calls(call: Callable[[], object], reps: Reps | int,
               sync: Callable[[], object] = lambda: None,
               keep_going: Callable[[], bool] = lambda: True) -> list[float]:
    """Seconds per call: the one timing loop of every benchmark here.

    `reps` an int: exactly that many calls, none untimed; a Reps: its warm-up calls, then
    as many as it asks for. `sync` runs inside each timing, after the call (e.g.
    torch.cuda.synchronize, so asynchronous work is counted). `keep_going` is asked before
    every call but the first: False ends the loop early (a time budget running out)."""
    if isinstance(reps, int):
        reps = Reps(reps, reps, 0.0, warmup=0)
    for _ in range(reps.warmup):
        call()
        sync()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < reps.max_reps:
        elapsed = time.perf_counter() - started
        if len(times) >= reps.min_reps and elapsed >= reps.min_seconds:
            break
        if len(times) >= 3 and elapsed >= reps.max_seconds:
            break
        if times and not keep_going():
            break
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def time_each(call: Callable[[object], object], inputs: list) -> list[float]:
    """Seconds of `call(x)` for each of `inputs` in turn (a pass over a workload)."""
    pending = iter(inputs)
    return time_calls(lambda: call(next(pending)), len(inputs))


def latency_summary(seconds: list[float]) -> dict:
    a = np.asarray(seconds, dtype=np.float64)
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50) * 1e3),
            "p99_ms": float(np.percentile(a, 99) * 1e3), "mean_ms": float(a.mean() * 1e3)}


def shape_row(seconds: list[float], batch: int, seq: int) -> dict:
    """One caller sending the same batch back to back: tokens/s from the median call."""
    row = latency_summary(seconds)
    row["tokens"] = batch * seq
    row["tokens_per_s"] = batch * seq / (row["p50_ms"] / 1e3)
    return row


def workload_row(run_seconds: list[float], request_latencies: list[float], tokens: int) -> dict:
    """A whole workload run several times: tokens/s from the median run; latency
    percentiles over every request of every run."""
    row = latency_summary(request_latencies)
    median_run = float(np.median(run_seconds))
    row["tokens"] = tokens
    row["runs_s"] = [float(s) for s in run_seconds]
    row["tokens_per_s"] = tokens / median_run
    return row


# --- other load on the machine --------------------------------------------------------------

def _busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (/proc/stat, minus idle)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """Cores' worth of CPU that processes outside this benchmark used while a phase ran:
    on a shared machine it says how far to trust the figures. Children must have exited
    (been waited for) by `stop`."""

    def start(self) -> "OtherLoad":
        self.wall, self.busy, self.own = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self.wall
        other = (_busy_seconds() - self.busy) - (_own_seconds() - self.own)
        return max(0.0, other / wall) if wall > 0 else 0.0


def wait_quiet(max_seconds: float, threshold_cores: float = 0.15) -> float:
    """Wait (up to `max_seconds`) until the machine's CPU use over one second is below
    `threshold_cores`; returns the last reading."""
    deadline = time.monotonic() + max_seconds
    while True:
        busy, started = _busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        load = (_busy_seconds() - busy) / (time.perf_counter() - started)
        if load < threshold_cores or time.monotonic() >= deadline:
            return load


def median_of(rows: list[dict], *path: str) -> float:
    """The median over `rows` of the value at `path` (keys, one level each) in each."""
    values = []
    for value in rows:
        for key in path:
            value = value[key]
        values.append(value)
    return float(np.median(values))
