"""Memory probes: what the device holds, and how much one batch took at its peak.

On CUDA, NVML (nvidia-ml-py) reads the device; on the CPU the process's resident set
and the machine's total come from /proc. A batch's peak on the CPU is the rise of the
resident high-water mark (VmHWM, reset through /proc/self/clear_refs) over the resident
set before it. Memory an earlier batch freed but the allocator kept is reused without a
rise, so the scheduler hands it back (malloc_trim) after every large batch; trimming
before every batch would make each one fault its memory in again (measured: +0.9 ms on a
4.6 ms call of 16 tokens), so small batches may read low. On CUDA it is the
rise of the device memory NVML reports after the batch over what was in use before
(onnxruntime's arena keeps the peak, so "after" sees it): the arena's growth, which is 0
for a batch that fits in what the arena already holds.
"""

import ctypes
import ctypes.util
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("attnserve.memory")

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def resident_bytes() -> int:
    return _status_kib("VmRSS")


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


def _load_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None


_MALLOC_TRIM = _load_malloc_trim()


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
        if cuda:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.device = "cuda:0" if cuda else "cpu"
        # Without a resettable VmHWM (no /proc/self/clear_refs, as in some sandboxes), the
        # high-water mark is the process's lifetime peak: fall back to what the batch still
        # holds when it ends (its outputs), a lower bound, rather than that.
        self.hwm_resettable = cuda or _reset_high_water_mark()
        if not self.hwm_resettable:
            log.warning("event=memory_probe_degraded reason='cannot reset VmHWM through "
                        "/proc/self/clear_refs' batch_peak='rise of VmRSS after the batch'")

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
        """Call before a batch; returns the baseline `batch_peak` measures from."""
        if self.nvml is not None:
            return self.device_memory().used
        if self.hwm_resettable:
            _reset_high_water_mark()
        return resident_bytes()

    def batch_peak(self, baseline: int) -> int:
        """Bytes the batch added at its peak over `baseline` (0 when it reused memory)."""
        if self.nvml is not None:
            return max(0, self.device_memory().used - baseline)
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
