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

from attnserve.client import EncoderClient
from attnserve.server.memory import alloc_hook
from tests.harness import ServerProcess

pytestmark = pytest.mark.skipif(shutil.which("cc") is None,
                                reason="no C compiler: the server samples memory instead")

MIB = 1 << 20


def with_hook(script: str) -> list[int]:
    """The numbers `script` prints, run in a Python with the hook preloaded."""
    env = dict(os.environ, LD_PRELOAD=str(alloc_hook.LIBRARY))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [int(line) for line in done.stdout.split()]


def test_built_where_there_is_a_compiler():
    assert alloc_hook.LIBRARY.is_file(), "make builds server/_alloc_peak.so (make alloc-hook)"


def test_a_threads_peak_is_its_own_allocations_exactly():
    script = textwrap.dedent("""
        import threading
        from attnserve.server.memory import alloc_hook
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
    peak, after_reset = with_hook(script)
    # 3 MiB held + 10 MiB at once, plus malloc's few bytes of rounding and the interpreter's
    # own small allocations between the two reads.
    assert 13 * MIB <= peak < 13 * MIB + 64 * 1024, peak
    assert after_reset == 0


def test_every_allocation_path_is_counted_and_counted_back_when_freed():
    """Through each of glibc's allocation functions a block is taken: all at once, the peak
    is their sum (with realloc's larger block before it shrank). Then one path at a time,
    a block taken and freed: were any path unbalanced (counted when taken and not when
    freed, or by another size), the count would drift by a block a path and the last,
    larger block would read off its size."""
    script = textwrap.dedent("""
        import ctypes
        from attnserve.server.memory import alloc_hook
        libc = ctypes.CDLL(None)
        for name in ("malloc", "calloc", "realloc", "memalign", "aligned_alloc", "valloc",
                     "pvalloc"):
            getattr(libc, name).restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        n = 1 << 20
        out = ctypes.c_void_p()

        def posix_memalign(size):
            assert libc.posix_memalign(ctypes.byref(out), 64, size) == 0
            return out.value

        paths = [libc.malloc, lambda size: libc.calloc(size, 1),
                 lambda size: libc.memalign(64, size), lambda size: libc.aligned_alloc(64, size),
                 libc.valloc, libc.pvalloc, posix_memalign,
                 lambda size: libc.realloc(libc.realloc(libc.malloc(16), 2 * size), size)]
        alloc_hook.reset()
        blocks = [path(n) for path in paths]
        print(alloc_hook.peak(), flush=True)
        for block in blocks:
            libc.free(block)
        alloc_hook.reset()
        for path in paths:
            libc.free(path(n))
        libc.realloc(libc.malloc(n), 0)  # frees it
        assert libc.posix_memalign(ctypes.byref(out), 0, n) != 0  # EINVAL, as glibc's
        libc.free(libc.malloc(3 * n))
        print(alloc_hook.peak(), flush=True)
    """)
    all_at_once, one_at_a_time = with_hook(script)
    slack = 64 * 1024  # malloc's rounding and the interpreter's own small allocations
    # seven blocks of 1 MiB, and the last path's 2 MiB before it shrinks to 1
    assert 9 * MIB <= all_at_once < 9 * MIB + slack, all_at_once
    assert 3 * MIB <= one_at_a_time < 3 * MIB + slack, one_at_a_time


# An empty LD_PRELOAD: the server starts as a user starts it, not preloaded by the suite
# (tests/conftest.py).
@pytest.mark.parametrize("env", [{"ATTNSERVE_ALLOC_HOOK_TRIED": "1", "LD_PRELOAD": ""},
                                 {"LD_PRELOAD": "libm.so.6"}],
                         ids=["preload-failed", "operator-preload"])
def test_without_it_the_server_samples_and_says_why(tiny_artifact, tmp_path, env):
    log = tmp_path / "server.log"
    with ServerProcess(tiny_artifact, env=env, log_path=log) as server:
        with EncoderClient(server.address) as client:
            client.embed(texts=["one short text"])
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    text = log.read_text()
    assert str(alloc_hook.LIBRARY) not in maps
    assert "event=alloc_hook_not_loaded" in text
    assert "batch_peak='peak of the bytes allocated (mallinfo2" in text


def test_the_server_preloads_it(tiny_artifact, tmp_path):
    log = tmp_path / "server.log"
    with ServerProcess(tiny_artifact, env={"LD_PRELOAD": ""}, log_path=log) as server:
        with EncoderClient(server.address) as client:
            client.embed(texts=["one short text"])
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    assert f"LD_PRELOAD={alloc_hook.LIBRARY}".encode() in environ  # it started itself again
    assert str(alloc_hook.LIBRARY) in maps
    assert "batch_peak='peak of the bytes the inference thread allocated" in log.read_text()
