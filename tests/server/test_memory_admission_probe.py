"""The figure admission and the dashboard are judged by: the server's per-batch peak
(MemoryProbe, on the CPU) counts what a batch allocates, the quantity `attnserve
memory-profile` measures with memray and fits the memory model to; and it counts it
again when the batch reuses memory an earlier one freed, which the resident set does
not show.

Each measurement runs in a fresh process, as a server starts: the probe reads glibc's
count at most 2 % of the time (memory.SAMPLE_MAX_SHARE), and in the test process's heap,
fragmented by every test before it, a read takes long enough to space the reads past the
tiny model's short peaks."""

import multiprocessing
import tempfile
from pathlib import Path

import numpy as np
import pytest

from attnserve.server.host import allocated_bytes

MIB = 1 << 20
BATCH, SEQ = 32, 128


def _peaks(artifact_dir: str, runs: int, with_memray: bool) -> tuple[list[int], int, int]:
    """In a fresh process: the tiny model's attention graph with the server's session
    options, run `runs` times under the probe; (the probe's peaks, memray's peak of one
    more run or 0, the bytes of every layer's maps)."""
    import onnxruntime as ort

    from attnserve.artifact import load_artifact
    from attnserve.server.memory.probe import MemoryProbe
    from attnserve.server.runtime.onnx import CPU, session_options

    artifact = load_artifact(Path(artifact_dir))
    graph = artifact.manifest.graph(attention=True, precision="fp32")
    session = ort.InferenceSession(str(artifact.path(graph.file)), session_options(1, CPU),
                                   providers=[CPU])
    layers = artifact.manifest.num_layers
    names = ["last_hidden_state"] + [f"attentions.{i}" for i in range(layers)]
    ids = np.random.default_rng(0).integers(1000, 20000, size=(BATCH, SEQ), dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    session.run(names, feed)  # kernels and thread pool made before anything is counted
    maps = layers * BATCH * artifact.manifest.num_heads * SEQ * SEQ * 4
    counted = 0
    if with_memray:
        import memray

        with tempfile.TemporaryDirectory() as scratch:
            capture = Path(scratch) / "run.bin"
            with memray.Tracker(capture, native_traces=False, trace_python_allocators=False):
                out = session.run(names, feed)
                del out
            with memray.FileReader(capture) as reader:
                counted = reader.metadata.peak_memory
    probe = MemoryProbe(cuda=False)
    assert probe.sampler is not None, probe.method
    peaks = []
    for _ in range(runs):
        baseline = probe.start_batch()
        out = session.run(names, feed)
        peaks.append(probe.batch_peak(baseline))
        del out
    return peaks, counted, maps


@pytest.fixture(scope="module")
def fresh():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        yield lambda *args: pool.apply(_peaks, args)


def test_probe_counts_what_memray_counts(fresh, tiny_artifact):
    peaks, counted, maps = fresh(str(tiny_artifact), 3, True)
    # Between its reads the probe can miss a transient peak, never add one (nothing else
    # allocates in this process): the highest of three runs.
    peak = max(peaks)
    # The run's outputs (every layer's maps) are alive when it ends, so both counts
    # hold them at least.
    assert counted >= maps and peak >= maps, (counted, peaks, maps)
    # memray also counts the interpreter's own small allocations of the call.
    assert abs(peak - counted) <= 0.03 * counted + 0.5 * MIB, ([p / MIB for p in peaks], counted / MIB)


def test_memory_freed_and_reused_counts_again(fresh, tiny_artifact):
    peaks, _, maps = fresh(str(tiny_artifact), 3, False)
    # Every run counts its maps again, in memory the run before freed (the resident set
    # reads ~0 then). What lies above them is transient, and a run may read it or not:
    # freed pages kept by glibc are fast to reuse, and an intermediate can come and go
    # between two reads (seen: 17.3, 26.2 or 28.3 MiB for 16.8 MiB of maps).
    assert min(peaks) >= maps, peaks


def test_allocated_bytes_sees_an_allocation_and_its_release():
    before = allocated_bytes()
    block = np.ones(16 * MIB // 8)
    during = allocated_bytes()
    del block
    after = allocated_bytes()
    assert during - before >= 16 * MIB > after - before
