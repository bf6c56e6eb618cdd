"""On the CPU a long batch grows the server by about the peak it measured (its tensors
mapped on their own, not fragmenting the heap), and what it took goes back to the OS once
the server is idle (glibc keeps freed pages for the next batch until then:
server/host.py set_malloc_for_inference): the resident set of a real server process, read
from /proc."""

import re
import threading
import time
from pathlib import Path

import pytest

from attnserve.client import EncoderClient
from tests.harness import ServerProcess, delta

MIB = 1 << 20
# 32 sequences of MiniLM's 512 positions hold about 600 MiB at their peak on the CPU.
LONG_BATCH = 32
SETTLE_S = 10.0


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


class PeakWatcher:
    """The highest resident set of `pid` while the block runs, read every 5 ms."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, resident_bytes(self.pid))
            time.sleep(0.005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


@pytest.fixture(scope="module")
def server(minilm_artifact):
    with ServerProcess(minilm_artifact) as process:
        yield process


LONG_TEXT = " ".join(["attention maps show which tokens a model looked at"] * 80)


def test_a_long_batch_grows_the_server_by_about_its_measured_peak(server):
    with EncoderClient(server.address) as client:
        client.embed(["warm up"], timeout=60)
        before, metrics_before = resident_bytes(server.proc.pid), server.scrape()
        with PeakWatcher(server.proc.pid) as watcher:
            for _ in range(2):  # the second finds the heap the first left
                client.embed([LONG_TEXT] * LONG_BATCH, truncate=True, timeout=300)
    metrics_after = server.scrape()
    batch_peak = (delta(metrics_before, metrics_after, "attnserve_batch_peak_memory_bytes_sum")
                  / delta(metrics_before, metrics_after, "attnserve_batch_peak_memory_bytes_count"))
    took = watcher.peak - before
    # glibc's heap, holding these tensors, grew past the peak batch after batch (these two
    # batches: 741 MiB for a 552 MiB peak), a 28-layer model's to 24 times its peak.
    assert took < 1.1 * batch_peak + 32 * MIB, (
        f"resident set grew {took / MIB:.0f} MiB for a batch that measured "
        f"{batch_peak / MIB:.0f} MiB at its peak")
    print(f"\nlong batch: measured peak {batch_peak / MIB:.0f} MiB, resident set grew "
          f"{took / MIB:.0f} MiB")


def test_memory_of_a_long_batch_goes_back_once_idle(server):
    with EncoderClient(server.address) as client:
        client.embed(["warm up"], timeout=60)
        before = resident_bytes(server.proc.pid)
        with PeakWatcher(server.proc.pid) as watcher:
            client.embed([LONG_TEXT] * LONG_BATCH, truncate=True, timeout=300)
    took = watcher.peak - before
    # The batch did take memory: otherwise the test below could not fail.
    assert took > 200 * MIB, (before, watcher.peak)
    # Given back within a bounded wait (the server trims once idle for 50 ms): at least
    # three quarters of what the batch took.
    deadline, after = time.monotonic() + SETTLE_S, resident_bytes(server.proc.pid)
    while watcher.peak - after < 0.75 * took and time.monotonic() < deadline:
        time.sleep(0.1)
        after = resident_bytes(server.proc.pid)
    assert watcher.peak - after >= 0.75 * took, (
        f"resident {after / MIB:.0f} MiB {SETTLE_S:.0f} s after the batch, "
        f"{before / MIB:.0f} MiB before it, peak {watcher.peak / MIB:.0f} MiB")
    print(f"\nlong batch: took {took / MIB:.0f} MiB over {before / MIB:.0f} MiB, gave back "
          f"{(watcher.peak - after) / MIB:.0f} MiB once idle")
