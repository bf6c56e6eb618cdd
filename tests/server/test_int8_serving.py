"""`attnserve serve --precision int8`: the CPU's quantized graphs, served beside fp32 with the
embeddings they promise, and refused with a reason where they cannot be."""

import json
import shutil
import subprocess

import numpy as np
import pytest

from attnserve.client import EncoderClient
from attnserve.export.int8_texts import PARITY_TEXTS
from tests.conftest import export
from tests.harness import ATTNSERVE, REPO, ServerProcess, make_tiny_checkpoint

TEXTS = list(PARITY_TEXTS[::4])


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory):
    # A tiny random BERT with weights large enough (initializer_range 0.5) for int8 to
    # differ measurably from fp32 (MiniLM's int8 export takes over a minute).
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("int8-checkpoint"), initializer_range=0.5)
    return export(tmp_path_factory.mktemp("int8-artifact"), checkpoint, "--int8")


def _pooled(server: ServerProcess) -> tuple[np.ndarray, str]:
    with EncoderClient(server.address) as client:
        results = client.embed(TEXTS, pooling="mean", normalize=True, truncate=True, timeout=60)
        precision = client.model_info().precision
    return np.stack([r.pooled for r in results]), precision


def test_int8_serving_agrees_with_fp32(int8_artifact):
    with ServerProcess(int8_artifact) as fp32_server, \
            ServerProcess(int8_artifact, "--precision", "int8") as int8_server:
        reference, fp32_precision = _pooled(fp32_server)
        quantized, int8_precision = _pooled(int8_server)
        log = int8_server.output()
    assert (fp32_precision, int8_precision) == ("fp32", "int8")
    assert "graphs=encoder_int8.onnx,encoder_attn_int8.onnx" in log
    cosines = (reference * quantized).sum(axis=1)
    assert cosines.min() >= 0.99
    # Not fp32 under another name: the quantized graphs do round.
    assert not np.array_equal(reference, quantized)


def test_int8_without_int8_graphs_is_refused_at_start(tiny_artifact):
    result = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--device", "cpu",
                             "--precision", "int8", "--check-config"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "no int8 graphs (export with --int8)" in result.stderr


def test_memory_profile_fits_the_int8_graphs_and_the_int8_server_uses_the_fit(int8_artifact,
                                                                               tmp_path):
    """Without a fit of its own the int8 server admits on the analytic bound, which is
    far above what its graphs take."""
    artifact = tmp_path / "artifact"
    shutil.copytree(int8_artifact, artifact)
    out = tmp_path / "profile"
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(artifact), "--out", str(out),
         "--seq-lens", "16,64", "--batch-sizes", "1,8", "--attention", "--device", "cpu",
         "--precision", "int8"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "memory_profile.json").read_text())
    assert report["precision"] == "int8"
    assert all(row["peak_bytes"] > 0 for row in report["rows"])
    with ServerProcess(artifact, "--precision", "int8") as server:
        log = server.output()
    assert "fitted on CPUExecutionProvider int8 (encoder_int8.onnx)" in log, log[-2000:]
