"""`attnserve export --int8`: quantized graphs listed in the manifest with their parity, the
parity gate that refuses a graph below it, and manifests of the previous format still read."""

import json
import shutil
import subprocess

import onnx
import pytest

from attnserve.artifact import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZER,
    ArtifactError,
    attention_output,
    load_artifact,
)
from attnserve.export.quantize import pooled_cosines
from tests.conftest import export
from tests.harness import ATTNSERVE, REPO, make_tiny_checkpoint


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """A tiny random BERT whose weights are large enough (initializer_range 0.5) that int8
    loses a measurable amount (worst pooled cosine about 0.997 against fp32), so the gate
    has something to catch."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8-checkpoint"), initializer_range=0.5)


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory, wide_checkpoint):
    return load_artifact(export(tmp_path_factory.mktemp("int8-artifact"), wide_checkpoint, "--int8"))


def _ops(artifact, file: str) -> set[str]:
    return {node.op_type for node in onnx.load(artifact.path(file)).graph.node}


def test_int8_graphs_are_listed_with_their_parity(int8_artifact):
    manifest = int8_artifact.manifest
    assert manifest.format_version == FORMAT_VERSION
    embed = manifest.graph(attention=False, precision="int8")
    attend = manifest.graph(attention=True, precision="int8")
    assert (embed.file, attend.file) == ("encoder_int8.onnx", "encoder_attn_int8.onnx")
    assert {embed.file, attend.file} <= set(manifest.files)
    for graph, reference in ((embed, "encoder_opt.onnx"), (attend, "encoder_attn.onnx")):
        parity = graph.parity
        assert parity.reference == reference
        assert parity.texts >= 50 and parity.min_cosine == 0.99
        assert 0.99 <= parity.pooled_cosine_min <= parity.pooled_cosine_mean < 1
    assert attend.outputs[-1] == attention_output(manifest.num_layers - 1)
    assert all(g.parity is None for g in manifest.graphs if g.precision == "fp32")


def test_recorded_parity_is_what_the_graphs_give(int8_artifact):
    manifest = int8_artifact.manifest
    graph = manifest.graph(attention=False, precision="int8")
    cosines = pooled_cosines(int8_artifact.path(graph.parity.reference), int8_artifact.path(graph.file),
                             int8_artifact.path(TOKENIZER), manifest.max_positions, manifest.pad_token_id)
    assert len(cosines) == graph.parity.texts
    assert cosines.min() == pytest.approx(graph.parity.pooled_cosine_min, abs=1e-4)


def test_int8_graphs_compute_in_integers_and_keep_the_fused_attention(int8_artifact):
    embed = _ops(int8_artifact, "encoder_int8.onnx")
    assert {"QAttention", "MatMulInteger", "DynamicQuantizeLinear"} <= embed
    assert "Attention" not in embed and "Softmax" not in embed
    # The attention graph keeps its explicit softmax (its probabilities are outputs) and
    # quantizes the projections around it.
    attend = _ops(int8_artifact, "encoder_attn_int8.onnx")
    assert {"MatMulInteger", "Softmax"} <= attend


def test_cpu_sessions_keep_layer_norms_unfused(int8_artifact, tmp_path):
    """onnxruntime's CPU SkipLayerNormalization kernel is 2.5x slower than the Add and the
    LayerNormalization it replaces: the graphs leave them apart, and the server's CPU
    sessions keep onnxruntime from fusing them again at load (at its defaults it does)."""
    import json as json_

    import numpy as np
    import onnxruntime as ort

    from attnserve.server.runtime.onnx import CPU, session_options

    path = str(int8_artifact.path("encoder_int8.onnx"))
    assert "SkipLayerNormalization" not in _ops(int8_artifact, "encoder_int8.onnx")
    assert "SkipLayerNormalization" not in _ops(int8_artifact, "encoder_opt.onnx")
    ran = {}
    for name, options in (("default", ort.SessionOptions()),
                          ("server", session_options(1, CPU, "int8"))):
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / name)
        session = ort.InferenceSession(path, options, providers=[CPU])
        ids = np.full((2, 8), 1000, dtype=np.int64)
        session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        profile = json_.loads(open(session.end_profiling()).read())
        ran[name] = {e["args"]["op_name"] for e in profile
                     if e.get("cat") == "Node" and "op_name" in e.get("args", {})}
    assert "SkipLayerNormalization" in ran["default"]
    assert "SkipLayerNormalization" not in ran["server"] and "LayerNormalization" in ran["server"]


def test_cpu_sessions_multiply_int8_exactly():
    """uint8 activations times int8 weights at their extremes: on an x86 CPU without VNNI
    onnxruntime's fast kernel adds pairs of products in 16 bits (255·127·2 > 32767) and
    saturates, which took MiniLM's int8 pooled cosine from 0.992 to 0.970 on an AVX2 EPYC.
    The server's CPU sessions for int8 graphs, and the export's parity gate with them, get
    the exact sums on every CPU; they ask for onnxruntime's exact arithmetic exactly where
    its default kernel saturates (with VNNI it is exact, and the option would only slow it)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from attnserve.artifact import cpu_session_config
    from attnserve.server.runtime.onnx import CPU, session_options

    depth = 64
    weights = np.full((depth, 2), 127, dtype=np.int8)
    weights[:, 1] = -128
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w"], ["y"])], "extremes",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [None, depth])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [None, 2])],
        [numpy_helper.from_array(weights, "w")])
    # IR 8: what onnxruntime reads, whichever onnx release wrote the model.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.full((4, depth), 255, dtype=np.uint8)
    session = ort.InferenceSession(model.SerializeToString(), session_options(1, CPU, "int8"),
                                   providers=[CPU])
    (y,) = session.run(None, {"x": x})
    exact = x.astype(np.int32) @ weights.astype(np.int32)
    np.testing.assert_array_equal(y, exact)
    (default,) = ort.InferenceSession(model.SerializeToString(), providers=[CPU]).run(None, {"x": x})
    exact_asked = "session.x64quantprecision" in cpu_session_config("int8")
    assert exact_asked == (not np.array_equal(default, exact))


def test_parity_gate_refuses_the_export_loudly(tmp_path, wide_checkpoint):
    out = tmp_path / "refused"
    result = subprocess.run(
        [*ATTNSERVE, "export", "--out", str(out), "--from", str(wide_checkpoint), "--int8",
         "--int8-min-cosine", "0.9999"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr
    assert "encoder_int8.onnx: mean-pooled cosine against encoder_opt.onnx is 0.99" in result.stderr
    assert "below the required 0.9999" in result.stderr
    assert not (out / MANIFEST).exists() and not (out / "encoder_int8.onnx").exists()
    with pytest.raises(ArtifactError, match="missing"):
        load_artifact(out)


def _copy_with_manifest(int8_artifact, target, edit) -> None:
    shutil.copytree(int8_artifact.directory, target)
    data = json.loads((target / MANIFEST).read_text())
    edit(data)
    (target / MANIFEST).write_text(json.dumps(data))


def test_a_format_1_manifest_still_loads(tmp_path, int8_artifact):
    def as_format_1(data):
        data["format_version"] = 1
        del data["embedding_ranges"]
        data["graphs"] = [g for g in data["graphs"] if g["precision"] != "int8"]
        for graph in data["graphs"]:
            del graph["parity"]

    _copy_with_manifest(int8_artifact, tmp_path / "v1", as_format_1)
    manifest = load_artifact(tmp_path / "v1").manifest
    assert manifest.format_version == 1
    assert manifest.graph(attention=False, precision="int8") is None
    assert manifest.graph(attention=False, precision="fp32").parity is None
    assert manifest.embedding_ranges is None


def test_a_newer_format_is_refused_by_name(tmp_path, int8_artifact):
    newer = FORMAT_VERSION + 1
    _copy_with_manifest(int8_artifact, tmp_path / "newer", lambda data: data.update(format_version=newer))
    with pytest.raises(ArtifactError, match=rf"format_version {newer}, this server reads 1 and 2 and 3 "
                                            rf"and 4 and 5$"):
        load_artifact(tmp_path / "newer")


def test_smoothing_and_outlier_split_leave_fp32_results_unchanged(int8_artifact, tmp_path):
    """Before quantization both rewrites are exact: only where int8 rounds do they differ."""
    import numpy as np

    from attnserve.export import quantize
    from attnserve.export.verify import session

    original = int8_artifact.path("encoder_opt.onnx")
    rewritten = onnx.load(original)  # the rewrites work in place
    rows = quantize.encode_texts(int8_artifact.path(TOKENIZER), quantize.CALIBRATION_TEXTS[:6],
                                 int8_artifact.manifest.max_positions)
    feeds = list(quantize._feeds(rows, 3, int8_artifact.manifest.pad_token_id))
    inputs = sorted({n.input[0] for n in quantize._sites(rewritten)})
    quantize._smooth(rewritten, quantize._activation_stats(original, inputs, feeds))
    assert sum(n.name.startswith("Smooth_") for n in rewritten.graph.node) >= 2
    sites = quantize._sites(rewritten)
    onnx.save(rewritten, tmp_path / "smoothed.onnx")
    stats = quantize._activation_stats(tmp_path / "smoothed.onnx",
                                       sorted({n.input[0] for n in sites}), feeds)
    matmuls = [n.name for n in sites if n.op_type == "MatMul"]
    split, fp32 = quantize._split_outliers(rewritten, {name: np.array([0, 3]) for name in matmuls},
                                           stats)
    assert len(fp32) == len(matmuls)
    onnx.save(split, tmp_path / "split.onnx")
    before, after = session(original), session(tmp_path / "split.onnx")
    for feed in feeds:
        (expected,), (got,) = before.run(["last_hidden_state"], feed), after.run(["last_hidden_state"], feed)
        np.testing.assert_allclose(got, expected, atol=1e-4)
