"""On the CPU the memory a long batch took goes back to the OS once the server is idle
(glibc keeps freed pages for the next batch until then: server/host.py keep_freed_memory):
the resident set of a real server process, read from /proc."""

import re
import threading
import time
from pathlib import Path

import pytest

from attnserve.client import EncoderClient
from tests.harness import ServerProcess

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


def test_memory_of_a_long_batch_goes_back_once_idle(server):
    long_text = " ".join(["attention maps show which tokens a model looked at"] * 80)
    with EncoderClient(server.address) as client:
        client.embed(["warm up"], timeout=60)
        before = resident_bytes(server.proc.pid)
        with PeakWatcher(server.proc.pid) as watcher:
            client.embed([long_text] * LONG_BATCH, truncate=True, timeout=300)
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
