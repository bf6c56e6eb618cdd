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


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A /proc/PID/status figure in bytes; 0 for a process that is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def resident_bytes(pid: int | str = "self") -> int:
    return status_bytes("VmRSS", pid)


def _cgroup_bytes(name: str) -> int | None:
    """A cgroup v2 memory figure of this process's container, None where there is none."""
    try:
        text = Path("/sys/fs/cgroup", name).read_text().strip()
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
# Blocks from this size up are mapped on their own and unmapped when freed (the
# intermediate tensors of a batch past a few sequences); smaller ones come from the heap.
MMAP_THRESHOLD = 4 << 20


def set_malloc_for_inference() -> bool:
    """glibc's settings for onnxruntime's CPU sessions, which run without onnxruntime's
    arena (so that `allocated_bytes` sees each batch's own allocations): every tensor is a
    malloc and a free.

    One heap for every thread (glibc gives a thread other than the main one a heap of at
    most 64 MiB of its own), trimmed only on request (`trim_heap`, once the server is
    idle), so small tensors reuse freed pages batch after batch. Large tensors are mapped
    on their own, at a fixed threshold (glibc's default threshold moves up as large
    blocks are freed): in the heap they fragmented it past recall, because glibc carves
    small requests out of the large blocks a layer frees, and the next layer's block no
    longer fits the hole. Measured (2026-12-04, AMD EPYC, 2 cores): a 28-layer 0.6B model's
    16x128 batch held 89 MiB at its peak but grew the heap by 2.1 GiB, and its 32x512 batch
    passed 23 GiB; mapped, each grows the process by its own peak. The mappings get
    transparent huge pages (`TUNABLES`): faulting a mapping's pages afresh for every
    tensor costs a 4 KiB page fault each otherwise (MiniLM 32x512 1.85x slower; with huge
    pages 1.1x). Process-wide, so called before the inference threads first allocate."""
    if _MALLOPT is None:
        return False
    return all(_MALLOPT(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2**31 - 1)))


# glibc reads its tunables when a process starts (the server sets them when it starts
# itself again with the allocation hook, server/memory/alloc_hook.py): hugetlb=1 asks for
# transparent huge pages (madvise) on what malloc maps, where the kernel's THP mode is
# `madvise` or `always`.
TUNABLES = "glibc.malloc.hugetlb=1"


def with_malloc_tunables(environ: dict) -> dict:
    """`environ` with `TUNABLES` added to GLIBC_TUNABLES, unless the operator set them."""
    given = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in given:
        return dict(environ)
    return dict(environ, GLIBC_TUNABLES=f"{given}:{TUNABLES}" if given else TUNABLES)


# Work that held this much hands the heap's freed pages back to the OS after it (each
# caller says when): below it, freed memory is cheaper kept for the next request than
# faulted in again.
TRIM_AFTER_BYTES = 16 << 20


def trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc malloc_trim(0), all arenas)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
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
