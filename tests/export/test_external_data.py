"""A graph past ONNX's 2 GB protobuf limit keeps its weights in an external data file
beside it. Tested on the tiny Qwen3 artifact exported with the threshold lowered to
nothing (conftest's EXTERNAL_DATA_FAMILY), so that every graph goes that way: traced,
fused by onnxruntime's optimiser, quantized, verified; each data file listed, hashed and
checked like the graph, and a damaged or missing one refused naming it."""

import json
import shutil

import onnx
import pytest

from attnserve.artifact import MANIFEST, ArtifactError, load_artifact
from tests.conftest import EXTERNAL_DATA_FAMILY


@pytest.fixture(scope="module")
def artifact(sentence_artifact):
    return sentence_artifact(EXTERNAL_DATA_FAMILY)[1]


def test_every_graph_keeps_its_weights_in_a_listed_hashed_file(artifact):
    m = artifact.manifest
    assert {g.file for g in m.graphs} == {"encoder.onnx", "encoder_attn.onnx", "encoder_opt.onnx",
                                          "encoder_int8.onnx", "encoder_attn_int8.onnx"}
    for graph in m.graphs:
        assert graph.external_data == f"{graph.file}.data"
        assert set(graph.files) <= set(m.files)
        model = onnx.load(artifact.path(graph.file), load_external_data=False)
        large = [t for t in model.graph.initializer if t.ByteSize() > 4096 or
                 t.data_location == onnx.TensorProto.EXTERNAL]
        assert large and all(t.data_location == onnx.TensorProto.EXTERNAL for t in large)
        modes = {artifact.path(name).stat().st_mode & 0o777 for name in graph.files}
        assert len(modes) == 1, (graph.file, modes)  # readable by whoever reads the graph
    assert not list(artifact.directory.glob(".scratch-*"))  # nothing left behind


def test_the_optimiser_and_the_quantizer_went_through_them(artifact):
    opt = onnx.load(artifact.path("encoder_opt.onnx"))
    assert "SimplifiedLayerNormalization" in {n.op_type for n in opt.graph.node}
    int8 = onnx.load(artifact.path("encoder_int8.onnx"))
    assert "MatMulInteger" in {n.op_type for n in int8.graph.node}


def _copy(artifact, target):
    return shutil.copytree(artifact.directory, target)


def test_a_damaged_data_file_is_refused_naming_it(artifact, tmp_path):
    copy = _copy(artifact, tmp_path / "damaged")
    data = copy / "encoder_attn.onnx.data"
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))
    with pytest.raises(ArtifactError, match=rf"{data}: sha256 .* does not match the manifest's"):
        load_artifact(copy)


def test_a_missing_data_file_is_refused_naming_it(artifact, tmp_path):
    copy = _copy(artifact, tmp_path / "missing")
    (copy / "encoder_int8.onnx.data").unlink()
    with pytest.raises(ArtifactError, match=rf"{copy / 'encoder_int8.onnx.data'}: missing "
                                            rf"\(listed in manifest.json\)"):
        load_artifact(copy)


def test_a_data_file_without_its_hash_is_refused(artifact, tmp_path):
    copy = _copy(artifact, tmp_path / "unhashed")
    manifest = json.loads((copy / MANIFEST).read_text())
    del manifest["files"]["encoder.onnx.data"]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"manifest\.json: no sha256 for encoder\.onnx\.data$"):
        load_artifact(copy)
