"""`attnserve memory-profile` on the tiny model: the table, the CSV/JSON/PNG, per-graph
fits of memory and time saved in memory_model.json under provider/precision/graph and
loaded by the server's loaders; peaks that hold what the graphs keep alive; a second run
that counts the same bytes. The fit itself on rows of known coefficients. And
memory_model.json's formats: format 1 (one model), format 2 (keyed), a provider it has no
fit for, entries without a time model, a damaged file."""

import csv
import json
import re
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np
import pytest

from attnserve.artifact import MEMORY_MODEL, load_artifact
from attnserve.server.memory.batch_time import TIME, TimeModel, load_time_model
from attnserve.server.memory.fit import BATCH_TIME, PEAK, fit_with_holdout
from attnserve.server.memory.model import (
    ATTENTION,
    EMBEDDINGS,
    MemoryModel,
    load_memory_model,
    model_key,
    save_entries,
)
from tests.conftest import without_module
from tests.harness import ATTNSERVE, REPO

SEQ_LENS = (16, 32, 64, 128)
BATCHES = (8, 32)
CPU = "CPUExecutionProvider"


def profile(artifact, out, *extra) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(artifact), "--out", str(out),
         "--seq-lens", ",".join(map(str, SEQ_LENS)), "--batch-sizes", ",".join(map(str, BATCHES)),
         "--attention", "--device", "cpu", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def profiled(tiny_artifact, tmp_path_factory):
    # A copy: memory_model.json must not change what other tests' servers predict.
    artifact = tmp_path_factory.mktemp("profile-artifact")
    shutil.copytree(tiny_artifact, artifact, dirs_exist_ok=True)
    out = tmp_path_factory.mktemp("profile-out")
    first = profile(artifact, out)
    report = json.loads((out / "memory_profile.json").read_text())
    second = profile(artifact, out, "--no-save-model")
    return load_artifact(artifact), out, first.stdout, report, second.stdout


def test_table_files_and_fit(profiled):
    artifact, out, stdout, report, _ = profiled
    manifest = artifact.manifest
    shapes = ({(EMBEDDINGS, b, s) for b in BATCHES for s in SEQ_LENS}
              | {(ATTENTION, b, s) for b in BATCHES for s in SEQ_LENS})
    printed = set(re.findall(r"^\s*(embeddings|attention)\s+\d+\s+(\d+)\s+(\d+)\s", stdout, re.MULTILINE))
    assert {(g, int(b), int(s)) for g, b, s in printed} == shapes, stdout
    assert "held-out error" in stdout and "fit, embeddings graph" in stdout
    assert "fit, attention graph" in stdout and "memray" in stdout
    assert "time fit, embeddings graph" in stdout and "time fit, attention graph" in stdout
    assert "time held-out error" in stdout and "time in-sample error" in stdout
    with (out / "memory_profile.csv").open() as stream:
        table = list(csv.DictReader(stream))
    assert len(table) == len(shapes)
    assert {"graph", "batch", "seq", "returned_layers", "peak_bytes", "predicted_bytes",
            "batch_seconds", "predicted_seconds"} <= set(table[0])
    # Each shape's time: the median of the default three timed runs.
    for r in report["rows"]:
        assert len(r["batch_runs"]) == 3 and r["batch_seconds"] == np.median(r["batch_runs"]) > 0
    assert report["fit"]["time"]["holdout"]["train_shapes"] > 0
    assert report["provider"] == CPU
    returned = {r["returned_layers"] for r in report["rows"] if r["graph"] == ATTENTION}
    assert returned == {1, manifest.num_layers}
    holdout = report["fit"]["holdout"]
    assert holdout is not None and set(holdout["by_graph"]) == {EMBEDDINGS, ATTENTION}
    assert (out / "memory_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((artifact.directory / MEMORY_MODEL).read_text())
    assert saved["format_version"] == 2
    assert set(saved["models"]) == {model_key(CPU, "fp32", k) for k in (EMBEDDINGS, ATTENTION)}
    models = load_memory_model(artifact.directory, manifest, CPU, "fp32")
    times = load_time_model(artifact.directory, manifest, CPU, "fp32")
    for kind in (EMBEDDINGS, ATTENTION):
        entry = report["fit"]["models"][model_key(CPU, "fp32", kind)]
        model = models.for_graph(kind)
        assert model.source.startswith(f"fitted on {CPU} fp32")
        assert [model.a, model.b, model.c, model.d] == [entry[c] for c in "abcd"]
        assert min(min(phase) for phase in model.phases) >= 0
        time_model = times.for_graph(kind)
        assert isinstance(time_model, TimeModel) and time_model.source == model.source
        assert [time_model.a, time_model.b, time_model.c, time_model.d] == [entry[TIME][c] for c in "abcd"]
        assert time_model.other_phases == () and min(time_model.phases[0]) >= 0
        assert entry[TIME]["runs"] == 3


def test_peaks_hold_what_the_graphs_keep_and_the_fit_follows_them(profiled):
    artifact, _, _, report, _ = profiled
    manifest = artifact.manifest
    heads, layers = manifest.num_heads, manifest.num_layers
    rows = report["rows"]
    for r in rows:
        scores = r["batch"] * heads * r["seq"] ** 2 * 4
        if r["graph"] == ATTENTION:
            # Every layer's probabilities are graph outputs: held to the end of the run
            # however many the request gets back.
            assert r["peak_bytes"] >= layers * scores, r
        # Each token's hidden state comes back as float32 at least.
        assert r["peak_bytes"] >= r["batch"] * r["seq"] * manifest.hidden_size * 4, r
    embeddings = {(r["batch"], r["seq"]): r["peak_bytes"] for r in rows if r["graph"] == EMBEDDINGS}
    for batch in BATCHES:
        growth = [embeddings[(batch, s)] for s in SEQ_LENS]
        assert growth == sorted(growth), growth
    models = load_memory_model(artifact.directory, manifest, CPU, "fp32")
    for r in rows:
        if r["peak_bytes"] >= 1 << 20:
            predicted = models.predict(r["batch"], r["seq"], heads, r["returned_layers"])
            assert abs(predicted - r["peak_bytes"]) <= 0.15 * r["peak_bytes"], (r, predicted)


def test_a_second_run_counts_the_same_bytes(profiled):
    _, _, _, first, stdout = profiled
    again = re.search(r"against the previous run .*\((\d+) shapes\): per-shape change mean "
                      r"([\d.]+)%, max ([\d.]+)%", stdout)
    assert again, stdout
    assert int(again.group(1)) == len(first["rows"])
    assert float(again.group(3)) <= 5.0, stdout


def test_without_matplotlib_the_figures_are_written_and_the_png_explained(tiny_artifact, tmp_path):
    """The `plot` extra is optional: without matplotlib the CSV and JSON still come, and the
    log says how to get the PNG."""
    out = tmp_path / "out"
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(tiny_artifact), "--out", str(out),
         "--seq-lens", "16,32", "--batch-sizes", "1", "--device", "cpu", "--repeats", "1",
         "--no-save-model"],
        cwd=REPO, env=without_module(tmp_path / "hidden", "matplotlib"), capture_output=True,
        text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["memory_profile.csv", "memory_profile.json"]
    assert len(json.loads((out / "memory_profile.json").read_text())["rows"]) == 2
    assert "event=plot_skipped" in done.stderr and "pip install 'attnserve[plot]'" in done.stderr


def test_without_memray_the_cpu_profile_says_how_to_get_it(tiny_artifact, tmp_path):
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(tiny_artifact), "--out", str(tmp_path),
         "--seq-lens", "16", "--batch-sizes", "1", "--device", "cpu", "--no-save-model"],
        cwd=REPO, env=without_module(tmp_path / "hidden", "memray"), capture_output=True,
        text=True, timeout=120, check=False)
    assert done.returncode == 2 and "pip install 'attnserve[profile]'" in done.stderr, done.stderr


# --- the fit ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    graph: str
    batch: int
    seq: int
    returned_layers: int
    peak_bytes: float
    batch_seconds: float


def test_the_fit_recovers_known_coefficients():
    """Rows made from known coefficients, a per-row wobble of ±1 % on top: the time fit (one
    phase) and the memory fit recover each graph's coefficients, and score the held-out
    rows within the wobble."""
    heads = 4
    known = {EMBEDDINGS: (2e-3, 4e-6, 3e-9, 0.0), ATTENTION: (2e-3, 4e-6, 5e-9, 2e-9)}
    rng = np.random.default_rng(0)
    rows = []
    for graph, (a, b, c, d) in known.items():
        for i, batch in enumerate((1, 4, 16, 32)):
            for j, seq in enumerate((16, 32, 64, 128, 256)):
                maps = (heads if (i + j) % 2 else 1) if graph == ATTENTION else 0
                quadratic = batch * heads * seq * seq
                exact = a + b * batch * seq + c * quadratic + d * quadratic * maps
                wobble = 1 + rng.uniform(-0.01, 0.01)
                rows.append(Row(graph, batch, seq, maps, exact * wobble * 1e9, exact * wobble))
    for target, scale in ((BATCH_TIME, 1.0), (PEAK, 1e9)):
        result = fit_with_holdout(rows, heads, 3, target)
        for graph, coefficients in known.items():
            (phase,) = result["fits"][graph]
            np.testing.assert_allclose(phase, np.array(coefficients) * scale, rtol=0.05,
                                       atol=1e-12 * scale)
        assert result["holdout"]["max_rel_error"] < 0.03, result["holdout"]


# --- memory_model.json ----------------------------------------------------------------


def test_a_single_model_file_serves_both_graphs(tiny_artifact, tmp_path):
    manifest = load_artifact(tiny_artifact).manifest
    MemoryModel(a=1000.0, b=2.0, c=0.0, d=0.0, source="written by hand").save(tmp_path)
    models = load_memory_model(tmp_path, manifest, "CUDAExecutionProvider", "fp16")
    assert models.source == "written by hand"
    assert models.predict(2, 10, 4, 0) == models.predict(2, 10, 4, 3) == 1040.0


def test_keyed_models_by_provider_precision_and_graph(tiny_artifact, tmp_path):
    manifest = load_artifact(tiny_artifact).manifest
    embeddings = MemoryModel(10.0, 1.0, 0.0, 0.0, "cpu embeddings", other_phases=((0.0, 0.5, 4.0, 0.0),))
    attention = MemoryModel(20.0, 1.0, 8.0, 4.0, "cpu attention")
    save_entries(tmp_path, {model_key(CPU, "fp32", EMBEDDINGS): embeddings.entry(),
                            model_key(CPU, "fp32", ATTENTION): attention.entry()})
    # A later fit on another provider keeps these.
    save_entries(tmp_path, {model_key("CUDAExecutionProvider", "fp16", EMBEDDINGS):
                            MemoryModel(1.0, 0.0, 0.0, 0.0, "cuda").entry()})
    models = load_memory_model(tmp_path, manifest, CPU, "fp32")
    assert (models.embeddings, models.attention) == (embeddings, attention)
    # The larger phase counts: at 100 tokens the scores term takes over.
    assert models.predict(1, 1, 1, 0) == 11.0
    assert models.predict(1, 100, 1, 0) == 0.5 * 100 + 4.0 * 100 ** 2
    assert models.predict(1, 2, 1, 3) == 20.0 + 2 + 8.0 * 4 + 4.0 * 4 * 3
    cuda = load_memory_model(tmp_path, manifest, "CUDAExecutionProvider", "fp16")
    assert cuda.embeddings.source == "cuda"
    assert cuda.attention.source.startswith("analytic bound (memory_model.json has no "
                                            "CUDAExecutionProvider/fp16 fit)")


def test_time_models_load_from_format_2_entries_that_hold_them(tiny_artifact, tmp_path):
    """An entry's "time" is its graph's time model; a file without one for every graph the
    server runs (format 1, entries from before the time model) has none, and the server
    measures batch times instead; a damaged time model is refused."""
    manifest = load_artifact(tiny_artifact).manifest
    memory = MemoryModel(1.0, 1.0, 0.0, 0.0, "cpu").entry()
    times = {EMBEDDINGS: TimeModel(1e-3, 2e-6, 0.0, 0.0, "cpu embeddings"),
             ATTENTION: TimeModel(1e-3, 2e-6, 1e-9, 1e-9, "cpu attention")}
    MemoryModel(1.0, 1.0, 0.0, 0.0, "format 1").save(tmp_path)
    assert load_time_model(tmp_path, manifest, CPU, "fp32") is None
    (tmp_path / MEMORY_MODEL).unlink()
    save_entries(tmp_path, {model_key(CPU, "fp32", EMBEDDINGS): memory | {TIME: times[EMBEDDINGS].entry()},
                            model_key(CPU, "fp32", ATTENTION): memory})
    assert load_time_model(tmp_path, manifest, CPU, "fp32") is None
    save_entries(tmp_path, {model_key(CPU, "fp32", ATTENTION): memory | {TIME: times[ATTENTION].entry()}})
    loaded = load_time_model(tmp_path, manifest, CPU, "fp32")
    assert (loaded.embeddings, loaded.attention) == (times[EMBEDDINGS], times[ATTENTION])
    assert loaded.predict(2, 10, 4, 0) == pytest.approx(1e-3 + 2e-6 * 20)
    assert loaded.predict(2, 10, 4, 1) == pytest.approx(1e-3 + 2e-6 * 20 + 2e-9 * 800)
    assert load_time_model(tmp_path, manifest, "CUDAExecutionProvider", "fp16") is None
    save_entries(tmp_path, {model_key(CPU, "fp32", ATTENTION): memory | {TIME: {"a": -1.0}}})
    with pytest.raises(ValueError, match="attention: time: entry lacks b, c, d, source"):
        load_time_model(tmp_path, manifest, CPU, "fp32")


@pytest.mark.parametrize("text", ['{"a": "lots"}', '{"format_version": 2, "models": {"x": {"a": -1}}}',
                                  '{"format_version": 3, "models": {}}', "[1, 2]", "not json"])
def test_a_damaged_file_is_refused(tiny_artifact, tmp_path, text):
    manifest = load_artifact(tiny_artifact).manifest
    (tmp_path / MEMORY_MODEL).write_text(text)
    with pytest.raises((ValueError, TypeError)):
        load_memory_model(tmp_path, manifest)


# --- a reranker and a classifier ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["reranker", "classifier"])
def test_a_scorers_scores_graph_is_profiled_fitted_and_served_with(kind, request, tmp_path):
    """One graph, the scores graph (a reranker's on pairs of both segments); its fit saved
    under provider/precision/scores, loaded for the model's batches, and named by the server
    that serves it. --attention is for embedders."""
    from tests.server.reliability import serve

    source = (request.getfixturevalue("bert_reranker_artifact") if kind == "reranker"
              else request.getfixturevalue("multi_label_classifier")[1].directory)
    artifact = tmp_path / kind
    shutil.copytree(source, artifact)
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(artifact), "--out", str(tmp_path / "out"),
         "--seq-lens", "16,32,64,128", "--batch-sizes", "1,8", "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = set(re.findall(r"^\s*(\w+)\s+\d+\s+(\d+)\s+(\d+)\s", done.stdout, re.MULTILINE))
    assert {(g, int(b), int(s)) for g, b, s in printed} == {
        ("scores", b, s) for b in (1, 8) for s in (16, 32, 64, 128)}, done.stdout
    entries = json.loads((artifact / MEMORY_MODEL).read_text())["models"]
    assert list(entries) == [model_key(CPU, "fp32", "scores")]
    manifest = load_artifact(artifact).manifest
    models = load_memory_model(artifact, manifest, CPU, "fp32")
    assert models.embeddings == models.attention
    assert models.embeddings.source.startswith(f"fitted on {CPU} fp32 (reranker_opt.onnx)")
    # The fit grows with the batch and the length, as the peaks do.
    assert models.predict(8, 128, manifest.num_heads, 0) > models.predict(1, 16, manifest.num_heads, 0)
    with serve(artifact) as server:
        assert f"fitted on {CPU} fp32 (reranker_opt.onnx)" in server.output()
    refused = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(artifact), "--attention", "--device", "cpu",
         "--out", str(tmp_path / "again")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and f"a {kind} has no attention graph" in refused.stderr
