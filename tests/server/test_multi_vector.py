"""Promise: a multi-vector (ColBERT) model, as PyLate and sentence-transformers'
MultiVectorEncoder save one (small and random: conftest's multi_vector_artifact), is served
as its library computes it, within 1e-4:

- gRPC Embed's return_multi_vector with prompt_name "query" or "document": each text
  tokenized as that side is (its marker, its length, a query's expansion tokens run
  masked), the vectors of the tokens it keeps (a document's punctuation left out) equal to
  encode_query / encode_document;
- Score's MAXSIM: the query as a query, the texts as documents, equal to the library's
  similarity.

A request that does not say which side its texts are, or asks a cosine of a model without
pooled vectors, is refused naming the field. One server holds both layouts' models."""

from pathlib import Path

import numpy as np
import pytest

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.export.test_heads_export import DOCUMENTS, QUERIES
from tests.server.reliability import serve
from tests.server.test_rerank import invalid

LAYOUTS = ("pylate", "native")
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(multi_vector_artifact):
    first, second = (f"{layout}={multi_vector_artifact(layout)[1]}" for layout in LAYOUTS)
    with serve(Path(first), "--artifact", second) as process:
        yield process


@pytest.fixture(scope="module")
def references(multi_vector_artifact):
    """layout -> (encode_query's vectors, encode_document's, similarity [queries, documents])."""
    from sentence_transformers import MultiVectorEncoder

    found = {}
    for layout in LAYOUTS:
        reference = MultiVectorEncoder(str(multi_vector_artifact(layout)[0]), device="cpu")
        queries = reference.encode_query(QUERIES)
        documents = reference.encode_document(DOCUMENTS)
        found[layout] = ([q.numpy() for q in queries], [d.numpy() for d in documents],
                         reference.similarity(queries, documents).numpy())
    return found


def vectors(embedding: pb.Embedding) -> np.ndarray:
    tensor = embedding.multi_vector
    return np.frombuffer(tensor.data, "<f4").reshape(tuple(tensor.shape))


@pytest.mark.workers
@pytest.mark.parametrize("layout", LAYOUTS)
def test_embed_gives_each_sides_vectors_as_the_library(encoder, references, layout):
    queries, documents, _ = references[layout]
    for side, texts, want in (("query", QUERIES, queries), ("document", DOCUMENTS, documents)):
        response = encoder.Embed(pb.EmbedRequest(model=layout, texts=texts, prompt_name=side,
                                                 return_multi_vector=True), timeout=60)
        for got, expected in zip(response.embeddings, want, strict=True):
            assert vectors(got).shape == expected.shape, (side, layout)
            np.testing.assert_allclose(vectors(got), expected, atol=ATOL)


def test_the_client_gets_the_vectors_as_numpy(server, references):
    with EncoderClient(server.address) as client:
        (got,) = client.embed(QUERIES[:1], model="native", prompt_name="query",
                              multi_vector=True)
    assert got.pooled is None and got.sparse is None
    np.testing.assert_allclose(got.multi_vector, references["native"][0][0], atol=ATOL)


@pytest.mark.workers
@pytest.mark.parametrize("layout", LAYOUTS)
def test_maxsim_scores_as_the_library(encoder, references, layout):
    *_, similarity = references[layout]
    for row, query in enumerate(QUERIES):
        response = encoder.Score(pb.ScoreRequest(model=layout, query=query, texts=DOCUMENTS,
                                                 mode=pb.SCORE_MODE_MAXSIM), timeout=60)
        np.testing.assert_allclose(response.scores, similarity[row], atol=ATOL)


@pytest.mark.parametrize("request_, field", [
    (pb.EmbedRequest(model="pylate", texts=["a"], return_multi_vector=True), "prompt_name"),
    (pb.EmbedRequest(model="native", texts=["a"], prompt_name="passage",
                     return_multi_vector=True), "prompt_name"),
])
def test_a_text_of_no_side_is_refused_naming_the_field(encoder, request_, field):
    found, message = invalid(lambda: encoder.Embed(request_, timeout=60))
    assert found == field and "query or document" in message, message


def test_cosine_of_a_model_without_pooled_vectors_is_refused_naming_the_mode(encoder):
    found, message = invalid(lambda: encoder.Score(pb.ScoreRequest(
        model="pylate", query="a", texts=["b"], mode=pb.SCORE_MODE_COSINE), timeout=60))
    assert found == "mode" and "multi_vector" in message, message
