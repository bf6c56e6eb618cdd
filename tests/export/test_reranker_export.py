"""`attnserve export` on small random sequence classifiers of every family: the artifact
is a reranker (its kind, its labels, BERT's token types as a third input), its one scores
graph keeps dynamic axes, its float32 graphs match transformers' logits within 1e-4 on
padded batches of real (query, text) pairs, and one label's sigmoid sentence-transformers'
CrossEncoder.predict; the float16 graph is written and stays near; the int8 graph passes
its gate on scores, or the export is refused naming it."""

import subprocess

import numpy as np
import onnxruntime as ort
import pytest
import torch

from attnserve.artifact import (
    CLASSIFIER,
    LOGITS_OUTPUT,
    MANIFEST,
    RERANKER,
    TOKEN_TYPES,
    load_artifact,
    read_manifest,
)
from attnserve.export.quantize import INT8_MAX_SCORE_ERROR
from tests.conftest import export
from tests.export.test_export import dims
from tests.families import RERANKER_FAMILIES, make_reranker
from tests.harness import ATTNSERVE, REPO

FP32_ATOL = 1e-4
FP16_ATOL = 2e-2
QUERY = "where does the cat sleep?"
TEXTS = ["Le chat dort sur le canapé pendant que la pluie tombe doucement.", "ok",
         "The quick brown fox jumps over the lazy dog. " * 2, "服务 A 调用了配置中心 B。",
         "Self-attention lets every token look at every other token in the sequence."]


@pytest.fixture(scope="module", params=RERANKER_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, family):
    return make_reranker(family, tmp_path_factory.mktemp(f"{family}-reranker"), num_labels=1)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, family, checkpoint):
    return load_artifact(export(tmp_path_factory.mktemp(f"{family}-reranker-artifact"), checkpoint,
                                "--fp16", "--int8"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(
        str(checkpoint), attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint))


def logits_of(artifact, file: str, feed: dict) -> np.ndarray:
    session = ort.InferenceSession(str(artifact.path(file)), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run([LOGITS_OUTPUT], {name: feed[name] for name in names})[0]


def pairs_feed(tokenizer, texts=TEXTS) -> dict[str, np.ndarray]:
    batch = tokenizer([QUERY] * len(texts), list(texts), padding=True, return_tensors="np")
    return {name: value.astype(np.int64) for name, value in batch.items()}


def test_the_manifest_says_reranker_with_its_labels_and_inputs(artifact, family):
    manifest = artifact.manifest
    assert manifest.kind == RERANKER and manifest.labels == ["label_0"]
    assert manifest.inputs == (["input_ids", "attention_mask", TOKEN_TYPES] if family == "bert"
                               else ["input_ids", "attention_mask"])
    assert manifest.model_type == family
    files = {(g.file, g.precision) for g in manifest.graphs}
    assert {("reranker.onnx", "fp32"), ("reranker_fp16.onnx", "fp16"),
            ("reranker_int8.onnx", "int8")} <= files
    assert all(g.outputs == [LOGITS_OUTPUT] and not g.attention for g in manifest.graphs)
    assert manifest.graph(attention=True, precision="fp32") is None


def test_the_scores_graph_keeps_dynamic_axes(artifact):
    import onnx

    for graph in artifact.manifest.graphs:
        model = onnx.load(artifact.path(graph.file))
        batch, seq = dims(model.graph.input[0])
        assert isinstance(batch, str) and isinstance(seq, str) and batch != seq
        assert all(dims(value) == [batch, seq] for value in model.graph.input), graph.file
        assert [dims(value) for value in model.graph.output] == [[batch, 1]], graph.file


def test_float32_graphs_match_transformers_on_padded_pairs(artifact, reference):
    model, tokenizer = reference
    feed = pairs_feed(tokenizer)
    assert feed["attention_mask"].sum(1).min() < feed["attention_mask"].shape[1]
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).logits.numpy()
    assert expected.std() > 1e-2  # the pairs score apart
    for graph in artifact.manifest.graphs:
        if graph.precision == "fp32":
            np.testing.assert_allclose(logits_of(artifact, graph.file, feed), expected,
                                       atol=FP32_ATOL, err_msg=graph.file)
    np.testing.assert_allclose(logits_of(artifact, "reranker_fp16.onnx", feed), expected,
                               atol=FP16_ATOL)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"], indirect=True)
def test_sigmoid_of_the_graph_matches_sentence_transformers(artifact, checkpoint):
    from sentence_transformers import CrossEncoder

    st = CrossEncoder(str(checkpoint), device="cpu")
    expected = st.predict([(QUERY, text) for text in TEXTS])
    logits = logits_of(artifact, artifact.manifest.graph(attention=False, precision="fp32").file,
                       pairs_feed(st.tokenizer))
    np.testing.assert_allclose(1 / (1 + np.exp(-logits[:, 0])), expected, atol=FP32_ATOL)


def test_the_int8_graph_passes_its_gate_on_scores(artifact):
    graph = artifact.manifest.graph(attention=False, precision="int8")
    parity = graph.parity
    assert parity.pairs >= 50 and parity.max_error == INT8_MAX_SCORE_ERROR
    assert 0 < parity.score_error_max <= INT8_MAX_SCORE_ERROR


@pytest.mark.parametrize("family", ["bert"], indirect=True)
def test_the_int8_gate_refuses_above_its_score_error(tmp_path, checkpoint):
    out = tmp_path / "refused"
    result = subprocess.run([*ATTNSERVE, "export", "--out", str(out), "--from", str(checkpoint),
                             "--int8", "--int8-max-score-error", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "reranker_int8.onnx: scores differ from reranker_opt.onnx's by up to 0.0" in result.stderr
    assert not (out / MANIFEST).exists() and not (out / "reranker_int8.onnx").exists()


def test_several_labels_export_with_their_names(tmp_path):
    """A sequence classifier of several labels exports as a classifier, unless told it is a
    reranker."""
    directory = make_reranker("xlm-roberta", tmp_path / "three", num_labels=3)
    manifest = read_manifest(export(tmp_path / "three-artifact", directory))
    assert (manifest.kind, manifest.labels) == (CLASSIFIER, ["label_0", "label_1", "label_2"])
    manifest = load_artifact(export(tmp_path / "three-reranker", directory, "--kind",
                                    "reranker")).manifest
    assert (manifest.kind, manifest.labels) == (RERANKER, ["label_0", "label_1", "label_2"])
