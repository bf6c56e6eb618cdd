"""The figure admission and the dashboard are judged by: the server's per-batch peak
(MemoryProbe, on the CPU) counts what a batch allocates, the quantity `attnserve
memory-profile` measures with memray and fits the memory model to; and it counts it
again when the batch reuses memory an earlier one freed, which the resident set does
not show."""

import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from attnserve.artifact import load_artifact
from attnserve.server.memory import MemoryProbe, allocated_bytes
from attnserve.server.ort_backend import session_options

MIB = 1 << 20
BATCH, SEQ = 32, 128


@pytest.fixture(scope="module")
def attention_session(tiny_artifact):
    """The tiny model's attention graph, with the server's session options."""
    artifact = load_artifact(tiny_artifact)
    graph = artifact.manifest.graph(attention=True, precision="fp32")
    session = ort.InferenceSession(str(artifact.path(graph.file)), session_options(1),
                                   providers=["CPUExecutionProvider"])
    layers = artifact.manifest.num_layers
    names = ["last_hidden_state"] + [f"attentions.{i}" for i in range(layers)]
    ids = np.random.default_rng(0).integers(1000, 20000, size=(BATCH, SEQ), dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    session.run(names, feed)  # kernels and thread pool made before anything is counted
    maps = layers * BATCH * artifact.manifest.num_heads * SEQ * SEQ * 4
    return lambda: session.run(names, feed), maps


def test_probe_counts_what_memray_counts(attention_session):
    import memray

    run, maps = attention_session
    probe = MemoryProbe(cuda=False)
    assert probe.sampler is not None, probe.method
    with tempfile.TemporaryDirectory() as scratch:
        capture = Path(scratch) / "run.bin"
        with memray.Tracker(capture, native_traces=False, trace_python_allocators=False):
            out = run()
            del out
        with memray.FileReader(capture) as reader:
            counted = reader.metadata.peak_memory
    peaks = []
    for _ in range(3):  # the probe's count is the process's: the median of three
        baseline = probe.start_batch()
        out = run()
        peaks.append(probe.batch_peak(baseline))
        del out
    peak = sorted(peaks)[1]
    # The run's outputs (every layer's maps) are alive when it ends, so both counts
    # hold them at least.
    assert counted >= maps and peak >= maps, (counted, peaks, maps)
    # memray also counts the interpreter's own small allocations of the call.
    assert abs(peak - counted) <= 0.03 * counted + 0.5 * MIB, ([p / MIB for p in peaks], counted / MIB)


def test_memory_freed_and_reused_counts_again(attention_session):
    run, maps = attention_session
    probe = MemoryProbe(cuda=False)
    peaks = []
    for _ in range(3):
        baseline = probe.start_batch()
        out = run()
        peaks.append(probe.batch_peak(baseline))
        del out
    assert min(peaks) >= maps, peaks
    # Every run counts its maps again; a transient peak under the sampler's millisecond
    # (here one intermediate of 2 MiB, once in a few runs) may be missed.
    assert max(peaks) - min(peaks) <= 0.03 * max(peaks) + 2.5 * MIB, peaks


def test_allocated_bytes_sees_an_allocation_and_its_release():
    before = allocated_bytes()
    block = np.ones(16 * MIB // 8)
    during = allocated_bytes()
    del block
    after = allocated_bytes()
    assert during - before >= 16 * MIB > after - before
