"""The pooled outputs every graph carries (mean over the mask and the first token, each
also L2-normalised): against sentence-transformers, and against numpy pooling of the hidden
state the same run returns, padding rows and float16 graphs included."""

import os

import numpy as np
import onnxruntime as ort
import pytest

from attnserve.artifact import HIDDEN_OUTPUT, POOLED_OUTPUTS, load_artifact
from tests.harness import minilm_dir
from tests.hugging_face import HuggingFace

TEXTS = [
    "A man is playing a guitar.",
    "Self-attention lets every token look at every other token in the sequence.",
    "ok",
    "Revenue grew 17.5% year over year to $4.2 billion, beating estimates by 0.3%.",
    "服务 A 调用了配置中心 B，因为它需要获取最新配置。",
]
# float32 MiniLM graphs against sentence-transformers' pooled, normalised vectors.
MIN_COSINE = 0.9999
# Pooled output against numpy pooling of the hidden state output by the same run: both
# float32 from the same float32 values (float16 graphs included: their pooling stays
# float32), so only summation order differs.
POOL_RTOL, POOL_ATOL = 1e-5, 1e-6


def numpy_pooled(hidden: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """What the graph's pooled outputs must be, written independently of it."""
    hidden = hidden.astype(np.float64)
    weights = mask[..., None].astype(np.float64)
    mean = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    cls = hidden[:, 0]

    def normalised(v: np.ndarray) -> np.ndarray:
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

    return {"pooled_mean": mean, "pooled_mean_normalized": normalised(mean),
            "pooled_cls": cls, "pooled_cls_normalized": normalised(cls)}


def padded(rows: list[list[int]], extra_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """As the batch loop pads: rows from the left, then `extra_rows` of padding only."""
    seq = max(map(len, rows))
    ids = np.zeros((len(rows) + extra_rows, seq), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    return ids, mask


def run(session: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    names = [HIDDEN_OUTPUT, *POOLED_OUTPUTS]
    return dict(zip(names, session.run(names, {"input_ids": ids, "attention_mask": mask}),
                    strict=True))


@pytest.fixture(scope="module")
def minilm(minilm_artifact):
    return load_artifact(minilm_artifact)


@pytest.fixture(scope="module")
def texts_as_ids() -> list[list[int]]:
    hf = HuggingFace(minilm_dir())
    return [hf.ids(t) for t in TEXTS]


@pytest.fixture(scope="module")
def sentence_transformers() -> np.ndarray:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    return st.encode(TEXTS, normalize_embeddings=True)


@pytest.mark.parametrize("file", ["encoder.onnx", "encoder_opt.onnx", "encoder_attn.onnx"])
def test_pooled_mean_matches_sentence_transformers(minilm, texts_as_ids, sentence_transformers, file):
    """MiniLM's pooling (mean, then normalise) as the float32 graphs compute it on a padded
    batch, against sentence-transformers on the same texts."""
    session = ort.InferenceSession(str(minilm.path(file)), providers=["CPUExecutionProvider"])
    got = run(session, *padded(texts_as_ids))
    expected = sentence_transformers
    normalised = got["pooled_mean_normalized"]
    assert normalised.shape == expected.shape == (len(TEXTS), 384)
    assert (normalised * expected).sum(axis=1).min() >= MIN_COSINE
    mean = got["pooled_mean"]
    cosine = (mean * expected).sum(axis=1) / np.linalg.norm(mean, axis=1)
    assert cosine.min() >= MIN_COSINE


@pytest.mark.parametrize("fixture,precision", [("minilm_artifact", "fp32"),
                                               ("tiny_fp16_artifact", "fp32"),
                                               ("tiny_fp16_artifact", "fp16")])
def test_pooled_outputs_are_the_pooling_of_the_hidden_state(request, fixture, precision):
    """Every graph of the precision, on a ragged batch with two rows of padding only (as
    shape buckets add them): each pooled output equals numpy pooling of the hidden state
    from the same run; padding rows pool to zeros, never NaN; and they change nothing in
    the real rows."""
    artifact = load_artifact(request.getfixturevalue(fixture))
    rng = np.random.default_rng(5)
    rows = [rng.integers(1000, 30000, n).tolist() for n in (17, 3, 1, 40)]
    ids, mask = padded(rows, extra_rows=2)
    graphs = [g for g in artifact.manifest.graphs if g.precision == precision]
    assert graphs
    for graph in graphs:
        assert set(POOLED_OUTPUTS) <= set(graph.outputs), graph.file
        session = ort.InferenceSession(str(artifact.path(graph.file)),
                                       providers=["CPUExecutionProvider"])
        got = run(session, ids, mask)
        for name, want in numpy_pooled(got[HIDDEN_OUTPUT][:len(rows)], mask[:len(rows)]).items():
            assert got[name].dtype == np.float32, (graph.file, name)
            np.testing.assert_allclose(got[name][:len(rows)], want, rtol=POOL_RTOL, atol=POOL_ATOL,
                                       err_msg=f"{graph.file} {name}")
        for name in ("pooled_mean", "pooled_mean_normalized"):
            assert np.all(got[name][len(rows):] == 0), (graph.file, name)
        for name in POOLED_OUTPUTS:
            assert np.isfinite(got[name]).all(), (graph.file, name)
        alone = run(session, *padded(rows))
        for name in POOLED_OUTPUTS:
            np.testing.assert_allclose(got[name][:len(rows)], alone[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{graph.file} {name}")
