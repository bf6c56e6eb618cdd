"""`attnserve memory-profile` on the tiny model: the table, the CSV/JSON/PNG, a fitted
memory_model.json the server can load; and on the CPU, measured memory that grows with
seq_len in the direction and order of magnitude the memory model predicts. (The exact
figures belong to the benchmark, not to this test.)"""

import csv
import json
import re
import shutil
import subprocess

import pytest

from attnserve.artifact import load_artifact
from attnserve.server.memory_model import analytic_bound, load_memory_model
from tests.conftest import ATTNSERVE, REPO

SEQ_LENS = (16, 64, 128)
BATCH = 32


@pytest.fixture(scope="module")
def profiled(tiny_artifact, tmp_path_factory):
    # A copy: memory_model.json must not change what other tests' servers predict.
    artifact = tmp_path_factory.mktemp("profile-artifact")
    shutil.copytree(tiny_artifact, artifact, dirs_exist_ok=True)
    out = tmp_path_factory.mktemp("profile-out")
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(artifact), "--out", str(out),
         "--seq-lens", ",".join(map(str, SEQ_LENS)), "--batch-sizes", str(BATCH),
         "--attention", "--device", "cpu", "--repeats", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return load_artifact(artifact), out, done.stdout


def rows_of(out) -> list[dict]:
    return json.loads((out / "memory_profile.json").read_text())["rows"]


def peak(rows: list[dict], seq: int, attention: bool) -> int:
    (row,) = [r for r in rows if r["seq"] == seq and r["attention"] == attention]
    return row["peak_bytes"]


def test_table_files_and_fit(profiled):
    artifact, out, stdout = profiled
    shapes = {(a, s) for a in ("none", "all") for s in SEQ_LENS}
    printed = set(re.findall(rf"^\s+(none|all)\s+{BATCH}\s+(\d+)\s", stdout, re.MULTILINE))
    assert {(a, int(s)) for a, s in printed} == shapes, stdout
    assert "peak MiB" in stdout and "held-out error" in stdout and "fit: bytes" in stdout
    with (out / "memory_profile.csv").open() as stream:
        table = list(csv.DictReader(stream))
    assert len(table) == len(shapes)
    assert {"batch", "seq", "attention", "peak_bytes", "predicted_bytes"} <= set(table[0])
    report = json.loads((out / "memory_profile.json").read_text())
    assert report["provider"] == "CPUExecutionProvider"
    assert len(report["rows"]) == len(shapes)
    fit = report["fit"]
    assert fit["holdout"] is not None and fit["holdout"]["shapes"] == 2
    assert fit["d_source"] == "fitted"
    assert (out / "memory_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = load_memory_model(artifact.directory, artifact.manifest)
    assert model.source == "fitted on CPUExecutionProvider"
    assert [model.a, model.b, model.c, model.d] == list(fit["coefficients"].values())
    assert min(model.a, model.b, model.c, model.d) >= 0


def test_memory_grows_with_seq_len_as_predicted(profiled):
    artifact, out, _ = profiled
    manifest = artifact.manifest
    rows = rows_of(out)
    small, large = SEQ_LENS[0], SEQ_LENS[-1]
    measured = peak(rows, large, False) - peak(rows, small, False)
    heads = manifest.num_heads
    prior = analytic_bound(manifest)
    predicted = (prior.predict(BATCH, large, heads, 0) - prior.predict(BATCH, small, heads, 0))
    assert measured > 0, f"peak did not grow from seq {small} to {large}: {rows}"
    assert predicted / 10 < measured < predicted * 10, (
        f"growth from seq {small} to {large}: measured {measured} bytes, the analytic "
        f"model predicts {predicted:.0f}")
    # The returned maps are alive when the run ends, so the peak holds them at least.
    maps = manifest.num_layers * BATCH * heads * large * large * 4
    assert peak(rows, large, True) >= 0.9 * maps, (peak(rows, large, True), maps)
    # And the fit saved beside the artifact puts the largest shape within an order of
    # magnitude of what was measured.
    fitted = load_memory_model(artifact.directory, manifest)
    for attention in (False, True):
        got = peak(rows, large, attention)
        want = fitted.predict(BATCH, large, heads, manifest.num_layers if attention else 0)
        assert got / 10 < want < got * 10, (attention, got, want)
