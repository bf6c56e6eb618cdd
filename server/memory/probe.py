"""Memory probes: what the device holds, and how much one batch took at its peak.

On CUDA, NVML (nvidia-ml-py) reads the device; on the CPU the process's resident set
and the machine's total come from /proc.

A batch's peak on the CPU is what the memory model predicts: the bytes allocated and not
yet freed at the run's peak, outputs included, over those allocated when it started.
`attnserve serve` preloads an allocation hook (alloc_hook.py) that keeps that count per
thread, so the inference thread reads its batch's peak exactly (measured against the
fitted model: 0.98-1.03 from 1 × 8 tokens to 8 × 256 with maps), at the cost of a few
additions per malloc. Without the hook (no C compiler at install) the figure is sampled:
glibc keeps the process's count exactly (mallinfo2: bytes handed out in the heaps plus those in
chunks of their own), and it does not depend on reuse: a block freed by one batch and
handed to the next counts again. The resident set cannot show it (a batch that reuses
freed memory does not raise it; measured: 0 to 2.5× a batch's allocations, depending on
what ran before). While a batch runs, a thread reads the count every SAMPLE_INTERVAL_S
and keeps the highest; the batch's figure is that over the count before it. Measured
against memray's allocation count of the same runs (what `attnserve memory-profile`
fits the model to), within 3 % for batches of 1 MiB and more. What it adds or misses:
it is the process's count, so another thread allocating during the batch (the event
loop building a response) is counted; a peak held for less than a sampling interval
can be missed (batches that small peak under about a MiB); and it counts onnxruntime's
tensors only while onnxruntime allocates each one itself, as the server runs it (CPU
arena off): an arena that keeps memory across runs would show only its growth.
Without mallinfo2 (musl, glibc < 2.33) the figure falls back to the rise of the resident
high-water mark (VmHWM, reset through /proc/self/clear_refs), logged as degraded.

On CUDA it is the rise of the device memory NVML reports after the batch over what was
in use before (onnxruntime's arena keeps the peak, so "after" sees it): the arena's
growth, which is 0 for a batch that fits in what the arena already holds. Per-shape
peaks on CUDA come from `attnserve memory-profile` and bench/gpu_check.py, a fresh
session per shape.
"""

import ctypes
import ctypes.util
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from attnserve.server.memory import alloc_hook

log = logging.getLogger("attnserve.memory")

_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str, pid: int | str = "self") -> int:
    """A /proc/PID/status figure in bytes; 0 for a process that is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def resident_bytes() -> int:
    return _status_kib("VmRSS")


def resident_bytes_of(pid: int) -> int:
    return _status_kib("VmRSS", pid)


_CGROUP = Path("/sys/fs/cgroup")


def _cgroup_bytes(name: str) -> int | None:
    """A cgroup v2 memory figure of this process's container, None where there is none."""
    try:
        text = (_CGROUP / name).read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def machine_total_bytes() -> int:
    """The memory this process may use: the machine's, or a container's limit when lower
    (a pod's limit, not the node's memory, is what the OOM killer enforces)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_bytes("memory.max")
    return min(physical, limit) if limit else physical


def machine_available_bytes() -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    available = int(match.group(1)) * 1024 if match else machine_total_bytes()
    limit, used = _cgroup_bytes("memory.max"), _cgroup_bytes("memory.current")
    if limit and used is not None:
        available = min(available, max(0, limit - used))
    return available


def _libc_function(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_MALLINFO2 = _libc_function("mallinfo2")
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not taken back, in every thread's heap (glibc's
    mallinfo2: uordblks) and in chunks mapped on their own (hblkhd)."""
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


SAMPLE_INTERVAL_S = 0.001
# mallinfo2 walks every free chunk of the heap holding its lock, and onnxruntime's
# allocations wait meanwhile: in a server's heap a read takes 0.24-0.33 ms, and reading every
# millisecond makes 32×128 batches 18 % slower. The sampler waits long enough after each
# read that reading takes at most this share of the time.
SAMPLE_MAX_SHARE = 0.02


class _PeakSampler:
    """A thread that, between `start` and `stop`, reads `allocated_bytes` every
    SAMPLE_INTERVAL_S (or less often, see SAMPLE_MAX_SHARE) and keeps the highest. `stop`
    does not wait for it: a batch of a millisecond must not wait a millisecond more."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._peak = 0
        threading.Thread(target=self._sample, name="memory-sampler", daemon=True).start()

    def _sample(self) -> None:
        while True:
            self._running.wait()
            started = time.perf_counter()
            with self._lock:
                if self._running.is_set():
                    self._peak = max(self._peak, allocated_bytes())
            took = time.perf_counter() - started
            time.sleep(max(SAMPLE_INTERVAL_S, took / SAMPLE_MAX_SHARE))

    def start(self) -> int:
        with self._lock:
            self._peak = before = allocated_bytes()
            self._running.set()
        return before

    def stop(self) -> int:
        with self._lock:
            self._running.clear()
            return max(self._peak, allocated_bytes())


_MALLOPT = _libc_function("mallopt")
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def keep_freed_memory() -> bool:
    """Let glibc keep what onnxruntime frees until `trim_heap` hands it back, instead of
    returning each large block to the OS at once.

    The CPU sessions run without onnxruntime's arena (so that `allocated_bytes` sees each
    batch's own allocations), which makes every tensor a malloc and a free. By default
    glibc maps a block over 32 MiB on its own and unmaps it when freed, and a thread other
    than the main one gets a heap of at most 64 MiB that cannot hold such blocks at all:
    each batch faulted its large tensors in afresh (32x512 ran 1.44x slower than with the
    arena). One heap for every thread, grown and trimmed only on request, keeps those
    pages for the next batch (measured: as fast as the arena), and the batch loop gives
    them back once the server is idle (`trim_heap`). Process-wide, so called before the
    inference threads first allocate."""
    if _MALLOPT is None:
        return False
    return all(_MALLOPT(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1)))


# Work that held this much hands the heap's freed pages back to the OS after it (each
# caller says when): below it, freed memory is cheaper kept for the next request than
# faulted in again.
TRIM_AFTER_BYTES = 16 << 20


def trim_heap() -> bool:
    """Return the heap's free pages to the OS (glibc malloc_trim(0), all arenas)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def _reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    used: int
    total: int


class MemoryProbe:
    """Reads the device the runtime runs on."""

    def __init__(self, cuda: bool):
        self.nvml = None
        self.sampler = None
        self.exact = not cuda and alloc_hook.loaded()
        """a batch's peak is read exactly and at no cost, so every batch is measured"""
        if cuda:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.method = "rise of the device memory in use (NVML): the arena's growth"
        elif self.exact:
            self.method = ("peak of the bytes the inference thread allocated and had not freed "
                           "(allocation hook)")
        elif _MALLINFO2 is not None:
            self.sampler = _PeakSampler()
            self.method = (f"peak of the bytes allocated (mallinfo2, sampled every "
                           f"{SAMPLE_INTERVAL_S * 1000:g} ms) over those allocated before")
        self.device = "cuda:0" if cuda else "cpu"
        # The fallback's: without a resettable VmHWM (no /proc/self/clear_refs, as in some
        # sandboxes), the high-water mark is the process's lifetime peak: fall back to what
        # the batch still holds when it ends (its outputs), a lower bound, rather than that.
        self.hwm_resettable = cuda or self.exact or self.sampler is not None or _reset_high_water_mark()
        if not cuda and not self.exact and self.sampler is None:
            self.method = ("rise of VmHWM over VmRSS (no mallinfo2: memory reused is not seen)"
                           if self.hwm_resettable else
                           "rise of VmRSS after the batch (VmHWM not resettable: a lower bound)")
            log.warning("event=memory_probe_degraded batch_peak=%r", self.method)
        else:
            log.info("event=memory_probe device=%s batch_peak=%r", self.device, self.method)

    def device_memory(self) -> DeviceMemory:
        if self.nvml is not None:
            info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return DeviceMemory(self.device, int(info.used), int(info.total))
        return DeviceMemory(self.device, resident_bytes(), machine_total_bytes())

    def available_bytes(self) -> int:
        if self.nvml is not None:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free)
        return machine_available_bytes()

    def start_batch(self) -> int:
        """Call before a batch, then `batch_peak` after it, from one thread at a time;
        returns the baseline `batch_peak` measures from."""
        if self.nvml is not None:
            return self.device_memory().used
        if self.exact:
            alloc_hook.reset()
            return 0
        if self.sampler is not None:
            return self.sampler.start()
        if self.hwm_resettable:
            _reset_high_water_mark()
        return resident_bytes()

    def batch_peak(self, baseline: int) -> int:
        """Bytes the batch added at its peak over `baseline`."""
        if self.nvml is not None:
            return max(0, self.device_memory().used - baseline)
        if self.exact:
            return alloc_hook.peak()
        if self.sampler is not None:
            return max(0, self.sampler.stop() - baseline)
        if not self.hwm_resettable:
            return max(0, resident_bytes() - baseline)
        return max(0, max(_status_kib("VmHWM"), resident_bytes()) - baseline)


def gpu_present() -> tuple[bool, str]:
    """Is there an NVIDIA GPU NVML can see? Asked before touching the CUDA provider, so a
    machine without one gets a clear reason instead of a provider's error spew."""
    try:
        import pynvml
    except ImportError as err:
        return False, f"NVML unavailable (nvidia-ml-py not installed: {err})"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return False, f"NVML unavailable ({err.__class__.__name__}: {err})"
    if count == 0:
        return False, "NVML sees no GPU"
    return True, f"NVML sees {count} GPU(s)"
