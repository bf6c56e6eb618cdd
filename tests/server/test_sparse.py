"""Promise: a SPLADE model (sentence-transformers' SparseEncoder, small and random) is
served as sparse vectors, never as a vocabulary-wide row: attnserve.v1 EmbedSparse and
TEI's /embed_sparse (and TEI's root, the model being the default) and the OpenAI door's
`embedding_types: ["sparse"]` give each text's
non-zero weights by ascending token id, equal to SparseEncoder.encode within 1e-4; top_k
keeps the largest weights (the model's own default is its checkpoint's max_active_dims).
A response over the message limit is refused naming the limit and a top_k that fits,
which then passes. Bad input is refused naming the field: no texts, top_k under 1, a
model without a sparse head, dense vectors asked of a SPLADE model. One server holds two
SPLADE models (a DistilBERT max/relu one, the default, and a RoBERTa sum/log1p one with
max_active_dims 5) and MiniLM."""

import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.harness import ATTNSERVE, REPO, delta
from tests.server.reliability import serve
from tests.server.test_http import post_json
from tests.server.test_rerank import invalid

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

SPLADE, SUMMED, MINILM = "distilbert-legacy", "roberta-sum-log1p", "minilm"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "ok",
         "Self-attention lets every token look at every other token, the fox too."]
ATOL = 1e-4
# Small enough that a dozen texts of a random SPLADE model's hundreds of weights each do
# not fit TEI's JSON, large enough for TEXTS.
LIMIT = 96 << 10


@pytest.fixture(scope="module")
def server(splade_artifact, minilm_artifact):
    named = Path(f"{SPLADE}={splade_artifact(SPLADE)[1]}")  # --artifact NAME=DIR
    with serve(named, "--artifact", f"{SUMMED}={splade_artifact(SUMMED)[1]}",
               "--artifact", f"{MINILM}={minilm_artifact}",
               "--max-message-bytes", str(LIMIT)) as process:
        yield process


@pytest.fixture(scope="module")
def references(splade_artifact):
    """name -> SparseEncoder's rows of TEXTS, every weight (max_active_dims off)."""
    from sentence_transformers import SparseEncoder

    rows = {}
    for name in (SPLADE, SUMMED):
        reference = SparseEncoder(str(splade_artifact(name)[0]), device="cpu")
        reference.max_active_dims = None
        rows[name] = reference.encode(TEXTS, convert_to_sparse_tensor=False).numpy()
    return rows


def dense(indices, values, vocab: int) -> np.ndarray:
    assert list(indices) == sorted(set(indices)), indices  # ascending, each id once
    assert all(v != 0 for v in values)
    row = np.zeros(vocab, dtype=np.float32)
    row[list(indices)] = values
    return row


def top_k(row: np.ndarray, k: int) -> np.ndarray:
    """`row` with only its k largest weights kept."""
    kept = np.zeros_like(row)
    ids = np.argsort(-row, kind="stable")[:k]
    kept[ids] = row[ids]
    return kept


@pytest.mark.workers
def test_embed_sparse_matches_sparse_encoder(encoder, references):
    vocab = references[SPLADE].shape[1]
    response = encoder.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS), timeout=60)
    assert response.model == SPLADE and response.total_tokens > 0
    for got, want in zip(response.vectors, references[SPLADE], strict=True):
        np.testing.assert_allclose(dense(got.indices, got.values, vocab), want, atol=ATOL)
    response = encoder.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS, top_k=3), timeout=60)
    for got, want in zip(response.vectors, references[SPLADE], strict=True):
        np.testing.assert_allclose(dense(got.indices, got.values, vocab), top_k(want, 3),
                                   atol=ATOL)
    # the checkpoint's max_active_dims (5) unless the request says otherwise
    summed = references[SUMMED]
    for k, request in ((5, pb.EmbedSparseRequest(model=SUMMED, texts=TEXTS)),
                       (2, pb.EmbedSparseRequest(model=SUMMED, texts=TEXTS, top_k=2))):
        vectors = encoder.EmbedSparse(request, timeout=60).vectors
        for got, want in zip(vectors, summed, strict=True):
            assert len(got.indices) == min(k, np.count_nonzero(want))
            np.testing.assert_allclose(dense(got.indices, got.values, summed.shape[1]),
                                       top_k(want, k), atol=ATOL)


def test_the_client_and_the_embed_commands_sparse_vectors(server, references, tmp_path):
    """EncoderClient.embed_sparse and `attnserve embed --sparse` (printed, and saved as
    compressed sparse rows), as a user calls them; the call's priority class reaches the
    queue from EmbedSparse's own field."""
    vocab = references[SPLADE].shape[1]
    before = server.scrape()
    with EncoderClient(server.address) as client:
        vectors = client.embed_sparse(TEXTS, top_k=3, priority="bulk")
    assert delta(before, server.scrape(), "attnserve_queue_wait_seconds_count",
                 model=SPLADE, priority="bulk") == 1
    for got, want in zip(vectors, references[SPLADE], strict=True):
        assert got.indices.dtype == np.uint32 and got.values.dtype == np.float32
        np.testing.assert_allclose(dense(got.indices, got.values, vocab), top_k(want, 3),
                                   atol=ATOL)
    command = [*ATTNSERVE, "embed", *TEXTS, "--sparse", "--address", server.address]
    printed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    lines = printed.stdout.strip().splitlines()
    assert len(lines) == len(TEXTS)
    for line, want in zip(lines, references[SPLADE], strict=True):
        assert f": {np.count_nonzero(want)} non-zero [" in line
        first, weight = line.split("[")[1].split()[0].split(":")
        assert int(first) == int(np.argmax(want)), line
        assert float(weight) == pytest.approx(want.max(), abs=ATOL), line
    out = tmp_path / "sparse.npz"
    saved = subprocess.run([*command, "--out", str(out)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr[-2000:]
    from scipy.sparse import csr_matrix

    with np.load(out) as rows:
        matrix = csr_matrix((rows["values"], rows["indices"], rows["indptr"]),
                            shape=(len(TEXTS), vocab))
    np.testing.assert_allclose(matrix.toarray(), references[SPLADE], atol=ATOL)


def test_the_embed_command_refuses_dense_flags_with_sparse(server):
    done = subprocess.run([*ATTNSERVE, "embed", "a", "--sparse", "--pooling", "cls",
                           "--address", server.address], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("attnserve embed: --sparse takes no --pooling (flags of "
                                   "dense vectors)")


@pytest.mark.workers
def test_tei_embed_sparse_and_its_root(server, references):
    vocab = references[SPLADE].shape[1]
    status, found = post_json(server, "/embed_sparse", {"inputs": TEXTS})
    assert status == 200, found
    for got, want in zip(found, references[SPLADE], strict=True):
        np.testing.assert_allclose(dense([e["index"] for e in got], [e["value"] for e in got],
                                         vocab), want, atol=ATOL)
    status, (one,) = post_json(server, "/", {"inputs": TEXTS[1], "top_k": 4})
    assert status == 200 and len(one) == 4
    np.testing.assert_allclose(dense([e["index"] for e in one], [e["value"] for e in one],
                                     vocab), top_k(references[SPLADE][1], 4), atol=ATOL)


@pytest.mark.workers
def test_openai_embedding_types_sparse(server, references):
    vocab = references[SPLADE].shape[1]
    status, answer = post_json(server, "/v1/embeddings", {
        "model": SPLADE, "input": TEXTS, "embedding_types": ["sparse"], "sparse_top_k": 6})
    assert status == 200, answer
    assert answer["usage"]["total_tokens"] > 0
    for item, want in zip(answer["data"], references[SPLADE], strict=True):
        found = item["embeddings"]["sparse"]
        assert item["embedding"] == [] and len(found["indices"]) == 6
        np.testing.assert_allclose(dense(found["indices"], found["values"], vocab),
                                   top_k(want, 6), atol=ATOL)


@pytest.mark.workers
def test_a_response_over_the_limit_is_refused_naming_a_top_k_that_fits(server, encoder):
    texts = TEXTS * 8
    status, answer = post_json(server, "/embed_sparse", {"inputs": texts})
    assert status == 413, answer
    message = answer["error"]
    assert f"over the {LIMIT // 1024}.0 KiB message limit: ask for top_k ≤ " in message
    fits = int(message.split("top_k ≤ ")[1].split(",")[0])
    assert fits >= 1
    status, found = post_json(server, "/embed_sparse", {"inputs": texts, "top_k": fits})
    assert status == 200 and max(map(len, found)) == fits


@pytest.mark.workers
def test_the_memory_bound_counts_the_vocabulary_scores(splade_artifact, minilm_artifact):
    """Without a fitted memory model a SPLADE batch is admitted by the analytic bound: per
    token its [vocab] scores and their masked copy, beside what a dense model's counts."""
    from attnserve.artifact import read_manifest
    from attnserve.server.memory.model import analytic_bound

    manifest = splade_artifact(SPLADE)[2]
    dense = replace(manifest, sparse=None)
    assert analytic_bound(manifest).b - analytic_bound(dense).b == 8 * manifest.vocab_size
    assert analytic_bound(read_manifest(minilm_artifact)).b == 4.0 * 16 * 384


@pytest.mark.parametrize("request_, field", [
    (pb.EmbedSparseRequest(), "texts"),
    (pb.EmbedSparseRequest(texts=["a"], top_k=0), "top_k"),
    (pb.EmbedSparseRequest(model=MINILM, texts=["a"]), "model"),
])
def test_grpc_bad_sparse_requests_are_refused_naming_the_field(encoder, request_, field):
    found, message = invalid(lambda: encoder.EmbedSparse(request_, timeout=60))
    assert found == field, message


@pytest.mark.workers
def test_dense_vectors_of_a_splade_model_are_refused_naming_the_model(encoder, server):
    found, message = invalid(lambda: encoder.Embed(pb.EmbedRequest(texts=["a"]), timeout=60))
    assert found == "model" and "no dense vectors" in message, message
    status, answer = post_json(server, "/embed", {"inputs": "a"})
    assert status == 422 and "no dense vectors" in answer["error"], answer


@pytest.mark.parametrize("body, field", [
    ({"input": "a", "embedding_types": ["sparse", "float"]}, "embedding_types"),
    ({"input": "a", "embedding_types": ["sparse"], "sparse_top_k": 0}, "sparse_top_k"),
    ({"input": "a", "sparse_top_k": 3, "model": MINILM}, "sparse_top_k"),
    ({"input": "a", "embedding_types": ["sparse"], "model": MINILM}, "model"),
    ({"input": "a"}, "model"),
])
def test_openai_bad_sparse_requests_are_refused_naming_the_field(server, body, field):
    found, answer = post_json(server, "/v1/embeddings", body)
    assert found == 400 and answer["error"]["param"] == field, answer


@pytest.mark.parametrize("body, status, field", [
    ({"inputs": []}, 400, "inputs"),
    ({"inputs": ["a", ""]}, 400, "inputs[1]"),
    ({"inputs": "a", "top_k": 0}, 422, "top_k"),
])
def test_tei_bad_sparse_requests_are_refused_naming_the_field(server, body, status, field):
    found, answer = post_json(server, "/embed_sparse", body)
    assert found == status and field in answer["error"], answer
