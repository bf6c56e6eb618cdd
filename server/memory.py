"""Memory probes: what the device holds, and how much one batch took at its peak.

On CUDA, NVML (nvidia-ml-py) reads the device; on the CPU the process's resident set
and the machine's total come from /proc. A batch's peak on the CPU is the rise of the
resident high-water mark (VmHWM, reset through /proc/self/clear_refs) over the resident
set before it; on CUDA it is the rise of the device memory NVML reports after the batch
over what was in use before (onnxruntime's arena keeps the peak, so "after" sees it).
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def resident_bytes() -> int:
    return _status_kib("VmRSS")


def machine_total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_available_bytes() -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else machine_total_bytes()


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
        _reset_high_water_mark()
        return resident_bytes()

    def batch_peak(self, baseline: int) -> int:
        """Bytes the batch added at its peak over `baseline` (0 when it reused memory)."""
        if self.nvml is not None:
            return max(0, self.device_memory().used - baseline)
        return max(0, max(_status_kib("VmHWM"), resident_bytes()) - baseline)


def gpu_present() -> tuple[bool, str]:
    """Is there an NVIDIA GPU NVML can see? Asked before touching the CUDA provider, so a
    machine without one gets a clear reason instead of a provider's error spew."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return False, f"NVML unavailable ({err.__class__.__name__}: {err})"
    if count == 0:
        return False, "NVML sees no GPU"
    return True, f"NVML sees {count} GPU(s)"
