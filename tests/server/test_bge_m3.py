"""Promise: a bge-m3-shaped model (an XLM-RoBERTa with FlagEmbedding's sparse_linear.pt and
colbert_linear.pt, small and random: conftest's bge_m3) is served with its three heads, each
equal within 1e-4 to FlagEmbedding's formulas computed here from the checkpoint's own
tensors on transformers' hidden states:

- the dense vector, the normalised [CLS] state;
- the lexical weights, ReLU(sparse_linear(h)) a token, the largest for a repeated token
  id, the special tokens left out: on attnserve.v1 EmbedSparse and Embed's
  return_sparse, TEI's /embed_sparse and the OpenAI door's `embedding_types: ["sparse"]`;
- the multi-vector vectors, colbert_linear(h) normalised, for every token after [CLS]:
  Embed's return_multi_vector.

One Embed call asks for all three and gets them from one forward pass: each text runs in
one batch once, as the engine's batch and inference-stage metrics count it. Bad input is refused naming the
field: a head the model lacks, a head with chunking. The server holds the bge-m3 model
(the default) and the tiny BERT, which has neither head."""

from pathlib import Path

import numpy as np
import pytest

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.families import bge_m3_outputs
from tests.harness import delta
from tests.server.reliability import serve
from tests.server.test_http import post_json
from tests.server.test_rerank import invalid

M3, TINY = "m3", "tiny"
TEXTS = ["The quick brown fox jumps over the lazy dog, the dog naps.", "ok",
         "Self-attention lets every token look at every other token."]
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(bge_m3, tiny_artifact):
    with serve(Path(f"{M3}={bge_m3[1]}"), "--artifact", f"{TINY}={tiny_artifact}") as process:
        yield process


@pytest.fixture(scope="module")
def flag_embedding(bge_m3):
    """Each text's outputs as FlagEmbedding computes them (tests/families.py)."""
    return [(o.ids, o.dense, o.lexical, o.colbert) for o in bge_m3_outputs(bge_m3[0], TEXTS)]


def assert_lexical(indices, values, want: dict[int, float]) -> None:
    assert list(indices) == sorted(want), (list(indices), sorted(want))
    np.testing.assert_allclose(values, [want[i] for i in sorted(want)], atol=ATOL)


@pytest.mark.workers
def test_one_embed_call_returns_the_three_heads_from_one_pass(server, encoder, flag_embedding):
    before = server.scrape()
    response = encoder.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True, return_sparse=True,
                                             return_multi_vector=True), timeout=60)
    after = server.scrape()
    # Each text ran once, whatever batches the loop cut them into, and each batch ran
    # the graph once.
    assert delta(before, after, "attnserve_batch_size_sum", model=M3) == len(TEXTS)
    batches = delta(before, after, "attnserve_batch_size_count", model=M3)
    assert delta(before, after, "attnserve_stage_duration_seconds_count", model=M3,
                 stage="inference") == batches
    assert response.model == M3
    for got, (ids, dense, lexical, vectors) in zip(response.embeddings, flag_embedding,
                                                   strict=True):
        assert list(got.token_ids) == ids
        pooled = np.frombuffer(got.pooled.data, "<f4")
        np.testing.assert_allclose(pooled, dense, atol=ATOL)
        multi = np.frombuffer(got.multi_vector.data, "<f4").reshape(tuple(got.multi_vector.shape))
        assert multi.shape == vectors.shape == (len(ids) - 1, 24)
        np.testing.assert_allclose(multi, vectors, atol=ATOL)
        assert_lexical(got.sparse.indices, got.sparse.values, lexical)


@pytest.mark.workers
def test_the_lexical_weights_on_every_sparse_door(server, encoder, flag_embedding):
    response = encoder.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS), timeout=60)
    for got, (_, _, lexical, _) in zip(response.vectors, flag_embedding, strict=True):
        assert_lexical(got.indices, got.values, lexical)
    (one,) = encoder.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS[:1], top_k=2),
                                 timeout=60).vectors
    largest = sorted(sorted(flag_embedding[0][2].items(), key=lambda e: -e[1])[:2])
    assert_lexical(one.indices, one.values, dict(largest))
    status, found = post_json(server, "/embed_sparse", {"inputs": TEXTS})
    assert status == 200, found
    for got, (_, _, lexical, _) in zip(found, flag_embedding, strict=True):
        assert_lexical([e["index"] for e in got], [e["value"] for e in got], lexical)
    status, answer = post_json(server, "/v1/embeddings", {
        "model": M3, "input": TEXTS, "embedding_types": ["sparse"]})
    assert status == 200, answer
    for item, (_, _, lexical, _) in zip(answer["data"], flag_embedding, strict=True):
        sparse = item["embeddings"]["sparse"]
        assert_lexical(sparse["indices"], sparse["values"], lexical)


def test_the_client_gets_the_three_heads(server, flag_embedding):
    with EncoderClient(server.address) as client:
        (got,) = client.embed(TEXTS[:1], normalize=True, multi_vector=True, sparse=True)
    ids, dense, lexical, vectors = flag_embedding[0]
    np.testing.assert_allclose(got.pooled, dense, atol=ATOL)
    np.testing.assert_allclose(got.multi_vector, vectors, atol=ATOL)
    assert got.sparse.indices.dtype == np.uint32
    assert_lexical(got.sparse.indices, got.sparse.values, lexical)


def test_the_dense_vector_on_the_http_doors(server, flag_embedding):
    status, answer = post_json(server, "/v1/embeddings", {"model": M3, "input": TEXTS})
    assert status == 200, answer
    for item, (_, dense, _, _) in zip(answer["data"], flag_embedding, strict=True):
        np.testing.assert_allclose(item["embedding"], dense, atol=ATOL)
    status, found = post_json(server, "/embed", {"inputs": TEXTS})
    assert status == 200, found
    np.testing.assert_allclose(found, [dense for _, dense, _, _ in flag_embedding], atol=ATOL)


@pytest.mark.parametrize("request_, field", [
    (pb.EmbedRequest(model=TINY, texts=["a"], return_sparse=True), "return_sparse"),
    (pb.EmbedRequest(model=TINY, texts=["a"], return_multi_vector=True), "return_multi_vector"),
    (pb.EmbedRequest(texts=["a"], return_multi_vector=True,
                     chunking=pb.Chunking(max_tokens=8)), "return_multi_vector"),
])
def test_a_head_the_request_cannot_have_is_refused_naming_the_field(encoder, request_, field):
    found, message = invalid(lambda: encoder.Embed(request_, timeout=60))
    assert found == field, message
