"""`attnserve export` of the heads beside or instead of pooled vectors, on small random
checkpoints made here, against each model's own library:

- SPLADE (sentence-transformers' SparseEncoder, both of its saved layouts, max and sum
  pooling, both activations): the graph's `sparse` row equals `SparseEncoder.encode`
  within 1e-4, and with the checkpoint's max_active_dims the largest weights it keeps;
- bge-m3 (an XLM-RoBERTa checkpoint with FlagEmbedding's sparse_linear.pt and
  colbert_linear.pt): one graph returns the normalised [CLS] vector, the token weights and
  the token vectors, equal within 1e-4 to FlagEmbedding's formulas computed from the
  checkpoint's own tensors (its lexical weights: the largest per token id, specials left out);
- multi-vector (ColBERT) checkpoints as PyLate and sentence-transformers' MultiVectorEncoder
  save them: tokenized as the manifest says (markers, lengths, query expansion, the
  skiplist), the graph's `multi_vector` rows equal `encode_query` / `encode_document`
  within 1e-4, and their MaxSim `similarity`;
- a sequence classifier of several labels, multi-label: kind classifier, its problem type,
  and scores (sigmoid of the graph's logits) equal to transformers' text-classification
  pipeline (served: tests/server/test_classify.py; SPLADE: tests/server/test_sparse.py).

Checkpoints that are half one thing are refused by export naming the file. (Served:
tests/server/test_bge_m3.py, test_multi_vector.py, test_sparse.py, test_classify.py.)"""

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest

from attnserve.artifact import (
    CLASSIFIER,
    EMBEDDER,
    HIDDEN_OUTPUT,
    LOGITS_OUTPUT,
    MULTI_VECTOR_OUTPUT,
    NO_POOLING,
    SPARSE_OUTPUT,
    TOKEN_WEIGHTS_OUTPUT,
    TOKENIZER,
    read_manifest,
)
from attnserve.model import CheckpointError
from tests.conftest import SPLADES
from tests.families import bge_m3_outputs, lexical_weights

ATOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "ok",
         "Self-attention lets every token look at every other token, the fox too."]
M3_COLBERT_DIM = 24


def _export(out, checkpoint, **flags):
    from attnserve.export.pipeline import run_export

    run_export(out, checkpoint, **flags)
    return read_manifest(out)


def _run(artifact, outputs: list[str], tokenizer, texts=TEXTS, pairs=None) -> list[np.ndarray]:
    """The artifact's fused fp32 graph on `texts` (or (text, pair) pairs) in one padded batch."""
    batch = tokenizer(texts, pairs, padding=True, return_tensors="np")
    session = ort.InferenceSession(str(artifact / "encoder_opt.onnx" if (
        artifact / "encoder_opt.onnx").is_file() else artifact / "reranker_opt.onnx"),
        providers=["CPUExecutionProvider"])
    feed = {i.name: batch[i.name].astype(np.int64) for i in session.get_inputs()}
    return session.run(outputs, feed) + [batch["attention_mask"]]


def _top_k(row: np.ndarray, k: int) -> np.ndarray:
    """`row` with only its k largest positive weights kept (equal weights: the lower id)."""
    ids = np.flatnonzero(row > 0)
    ids = ids[np.argsort(-row[ids], kind="stable")[:k]]
    kept = np.zeros_like(row)
    kept[ids] = row[ids]
    return kept


@pytest.fixture(scope="module", params=list(SPLADES))
def splade(request, splade_artifact):
    return splade_artifact(request.param)


def test_splade_matches_sparse_encoder(splade):
    from sentence_transformers import SparseEncoder
    from transformers import AutoTokenizer

    checkpoint, artifact, manifest = splade
    reference = SparseEncoder(str(checkpoint), device="cpu")
    config = reference[1]
    assert (manifest.kind, manifest.heads, manifest.default_pooling) == (EMBEDDER, ["sparse"],
                                                                          NO_POOLING)
    assert (manifest.sparse.pooling, manifest.sparse.activation, manifest.sparse.top_k) == (
        config.pooling_strategy, config.activation_function, reference.max_active_dims)
    assert {tuple(g.outputs[:2]) for g in manifest.graphs} == {(HIDDEN_OUTPUT, SPARSE_OUTPUT)}
    sparse, _ = _run(artifact, [SPARSE_OUTPUT], AutoTokenizer.from_pretrained(str(checkpoint)))
    kept = reference.encode(TEXTS, convert_to_sparse_tensor=False).numpy()
    reference.max_active_dims = None  # every weight, as the graph returns them
    full = reference.encode(TEXTS, convert_to_sparse_tensor=False).numpy()
    np.testing.assert_allclose(sparse, full, atol=ATOL)
    if manifest.sparse.top_k is not None:
        served = np.stack([_top_k(row, manifest.sparse.top_k) for row in sparse])
        np.testing.assert_allclose(served, kept, atol=ATOL)
        assert [np.count_nonzero(row) for row in kept] == [manifest.sparse.top_k] * len(TEXTS)


def test_export_refuses_a_splade_model_with_other_modules(tmp_path):
    """Inference-free SPLADE routes queries to a static embedding: not this graph."""
    import json

    from attnserve.export.heads import read_splade

    checkpoint = tmp_path / "router"
    checkpoint.mkdir()
    (checkpoint / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder."
         "modules.mlm_transformer.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": "sentence_transformers."
         "sparse_encoder.modules.splade_pooling.SpladePooling"},
        {"idx": 2, "name": "2", "path": "2_Router", "type": "sentence_transformers.base."
         "modules.router.Router"}]))
    with pytest.raises(CheckpointError, match=r"modules.json: modules \[.*Router'\]; attnserve "
                                              "exports a SPLADE model as a masked-LM "
                                              "Transformer, then SpladePooling"):
        read_splade(checkpoint)


def test_bge_m3_heads_come_from_one_graph_as_flagembedding_computes_them(bge_m3):
    from transformers import AutoTokenizer

    checkpoint, artifact, manifest = bge_m3
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    references = bge_m3_outputs(checkpoint, TEXTS)
    assert manifest.heads == ["dense", "lexical", "multi_vector"]
    assert (manifest.default_pooling, manifest.normalize) == ("cls", True)
    assert set(manifest.lexical.dropped_token_ids) == references[0].dropped
    assert (manifest.multi_vector.dim, manifest.multi_vector.skip_leading,
            manifest.multi_vector.similarity) == (M3_COLBERT_DIM, 1, "meanmaxsim")
    dense, weights, vectors, mask = _run(artifact, ["pooled_cls_normalized", TOKEN_WEIGHTS_OUTPUT,
                                                    MULTI_VECTOR_OUTPUT], tokenizer)
    for i, want in enumerate(references):
        n = len(want.ids)
        np.testing.assert_allclose(dense[i], want.dense, atol=ATOL)
        got = lexical_weights(want.ids, weights[i, :n], set(manifest.lexical.dropped_token_ids))
        assert got.keys() == want.lexical.keys()
        np.testing.assert_allclose([got[t] for t in want.lexical], list(want.lexical.values()),
                                   atol=ATOL)
        skip = manifest.multi_vector.skip_leading
        np.testing.assert_allclose(vectors[i, skip:n], want.colbert, atol=ATOL)
        assert mask[i].sum() == n


def test_half_a_bge_m3_checkpoint_is_refused_naming_the_missing_file(bge_m3, tmp_path):
    import shutil

    checkpoint = shutil.copytree(bge_m3[0], tmp_path / "half")
    (checkpoint / "colbert_linear.pt").unlink()
    with pytest.raises(CheckpointError, match=f"{checkpoint / 'colbert_linear.pt'}: missing; "
                                              "bge-m3's heads are sparse_linear.pt and "
                                              "colbert_linear.pt, both"):
        _export(tmp_path / "out", checkpoint)
    with pytest.raises(CheckpointError, match="--int8: .* is a bge-m3 model, whose heads have "
                                              "no float16 or int8 graphs yet"):
        _export(tmp_path / "out", bge_m3[0], int8=True)


@pytest.fixture(scope="module")
def classifier(multi_label_classifier):
    checkpoint, artifact = multi_label_classifier
    return checkpoint, artifact.directory, artifact.manifest


def test_a_multi_label_classifier_matches_the_text_classification_pipeline(classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    checkpoint, artifact, manifest = classifier
    assert (manifest.kind, manifest.labels, manifest.problem_type, manifest.activation) == (
        CLASSIFIER, ["label_0", "label_1", "label_2"], "multi_label_classification", "sigmoid")
    assert manifest.heads == [] and manifest.pooled_outputs == ()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    logits, _ = _run(artifact, [LOGITS_OUTPUT], tokenizer)
    scores = 1 / (1 + np.exp(-logits))
    classify = pipeline("text-classification", top_k=None, tokenizer=tokenizer,
                        model=AutoModelForSequenceClassification.from_pretrained(str(checkpoint)))
    for row, labels in zip(scores, classify(TEXTS), strict=True):
        want = {label["label"]: label["score"] for label in labels}
        np.testing.assert_allclose([row[manifest.labels.index(k)] for k in want],
                                   list(want.values()), atol=ATOL)
    # transformers' rule for the other problem types
    assert replace(manifest, problem_type=None).activation == "softmax"
    assert replace(manifest, problem_type="regression").activation == "none"
    assert replace(manifest, problem_type=None, labels=["yes"]).activation == "sigmoid"


def test_a_multi_label_classifiers_int8_gate_holds_its_sigmoids(classifier, tmp_path):
    """The gate measures the scores the server returns, each label's sigmoid, not a softmax
    over the labels, which would record (and gate) another number."""
    from attnserve.export.quantize import ScoreGate

    checkpoint, _, _ = classifier
    # A random model's int8 scores land near the default gate: this test is about what is
    # measured, not whether it passes.
    manifest = _export(tmp_path / "int8", checkpoint, int8=True, int8_max_score_error=0.5)
    graph = manifest.graph(attention=False, precision="int8")
    fp32, int8 = tmp_path / "int8" / graph.parity.reference, tmp_path / "int8" / graph.file
    recorded = graph.parity.score_error_max
    errors = {activation: ScoreGate(checkpoint / TOKENIZER, manifest.max_positions, manifest.pad_token_id,
                                    False, activation).measure(fp32, int8)
              for activation in ("sigmoid", "softmax")}
    assert recorded == pytest.approx(errors["sigmoid"].max(), abs=1e-5)  # as the manifest rounds it
    # The two measures differ text pair by text pair (their largest alone may land close).
    assert not np.allclose(errors["sigmoid"], errors["softmax"], atol=1e-4)


QUERIES = ["where does the fox sleep?", "What does self-attention let every single token in a "
           "long sentence do?"]
DOCUMENTS = ["The fox sleeps under the tree, (mostly) at noon!", "Hello, world.",
             "Self-attention lets every token look at every other token."]


@pytest.fixture(scope="module", params=["pylate", "native"])
def multi_vector(request, multi_vector_artifact):
    return multi_vector_artifact(request.param)


def _vectors(artifact, side, texts) -> list[np.ndarray]:
    """Each text's vectors as the manifest says to make them: the side's prompt, its
    length (the closing special token kept), query expansion, the skiplist left out."""
    from tokenizers import Tokenizer

    manifest = read_manifest(artifact)
    spec = getattr(manifest.multi_vector, side)
    tokenizer = Tokenizer.from_file(str(artifact / TOKENIZER))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    session = ort.InferenceSession(str(artifact / "encoder_opt.onnx"),
                                   providers=["CPUExecutionProvider"])
    found = []
    for text in texts:
        ids = tokenizer.encode(spec.prompt + text).ids
        if spec.max_length is not None and len(ids) > spec.max_length:
            ids = ids[:spec.max_length - 1] + ids[-1:]
        mask = [1] * len(ids)
        if spec.expand_to is not None and len(ids) < spec.expand_to:
            extra = spec.expand_to - len(ids)
            ids, mask = ids + [spec.expansion_token_id] * extra, mask + [int(spec.expansion_attended)] * extra
        (vectors,) = session.run([MULTI_VECTOR_OUTPUT], {"input_ids": np.array([ids]),
                                                         "attention_mask": np.array([mask])})
        keep = [i for i, token in enumerate(ids) if token not in spec.skiplist_ids
                and i >= manifest.multi_vector.skip_leading]
        found.append(vectors[0][keep])
    return found


def test_multi_vector_matches_the_multi_vector_encoder(multi_vector):
    from sentence_transformers import MultiVectorEncoder

    checkpoint, artifact, manifest = multi_vector
    reference = MultiVectorEncoder(str(checkpoint), device="cpu")
    assert (manifest.heads, manifest.default_pooling) == (["multi_vector"], NO_POOLING)
    assert (manifest.multi_vector.dim, manifest.multi_vector.similarity) == (16, "maxsim")
    assert manifest.multi_vector.query.expand_to == 12
    queries = _vectors(artifact, "query", QUERIES)
    documents = _vectors(artifact, "document", DOCUMENTS)
    want_queries = reference.encode_query(QUERIES)
    want_documents = reference.encode_document(DOCUMENTS)
    for got, want in zip(queries + documents, want_queries + want_documents, strict=True):
        assert got.shape == tuple(want.shape)
        np.testing.assert_allclose(got, want.numpy(), atol=ATOL)
    scores = [[float((q @ d.T).max(axis=1).sum()) for d in documents] for q in queries]
    np.testing.assert_allclose(scores, reference.similarity(want_queries, want_documents).numpy(),
                               atol=ATOL)


def test_a_sequence_classifier_is_a_reranker_or_a_classifier_by_its_labels():
    from attnserve.export.pipeline import _scorer_kind

    assert _scorer_kind({}, 1, None) == "reranker"
    assert _scorer_kind({}, 2, None) == "classifier"
    assert _scorer_kind({"problem_type": "multi_label_classification"}, 1, None) == "classifier"
    assert _scorer_kind({}, 3, "reranker") == "reranker"
    assert _scorer_kind({}, 1, "classifier") == "classifier"
