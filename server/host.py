"""What this machine and this process offer, read where the OS and its libraries keep it:
glibc's heap (its allocation count, keeping freed pages, trimming them), the memory a
process and its container may use (/proc, cgroup v2), the CPUs it may run on, and the GPUs
NVML sees. The memory probes and the runtime both read them here; neither imports the
other for them."""

import ctypes
import ctypes.util
import functools
import math
import os
import re
from pathlib import Path

_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A /proc/PID/status figure in bytes; 0 for a process that is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def resident_bytes() -> int:
    return status_bytes("VmRSS")


def resident_bytes_of(pid: int) -> int:
    return status_bytes("VmRSS", pid)


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


HAS_ALLOCATION_COUNT = _MALLINFO2 is not None


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not taken back, in every thread's heap (glibc's
    mallinfo2: uordblks) and in chunks mapped on their own (hblkhd)."""
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


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


def reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


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


@functools.cache
def _nvml_device(index: int):
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_memory(index: int = 0) -> tuple[int, int, int]:
    """(used, total, free) bytes of GPU `index`, as NVML reports them."""
    pynvml, handle = _nvml_device(index)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(info.used), int(info.total), int(info.free)


def usable_cores() -> int:
    """The cores this process may run on, and no more than its cgroup's CPU quota (a
    Kubernetes CPU limit) allows."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, math.ceil(int(quota) / int(period))))
