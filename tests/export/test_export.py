"""The exported artifact: verified graphs, dynamic axes, parity with PyTorch, hashes."""

import json

import onnx
import pytest

from attnserve.artifact import ArtifactError, load_artifact
from attnserve.export.verify import max_abs_error
from attnserve.model import load_checkpoint
from tests.conftest import export


@pytest.fixture(scope="module")
def minilm(minilm_artifact):
    return load_artifact(minilm_artifact)


def test_manifest_describes_minilm(minilm):
    m = minilm.manifest
    assert (m.model_name, m.num_layers, m.num_heads, m.hidden_size) == ("all-MiniLM-L6-v2", 6, 12, 384)
    assert (m.max_positions, m.vocab_size, m.default_pooling, m.opset) == (512, 30522, "mean", 17)
    files = {g.file for g in m.graphs}
    assert {"encoder.onnx", "encoder_attn.onnx", "encoder_opt.onnx"} <= files
    assert set(m.files) == files | {"tokenizer.json"}
    attn = m.graph(attention=True, precision="fp32")
    assert attn.outputs == ["last_hidden_state"] + [f"attentions.{i}" for i in range(6)]


def test_graphs_have_dynamic_batch_and_sequence_axes(minilm):
    for graph in minilm.manifest.graphs:
        model = onnx.load(minilm.path(graph.file), load_external_data=False)
        for value in list(model.graph.input) + list(model.graph.output):
            dims = value.type.tensor_type.shape.dim
            assert dims[0].dim_param and not dims[0].dim_value, (graph.file, value.name)
            assert all(d.dim_param for d in dims if d.dim_param or not d.dim_value), value.name


def test_optimised_graph_fuses_every_attention_block(minilm):
    model = onnx.load(minilm.path("encoder_opt.onnx"))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Attention") == 6
    assert "Softmax" not in ops


@pytest.mark.parametrize("file", ["encoder.onnx", "encoder_opt.onnx", "encoder_attn.onnx"])
def test_onnx_matches_pytorch_at_untraced_shapes(minilm, file):
    graph = next(g for g in minilm.manifest.graphs if g.file == file)
    error = max_abs_error(minilm.path(file), load_checkpoint(), graph.outputs)
    assert error <= 1e-4
    assert graph.max_abs_error <= 1e-4


def test_manifest_hashes_catch_a_changed_file(tmp_path, tiny_artifact):
    copy = tmp_path / "artifact"
    copy.mkdir()
    for path in tiny_artifact.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    load_artifact(copy)
    data = bytearray((copy / "encoder_attn.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "encoder_attn.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"encoder_attn\.onnx: sha256 .* does not match"):
        load_artifact(copy)


def test_fp16_export_stays_within_its_bound(tmp_path, tiny_checkpoint):
    artifact = load_artifact(export(tmp_path / "fp16", tiny_checkpoint, "--fp16"))
    fp16 = [g for g in artifact.manifest.graphs if g.precision == "fp16"]
    assert {g.attention for g in fp16} == {False, True}
    for graph in fp16:
        model = onnx.load(artifact.path(graph.file))
        assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in model.graph.initializer)
        assert graph.max_abs_error <= 5e-2
    manifest = json.loads((artifact.directory / "manifest.json").read_text())
    assert manifest["files"].keys() >= {g.file for g in fp16}


def test_export_of_a_bad_checkpoint_names_the_tensor(tmp_path, tiny_checkpoint):
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for path in tiny_checkpoint.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    tensors.pop("encoder.layer.1.attention.self.value.bias")
    save_file(tensors, bad / "model.safetensors")
    result = subprocess.run([sys.executable, "-m", "attnserve", "export", "--from", str(bad),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode != 0
    assert "layers.1.attention.w_v.bias" in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
