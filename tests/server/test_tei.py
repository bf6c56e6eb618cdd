"""TEI's HTTP API through the clients people use against TEI, unchanged:
huggingface_hub's InferenceClient (feature_extraction, which posts to the root),
langchain-huggingface's HuggingFaceEndpointEmbeddings and LlamaIndex's
TextEmbeddingsInference (POST /embed), every vector equal to sentence-transformers';
/embed_all against Hugging Face's BertModel, /tokenize and /decode against its tokenizer,
/info, and every refusal in TEI's shape and status naming the field."""

import asyncio
import json
import urllib.error
import urllib.request

import huggingface_hub
import numpy as np
import pytest
from huggingface_hub import InferenceClient
from langchain_huggingface import HuggingFaceEndpointEmbeddings
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

from tests.harness import minilm_dir
from tests.hugging_face import HuggingFace
from tests.server.test_http import LONG_TEXT, MODEL, post, post_json

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

TEXTS = ["The cat sat on the mat.", "attention is all you need", "Ünïcödé wörds, 服务 and emoji 🙂."]
# The vectors a caller gets against sentence-transformers' (cosine, both normalised).
COSINE = 0.9999
# Token vectors against BertModel's hidden states, both float32 (test_encoder_api's bound).
HIDDEN_ATOL = 2e-5


@pytest.fixture(scope="module")
def reference(monkeypatch_module):
    """sentence-transformers on MiniLM's own weights, loaded with the Hub offline."""
    from sentence_transformers import SentenceTransformer

    monkeypatch_module.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    monkeypatch_module.undo()
    return model


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture
def online(monkeypatch):
    """The clients below refuse every URL, the loopback server's too, while
    HF_HUB_OFFLINE is set (as other tests set it): unset, as a TEI user has it."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def hf():
    return HuggingFace(minilm_dir())


def st_vectors(reference, texts: list[str]) -> np.ndarray:
    return reference.encode(texts)


def assert_same(got, expected: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    cosine = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected,
                                                                                         axis=-1)
    assert cosine.min() >= COSINE, cosine


def test_huggingface_hub_feature_extraction(minilm_server, reference, hf, online):
    client = InferenceClient(base_url=minilm_server.http_url, timeout=60)
    assert_same(client.feature_extraction(TEXTS[0]), st_vectors(reference, TEXTS[:1]))
    assert_same(client.feature_extraction(TEXTS), st_vectors(reference, TEXTS))
    # Not normalised: the mean of BertModel's token vectors (MiniLM's sentence-transformers
    # pipeline always normalises).
    raw = client.feature_extraction(TEXTS, normalize=False, truncate=True)
    means = np.stack([hf.run(hf.ids(text))[0].mean(axis=0) for text in TEXTS])
    np.testing.assert_allclose(raw, means, atol=HIDDEN_ATOL)
    assert np.linalg.norm(raw, axis=-1).min() > 2


def test_langchain_endpoint_embeddings(minilm_server, reference, online):
    embeddings = HuggingFaceEndpointEmbeddings(model=minilm_server.http_url)
    assert_same(embeddings.embed_documents(TEXTS), st_vectors(reference, TEXTS))
    assert_same([embeddings.embed_query(TEXTS[1])], st_vectors(reference, TEXTS[1:2]))
    assert_same(asyncio.run(embeddings.aembed_documents(TEXTS)), st_vectors(reference, TEXTS))


def test_llama_index_text_embeddings_inference(minilm_server, reference):
    embeddings = TextEmbeddingsInference(model_name=MODEL, base_url=minilm_server.http_url,
                                         timeout=60)
    assert_same(embeddings.get_text_embedding_batch(TEXTS), st_vectors(reference, TEXTS))
    assert_same([embeddings.get_query_embedding(TEXTS[2])], st_vectors(reference, TEXTS[2:]))
    assert_same([asyncio.run(embeddings.aget_text_embedding(TEXTS[0]))],
                st_vectors(reference, TEXTS[:1]))


@pytest.mark.workers
def test_embed_takes_token_ids_and_truncates_on_request(minilm_server, hf, reference):
    ids = [hf.ids(text) for text in TEXTS]
    status, by_ids = post_json(minilm_server, "/embed", {"inputs": ids})
    assert status == 200
    assert_same(by_ids, st_vectors(reference, TEXTS))
    status, one = post_json(minilm_server, "/embed", {"inputs": ids[1]})
    assert status == 200 and len(one) == 1
    assert_same(one, st_vectors(reference, TEXTS[1:2]))
    status, root = post_json(minilm_server, "/", {"inputs": TEXTS[1], "dimensions": 384,
                                             "truncation_direction": "right", "prompt_name": None})
    assert status == 200
    np.testing.assert_allclose(root, one, atol=1e-6)
    status, cut = post_json(minilm_server, "/embed", {"inputs": LONG_TEXT, "truncate": True})
    assert status == 200 and len(cut[0]) == 384


@pytest.mark.workers
def test_embed_all_is_bert_models_hidden_state(minilm_server, hf):
    status, tokens = post_json(minilm_server, "/embed_all", {"inputs": TEXTS})
    assert status == 200 and len(tokens) == len(TEXTS)
    for text, got in zip(TEXTS, tokens, strict=True):
        hidden, _ = hf.run(hf.ids(text))
        got = np.asarray(got, dtype=np.float32)
        assert got.shape == hidden.shape  # [CLS] and [SEP] included
        assert np.abs(got - hidden).max() <= HIDDEN_ATOL


@pytest.mark.workers
def test_tokenize_is_the_tokenizers_with_byte_offsets(minilm_server, hf):
    status, tokenized = post_json(minilm_server, "/tokenize", {"inputs": TEXTS})
    assert status == 200 and len(tokenized) == len(TEXTS)
    for text, tokens in zip(TEXTS, tokenized, strict=True):
        encoding = hf.tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        assert [t["id"] for t in tokens] == encoding["input_ids"]
        assert [t["special"] for t in tokens] == [bool(m) for m in encoding["special_tokens_mask"]]
        raw = text.encode()
        for token, (start, end) in zip(tokens, encoding["offset_mapping"], strict=True):
            if token["special"]:
                assert token["start"] is None and token["stop"] is None
                assert token["text"] == hf.tokenizer.convert_ids_to_tokens(token["id"])
            else:
                assert token["text"] == text[start:end]
                assert raw[token["start"]:token["stop"]].decode() == text[start:end]
    status, bare = post_json(minilm_server, "/tokenize", {"inputs": TEXTS[2], "add_special_tokens": False})
    assert status == 200
    assert [t["id"] for t in bare[0]] == hf.tokenizer(TEXTS[2], add_special_tokens=False)["input_ids"]
    assert not any(t["special"] for t in bare[0])


def test_decode_is_the_tokenizers(minilm_server, hf):
    ids = [hf.ids(text) for text in TEXTS]
    status, texts = post_json(minilm_server, "/decode", {"ids": ids})
    assert status == 200
    assert texts == [hf.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    status, kept = post_json(minilm_server, "/decode", {"ids": ids[0], "skip_special_tokens": False})
    assert status == 200 and kept == [hf.tokenizer.decode(ids[0])]
    assert kept[0].startswith("[CLS]")


def get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.workers
def test_info_describes_the_default_model_and_root_is_health(minilm_server):
    status, info = get(minilm_server.http_url + "/info")
    assert status == 200
    assert info["model_id"] == info["served_model_name"] == MODEL
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32" and info["max_input_length"] == 512
    assert info["auto_truncate"] is False and len(info["model_sha"]) == 64
    assert {"max_concurrent_requests", "max_batch_tokens", "max_client_batch_size",
            "tokenization_workers", "version"} <= set(info)
    assert get(minilm_server.http_url + "/") == (200, {"status": "serving"})


@pytest.mark.parametrize("route,body,status,kind,needle", [
    ("/embed", {"inputs": []}, 400, "Empty", "inputs: an empty list"),
    ("/embed", {"inputs": ""}, 400, "Empty", "inputs: an empty string"),
    ("/embed", {"inputs": ["a", ""]}, 400, "Empty", "inputs[1]: an empty string"),
    ("/embed", {"inputs": [[101, 102], []]}, 400, "Empty", "inputs[1]: an empty list"),
    ("/", {"inputs": []}, 400, "Empty", "inputs: an empty list"),
    ("/decode", {"ids": []}, 400, "Empty", "ids: an empty list"),
    ("/tokenize", {"inputs": [""]}, 400, "Empty", "inputs[0]: an empty string"),
    ("/embed", {}, 422, "Validation", "inputs: required"),
    ("/embed", {"inputs": "a", "normalize": "yes"}, 422, "Validation",
     "normalize: expected true or false, got a string"),
    ("/embed", {"inputs": "a", "truncate": 1}, 422, "Validation",
     "truncate: expected true or false or null, got an integer"),
    ("/embed", {"inputs": "a", "dimensions": 128}, 422, "Validation", "dimensions: 128"),
    ("/embed", {"inputs": "a", "dimensions": "384"}, 422, "Validation",
     "dimensions: expected an integer or null, got a string"),
    ("/embed", {"inputs": [[101, 102]], "truncation_direction": "Left"}, 422, "Validation",
     "truncation_direction: left truncation keeps a text's special tokens"),
    ("/embed", {"inputs": "a", "truncation_direction": "up"}, 422, "Validation",
     "truncation_direction: 'up'; expected one of 'Left', 'Right', 'left', 'right'"),
    ("/embed", {"inputs": "a", "truncation_direction": ["Left"]}, 422, "Validation",
     "truncation_direction: expected a string, got a list"),
    ("/embed", {"inputs": "a", "truncation_direction": None}, 422, "Validation",
     "truncation_direction: expected a string, got null"),
    ("/embed", {"inputs": "a", "prompt_name": "query"}, 422, "Validation",
     "prompt_name: 'query' is not a prompt of 'all-MiniLM-L6-v2'; it has none"),
    ("/tokenize", {"inputs": "a", "prompt_name": 1}, 422, "Validation",
     "prompt_name: expected a string or null, got an integer"),
    ("/embed", {"inputs": ["a", [101]]}, 422, "Validation", "inputs[1]: [101]; expected a string"),
    ("/embed", {"inputs": [[101, 99999, 102]]}, 422, "Validation",
     "inputs[0][1]: id 99999 is outside the vocabulary"),
    ("/embed", {"inputs": LONG_TEXT}, 422, "Validation", "inputs: more than 512 tokens"),
    ("/tokenize", {"inputs": [101]}, 422, "Validation",
     "inputs[0]: expected a string, got an integer"),
    ("/tokenize", {"inputs": "a", "add_special_tokens": None}, 422, "Validation",
     "add_special_tokens: expected true or false, got null"),
    ("/decode", {"ids": [[101], [1.5]]}, 422, "Validation",
     "ids[1][0]: expected an integer, got a number"),
    ("/decode", {"ids": [101, -1]}, 422, "Validation", "ids[1]: id -1 is outside the vocabulary"),
    ("/decode", {"ids": [101, [102]]}, 422, "Validation", "ids[1]: [102]; expected an integer"),
    ("/decode", {"ids": "101"}, 422, "Validation", "ids: expected a list, got a string"),
    ("/decode", [101], 422, "Validation", "body: expected an object, got a list"),
])
def test_bad_input_gets_teis_error_naming_the_field(minilm_server, route, body, status, kind,
                                                    needle):
    got, error = post_json(minilm_server, route, body)
    assert (got, set(error)) == (status, {"error", "error_type"}), error
    assert error["error_type"] == kind and error["error"].startswith(needle), error


def test_the_ports_own_refusals_come_in_teis_shape(minilm_server):
    status, error = post(minilm_server.http_url + "/embed", b"{not json")
    assert (status, error["error_type"]) == (422, "Validation") and error["error"].startswith("body")
    status, error = post(minilm_server.http_url + "/embed", b'{"inputs": "a"}',
                         {"Content-Type": "text/plain"})
    assert (status, error["error_type"]) == (415, "Validation")
    huge = json.dumps({"inputs": "a" * (5 << 20)}).encode()
    status, error = post(minilm_server.http_url + "/embed", huge)
    assert (status, error["error_type"]) == (413, "Validation")
    status, error = get(minilm_server.http_url + "/embed")
    assert (status, error["error_type"]) == (405, "Validation") and "use POST" in error["error"]
