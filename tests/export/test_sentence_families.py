"""`attnserve export` of sentence-transformers checkpoints of MPNet, DistilBERT, Qwen3 and
Gemma3 (tests/families.py's SENTENCE_MODULES: their pooling, Dense layers, Normalize and
prompts), each exported once for the session (conftest's sentence_artifact), and of their
sequence classifiers:

- the float32 graphs against transformers at lengths the tracer never saw: hidden states
  and attention maps within 1e-4;
- the vectors, from our PyTorch modules and from every float32 graph, against
  SentenceTransformer.encode, with and without each prompt, the batch padded on the right
  (as the server pads), and Qwen3's on the left too (as its tokenizer pads; the fused
  attention of the encoders' optimised graphs takes right-padded batches only): cosine
  0.99999;
- the Dense layers' own graph after pooling done outside the graph (what the server does
  when it leaves a prompt out or chunks late), against the same;
- the int8 graphs through the export's gate, measured on the model's own pooling;
- Gemma3's float16 graphs, their Dense layers left in float32;
- the classifiers' scores graphs against transformers on padded pairs (Qwen3's padded
  either side)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attnserve.artifact import HIDDEN_OUTPUT, LOGITS_OUTPUT, TOKENIZER, pooled_output
from attnserve.export.onnx_graphs import GraphOutputs
from attnserve.export.quantize import pooled_cosines
from attnserve.model import load_checkpoint
from attnserve.model.sentence_modules import dense_layers, read_module_list
from tests.export.test_export import assert_dynamic_axes, worst_errors
from tests.families import (
    CLASSIFIER_FAMILIES,
    GEMMA3_WINDOW,
    SENTENCE_FAMILIES,
    SENTENCE_MODULES,
)
from tests.hugging_face import HuggingFace

FP32_ATOL = 1e-4
MIN_COSINE = 0.99999
# Short enough that Qwen3's instruction and a text fit its 128 positions; the third
# reaches past Gemma3's window on both sides.
TEXTS = ["Hello world, don't panic!", "ok",
         "The quick brown fox jumps over the lazy dog. Self-attention lets every token look "
         "at every other token.",
         "服务 A 调用了配置中心 B。"]


@pytest.fixture(scope="module", params=SENTENCE_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def exported(sentence_artifact, family):
    return sentence_artifact(family)


@pytest.fixture(scope="module")
def checkpoint(exported):
    return exported[0]


@pytest.fixture(scope="module")
def artifact(exported):
    return exported[1]


@pytest.fixture(scope="module")
def hf(checkpoint):
    return HuggingFace(checkpoint)


@pytest.fixture(scope="module")
def st(checkpoint):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint), device="cpu")


def session(artifact, file: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(artifact.path(file)), providers=["CPUExecutionProvider"])


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def test_the_manifest_carries_the_family_and_its_modules(artifact, family, hf):
    m, spec, config = artifact.manifest, SENTENCE_MODULES[family], hf.model.config
    assert (m.model_type, m.default_pooling, m.normalize) == (family, spec.pooling, spec.normalize)
    assert m.embedding_size == (spec.dense[-1][0] if spec.dense else m.hidden_size)
    assert m.dense_graph == ("dense.onnx" if spec.dense else None)
    # sentence-transformers saves empty query and document prompts where a model has none.
    assert {name: text for name, text in m.prompts.items() if text} == {
        name: text for name, text in spec.prompts.items() if text}
    assert (m.num_heads, m.intermediate_size) == (4, {"mpnet": 64, "distilbert": 64}.get(family, 48))
    assert (m.num_kv_heads, m.head_dim) == ((2, 16) if config.model_type in ("qwen3", "gemma3_text")
                                            else (4, 8))
    assert {g.file for g in m.graphs} >= {"encoder.onnx", "encoder_attn.onnx", "encoder_int8.onnx",
                                          "encoder_attn_int8.onnx"}
    assert set(m.files) == set(m.files_listed)


def test_graphs_have_dynamic_batch_and_sequence_axes(artifact):
    assert_dynamic_axes(artifact)


@pytest.mark.parametrize("file", ["encoder.onnx", "encoder_opt.onnx", "encoder_attn.onnx"])
def test_onnx_matches_transformers_at_untraced_shapes(artifact, hf, file):
    worst_hidden, worst_maps, layers = worst_errors(
        session(artifact, file), hf, np.random.default_rng(2), rows=3, seqs=(1, 2, 17, 60, 128),
        ids_from=(0, len(hf.tokenizer)))
    assert layers == (artifact.manifest.num_layers if file == "encoder_attn.onnx" else 0)
    assert worst_hidden <= FP32_ATOL and worst_maps <= FP32_ATOL, (worst_hidden, worst_maps)


def encoded(hf, texts: list[str], side: str) -> dict[str, np.ndarray]:
    batch = hf.tokenizer(texts, padding=True, padding_side=side, return_tensors="np")
    return {name: batch[name].astype(np.int64) for name in ("input_ids", "attention_mask")}


@pytest.fixture(scope="module")
def ours(checkpoint, artifact):
    """Our PyTorch modules as they were traced: the encoder, the poolings, the Dense layers."""
    dense = dense_layers(read_module_list(checkpoint), artifact.manifest.hidden_size)
    return GraphOutputs(load_checkpoint(checkpoint), attention=False, dense=dense).eval()


def padding_sides(hf) -> list[str]:
    """The server's side, and the tokenizer's own when it is another (Qwen3's: left)."""
    return sorted({"right", hf.tokenizer.padding_side})


def test_vectors_equal_sentence_transformers(artifact, hf, st, ours):
    for side in padding_sides(hf):
        vectors_equal_sentence_transformers(artifact, hf, st, ours, side)


def vectors_equal_sentence_transformers(artifact, hf, st, ours, side: str) -> None:
    m = artifact.manifest
    name = pooled_output(m.default_pooling, m.normalize)
    graphs = [g.file for g in m.graphs if g.precision == "fp32"]
    for prompt in [None, *m.prompts]:
        want = st.encode(TEXTS, prompt_name=prompt)
        feed = encoded(hf, [m.prompts.get(prompt, "") + text for text in TEXTS], side)
        with torch.no_grad():
            outputs = ours(*(torch.from_numpy(feed[k]) for k in ("input_ids", "attention_mask")))
        torch_vectors = dict(zip(m.pooled_outputs, outputs[1:], strict=True))[name].numpy()
        assert cosines(torch_vectors, want).min() >= MIN_COSINE, (side, prompt)
        for file in graphs:
            (got,) = session(artifact, file).run([name], feed)
            assert cosines(got, want).min() >= MIN_COSINE, (side, file, prompt)
            if m.normalize:
                np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def gemma3(sentence_artifact):
    """Gemma3's artifact and the tokenizer of its checkpoint."""
    from transformers import AutoTokenizer

    checkpoint, artifact = sentence_artifact("gemma3_text")
    return artifact, AutoTokenizer.from_pretrained(str(checkpoint))


def test_the_texts_cross_gemma3s_window(sentence_artifact):
    _, tokenizer = gemma3(sentence_artifact)
    lengths = tokenizer(TEXTS, padding=True, return_tensors="np")["attention_mask"].sum(1)
    assert lengths.max() > GEMMA3_WINDOW + 1 and lengths.min() < GEMMA3_WINDOW // 2


def _pool(hidden: np.ndarray, mask: np.ndarray, how: str) -> np.ndarray:
    """As the server pools the hidden state it gets (numpy, right padding)."""
    if how == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    if how == "cls":
        return hidden[:, 0]
    return hidden[np.arange(len(hidden)), mask.sum(1) - 1]


def test_vectors_pooled_outside_the_graph_go_through_the_dense_graph(artifact, hf, st):
    m = artifact.manifest
    feed = encoded(hf, TEXTS, "right")
    (hidden,) = session(artifact, "encoder.onnx").run([HIDDEN_OUTPUT], feed)
    vectors = _pool(hidden, feed["attention_mask"], m.default_pooling).astype(np.float32)
    if m.dense_graph:
        (vectors,) = session(artifact, m.dense_graph).run(["dense"], {"pooled": vectors})
    assert vectors.shape == (len(TEXTS), m.embedding_size)
    assert cosines(vectors, st.encode(TEXTS)).min() >= MIN_COSINE


def test_int8_graphs_pass_the_gate_on_the_models_pooling(artifact):
    m = artifact.manifest
    graph = m.graph(attention=False, precision="int8")
    assert graph.parity.pooling == m.default_pooling
    assert graph.parity.pooled_cosine_min >= 0.99
    measured = pooled_cosines(artifact.path(graph.parity.reference), artifact.path(graph.file),
                              artifact.path(TOKENIZER), m.max_positions, m.pad_token_id,
                              m.default_pooling)
    assert measured.min() == pytest.approx(graph.parity.pooled_cosine_min, abs=1e-4)
    quantized = onnx.load(artifact.path(graph.file))
    dense = [n for n in quantized.graph.node if n.name.startswith("/pool/")]
    assert "MatMulInteger" in {n.op_type for n in quantized.graph.node}
    assert "MatMulInteger" not in {n.op_type for n in dense}  # Dense layers stay float32


def test_gemma3s_float16_graphs_keep_the_dense_layers_in_float32(sentence_artifact):
    artifact, tokenizer = gemma3(sentence_artifact)
    fp16 = onnx.load(artifact.path("encoder_fp16.onnx"))
    read = {name for node in fp16.graph.node if node.name.startswith("/pool/") for name in node.input}
    dense = [i for i in fp16.graph.initializer if i.name in read and len(i.dims) == 2]
    assert len(dense) == 2 and all(i.data_type == onnx.TensorProto.FLOAT for i in dense)
    batch = tokenizer(TEXTS, padding=True, return_tensors="np")
    feed = {name: batch[name].astype(np.int64) for name in ("input_ids", "attention_mask")}
    name = pooled_output("mean", True)
    (half,) = session(artifact, "encoder_fp16.onnx").run([name], feed)
    (full,) = session(artifact, "encoder.onnx").run([name], feed)
    assert cosines(half, full).min() >= 0.999


@pytest.mark.parametrize("classifier", CLASSIFIER_FAMILIES)
def test_classifier_graphs_match_transformers_on_padded_pairs(classifier_artifact, classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint, artifact = classifier_artifact(classifier)
    hf = AutoModelForSequenceClassification.from_pretrained(
        str(checkpoint), attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    for side in sorted({"right", tokenizer.padding_side}):
        batch = tokenizer(["where does the cat sleep?"] * len(TEXTS), TEXTS, padding=True,
                          padding_side=side, return_tensors="np")
        feed = {name: batch[name].astype(np.int64) for name in ("input_ids", "attention_mask")}
        with torch.no_grad():
            want = hf(**{k: torch.from_numpy(v) for k, v in feed.items()}).logits.numpy()
        assert want.std() > 1e-2  # the pairs score apart: the check can fail
        for graph in artifact.manifest.graphs:
            if graph.precision == "fp32":
                (got,) = session(artifact, graph.file).run([LOGITS_OUTPUT], feed)
                assert np.abs(got - want).max() <= FP32_ATOL, (side, graph.file)
    if classifier == "qwen3":
        parity = artifact.manifest.graph(attention=False, precision="int8").parity
        assert 0.001 < parity.score_error_max <= 0.02
