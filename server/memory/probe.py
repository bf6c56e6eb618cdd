"""Memory probes: what the device holds, and how much one batch took at its peak
(docs/memory.md, "What the server measures"): the bytes allocated and not yet freed at the
run's peak, outputs included, over those allocated when it started.

On the CPU, with the allocation hook (alloc_hook.py), the inference thread reads its
batch's peak exactly (against the fitted model: 0.98-1.03 from 1 × 8 tokens to 8 × 256
with maps). Without it, a thread samples glibc's count (mallinfo2), which counts a block
reused by the next batch again: within 3 % of memray's count for batches of 1 MiB and
more; it is the process's count, so another thread's allocations count too, and a peak
shorter than the interval can be missed. The resident set cannot show a batch's peak (one
that reuses freed memory does not raise it; measured: 0 to 2.5× a batch's allocations,
depending on what ran before), so it is the last resort, without mallinfo2 (musl, glibc <
2.33): the rise of the resident high-water mark (VmHWM, reset through
/proc/self/clear_refs), logged as degraded. On CUDA it is the rise of NVML's device
memory in use over the batch (onnxruntime's arena keeps the peak): the arena's growth.
"""

import logging
import threading
import time
from dataclasses import dataclass

from attnserve.server import host
from attnserve.server.memory import alloc_hook

log = logging.getLogger("attnserve.memory")

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
                    self._peak = max(self._peak, host.allocated_bytes())
            took = time.perf_counter() - started
            time.sleep(max(SAMPLE_INTERVAL_S, took / SAMPLE_MAX_SHARE))

    def start(self) -> int:
        with self._lock:
            self._peak = before = host.allocated_bytes()
            self._running.set()
        return before

    def stop(self) -> int:
        with self._lock:
            self._running.clear()
            return max(self._peak, host.allocated_bytes())


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    used: int
    total: int


class MemoryProbe:
    """Reads the device the runtime runs on."""

    def __init__(self, cuda: bool):
        self.cuda, self.sampler = cuda, None
        self.device = "cuda:0" if cuda else "cpu"
        self.exact = not cuda and alloc_hook.loaded()
        """a batch's peak is read exactly and at no cost, so every batch is measured"""
        self.hwm_resettable = True
        if cuda:
            self.method = "rise of the device memory in use (NVML): the arena's growth"
        elif self.exact:
            self.method = ("peak of the bytes the inference thread allocated and had not freed "
                           "(allocation hook)")
        elif host.HAS_ALLOCATION_COUNT:
            self.sampler = _PeakSampler()
            self.method = (f"peak of the bytes allocated (mallinfo2, sampled every "
                           f"{SAMPLE_INTERVAL_S * 1000:g} ms) over those allocated before")
        else:
            # Without a resettable VmHWM (no /proc/self/clear_refs, as in some sandboxes),
            # the high-water mark is the process's lifetime peak: fall back to what the
            # batch still holds when it ends (its outputs), a lower bound, rather than that.
            self.hwm_resettable = host.reset_high_water_mark()
            self.method = ("rise of VmHWM over VmRSS (no mallinfo2: memory reused is not seen)"
                           if self.hwm_resettable else
                           "rise of VmRSS after the batch (VmHWM not resettable: a lower bound)")
            log.warning("event=memory_probe_degraded batch_peak=%r", self.method)
            return
        log.info("event=memory_probe device=%s batch_peak=%r", self.device, self.method)

    def device_memory(self) -> DeviceMemory:
        if self.cuda:
            return DeviceMemory(self.device, *host.nvml_memory()[:2])
        return DeviceMemory(self.device, host.resident_bytes(), host.machine_total_bytes())

    def available_bytes(self) -> int:
        return host.nvml_memory()[2] if self.cuda else host.machine_available_bytes()

    def start_batch(self) -> int:
        """Call before a batch, then `batch_peak` after it, from one thread at a time;
        returns the baseline `batch_peak` measures from."""
        if self.cuda:
            return self.device_memory().used
        if self.exact:
            alloc_hook.reset()
            return 0
        if self.sampler is not None:
            return self.sampler.start()
        if self.hwm_resettable:
            host.reset_high_water_mark()
        return host.resident_bytes()

    def batch_peak(self, baseline: int) -> int:
        """Bytes the batch added at its peak over `baseline`."""
        if self.exact:
            return alloc_hook.peak()
        if self.cuda:
            after = self.device_memory().used
        elif self.sampler is not None:
            after = self.sampler.stop()
        else:
            after = max(host.status_bytes("VmHWM") if self.hwm_resettable else 0, host.resident_bytes())
        return max(0, after - baseline)
