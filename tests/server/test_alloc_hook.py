"""The allocation hook (server/alloc_peak.c): built by `make` wherever there is a C
compiler, preloaded by `attnserve serve`, and exact: a thread's peak counts what that
thread allocated and had not freed, to the byte of malloc's usable sizes, and nothing that
other threads allocate meanwhile."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnserve.bench.harness import ServerProcess
from attnserve.server import alloc_hook
from attnserve.server.client import EncoderClient

pytestmark = pytest.mark.skipif(shutil.which("cc") is None,
                                reason="no C compiler: the server samples memory instead")

MIB = 1 << 20


def test_built_where_there_is_a_compiler():
    assert alloc_hook.LIBRARY.is_file(), "make builds server/_alloc_peak.so (make alloc-hook)"


def test_a_threads_peak_is_its_own_allocations_exactly():
    script = textwrap.dedent("""
        import threading
        from attnserve.server import alloc_hook
        assert alloc_hook.loaded()
        alloc_hook.reset()
        held = bytearray(3 << 20)
        passing = bytearray(10 << 20)
        del passing
        # Another thread's allocation, alive while this one reads: not this thread's.
        other = []
        t = threading.Thread(target=lambda: other.append(bytearray(50 << 20)))
        t.start(); t.join()
        print(alloc_hook.peak(), flush=True)
        alloc_hook.reset()
        print(alloc_hook.peak(), flush=True)
    """)
    env = dict(os.environ, LD_PRELOAD=str(alloc_hook.LIBRARY))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    peak, after_reset = (int(line) for line in done.stdout.split())
    # 3 MiB held + 10 MiB at once, plus malloc's few bytes of rounding and the interpreter's
    # own small allocations between the two reads.
    assert 13 * MIB <= peak < 13 * MIB + 64 * 1024, peak
    assert after_reset == 0


def test_the_server_preloads_it(tiny_artifact, tmp_path):
    log = tmp_path / "server.log"
    with ServerProcess(tiny_artifact, log_path=log) as server:
        with EncoderClient(server.address) as client:
            client.embed(texts=["one short text"])
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert str(alloc_hook.LIBRARY) in maps
    assert "batch_peak='peak of the bytes the inference thread allocated" in log.read_text()
