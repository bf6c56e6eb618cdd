"""Promise: an embedding model scores texts against a query, computed in the server:
attnserve.v1 Score with COSINE is the cosine of the pooled vectors Embed returns, MAXSIM
ColBERT's late interaction over the token embeddings Embed returns (for each query token
its best cosine among a text's tokens, summed), both checked against numpy; TEI's
/similarity is COSINE in TEI's shape. A text over the model's positions is refused naming
it, or cut with truncate; bad input is refused naming the field."""


import grpc
import numpy as np
import pytest

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.server.reliability import stub
from tests.server.test_http import post_json

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

QUERY = "where does the cat sleep?"
TEXTS = ["The cat sleeps on the sofa.", "Stock markets fell sharply on Monday.", "ok",
         "Le chat dort sur le canapé pendant que la pluie tombe doucement.", "a cat, a sofa"]
LONG = "the cat sleeps on the warm sofa while it rains " * 60
ATOL = 1e-5


@pytest.fixture(scope="module")
def encoder(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        yield stub(channel)


def unit(vectors: np.ndarray) -> np.ndarray:
    vectors = vectors.astype(np.float64)
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def embedded(client: EncoderClient, texts: list[str], truncate: bool = False):
    return client.embed(texts, pooling="mean", token_embeddings=True, truncate=truncate)


@pytest.mark.workers
def test_cosine_is_that_of_embeds_pooled_vectors(encoder, client):
    response = encoder.Score(pb.ScoreRequest(query=QUERY, texts=TEXTS, mode=pb.SCORE_MODE_COSINE),
                             timeout=60)
    query, *texts = embedded(client, [QUERY, *TEXTS])
    want = unit(np.stack([t.pooled for t in texts])) @ unit(query.pooled)
    assert want.std() > 0.05  # the texts score apart
    np.testing.assert_allclose(response.scores, want, atol=ATOL)
    assert response.total_tokens == sum(len(e.token_ids) for e in [query, *texts])
    assert response.model == "all-MiniLM-L6-v2"


@pytest.mark.workers
def test_maxsim_is_colberts_rule_over_embeds_token_embeddings(encoder, client):
    response = encoder.Score(pb.ScoreRequest(query=QUERY, texts=TEXTS, mode=pb.SCORE_MODE_MAXSIM),
                             timeout=60)
    query, *texts = embedded(client, [QUERY, *TEXTS])
    q = unit(query.token_embeddings)
    want = np.array([(q @ unit(t.token_embeddings).T).max(axis=1).sum() for t in texts])
    np.testing.assert_allclose(response.scores, want, atol=ATOL * len(q))
    np.testing.assert_allclose(client.score(QUERY, TEXTS, mode="maxsim"), want, atol=ATOL * len(q))


def test_a_long_text_is_refused_or_cut(encoder, client):
    with pytest.raises(grpc.RpcError) as err:
        encoder.Score(pb.ScoreRequest(query=QUERY, texts=["ok", LONG], mode=pb.SCORE_MODE_MAXSIM),
                      timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("texts[1]: more than 512 tokens")
    response = encoder.Score(pb.ScoreRequest(query=QUERY, texts=["ok", LONG], truncate=True,
                                             mode=pb.SCORE_MODE_MAXSIM), timeout=60)
    query, short, long = embedded(client, [QUERY, "ok", LONG], truncate=True)
    assert len(long.token_ids) == 512
    q = unit(query.token_embeddings)
    want = [(q @ unit(t.token_embeddings).T).max(axis=1).sum() for t in (short, long)]
    np.testing.assert_allclose(response.scores, want, atol=ATOL * len(q))


@pytest.mark.parametrize("request_, field, reason", [
    (pb.ScoreRequest(query=QUERY, texts=TEXTS), "mode", "SCORE_MODE_UNSPECIFIED; name one"),
    (pb.ScoreRequest(query=QUERY, texts=TEXTS, mode=7), "mode", "unknown value 7"),
    (pb.ScoreRequest(query=QUERY, mode=pb.SCORE_MODE_COSINE), "texts", "empty"),
    (pb.ScoreRequest(texts=TEXTS, mode=pb.SCORE_MODE_MAXSIM), "query", "empty"),
])
def test_bad_input_names_the_field(encoder, request_, field, reason):
    with pytest.raises(grpc.RpcError) as err:
        encoder.Score(request_, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: ") and reason in err.value.details()


@pytest.mark.workers
def test_tei_similarity(minilm_server, client):
    status, scores = post_json(minilm_server, "/similarity",
                               {"inputs": {"source_sentence": QUERY, "sentences": TEXTS}})
    assert status == 200
    query, *texts = embedded(client, [QUERY, *TEXTS])
    np.testing.assert_allclose(scores, unit(np.stack([t.pooled for t in texts])) @ unit(query.pooled),
                               atol=ATOL)
    for body, reason in (({"inputs": {"source_sentence": QUERY, "sentences": []}},
                          "inputs.sentences: empty"),
                         ({"inputs": {"sentences": TEXTS}}, "inputs.source_sentence: required"),
                         ({"inputs": {"source_sentence": QUERY, "sentences": ["ok", LONG]}},
                          "inputs.sentences[1]: more than 512 tokens"),
                         ({"inputs": "x"}, "inputs: expected an object, got a string")):
        status, answer = post_json(minilm_server, "/similarity", body)
        assert status == 422 and answer["error"].startswith(reason), answer  # TEI's status
        assert answer["error_type"] == "Validation"


def test_tei_similarity_reads_teis_parameters(minilm_server, client):
    """TEI's SimilarityRequest: truncate, truncation_direction and prompt_name in
    `parameters`, each as Embed takes it; a truncate beside `inputs` is no field of TEI's,
    ignored as TEI ignores it."""
    long = "Stock markets fell sharply on Monday. " * 60 + LONG  # markets first, cats last
    sentences = {"inputs": {"source_sentence": QUERY, "sentences": ["ok", long]}}
    status, answer = post_json(minilm_server, "/similarity", sentences | {"truncate": True})
    assert status == 422 and answer["error"].startswith("inputs.sentences[1]: more than 512")
    query = embedded(client, [QUERY])[0].pooled
    scored = {}
    for side in ("Right", "left"):
        status, scored[side] = post_json(minilm_server, "/similarity", sentences | {"parameters": {
            "truncate": True, "truncation_direction": side}})
        assert status == 200, scored[side]
        cut = client.embed(["ok", long], pooling="mean", truncate=True,
                           truncation_direction=side.lower())
        np.testing.assert_allclose(scored[side], unit(np.stack([t.pooled for t in cut]))
                                   @ unit(query), atol=ATOL)
    assert scored["left"][1] > scored["Right"][1] + 0.1  # the end is about cats
    status, answer = post_json(minilm_server, "/similarity", sentences | {"parameters": {
        "prompt_name": "query"}})
    assert status == 422 and answer["error"].startswith("prompt_name: 'query' is not a prompt")
