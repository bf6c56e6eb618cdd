"""Promise: each HTTP protocol treats a field it does not know as its peer's server does.
OpenAI's API ("Unrecognized request argument supplied") and Cohere's ("unknown field")
refuse it, with 400 naming the field and the fields known; Infinity's pydantic models,
TEI's serde types and KServe's pydantic models ignore it, at the top of a body and inside
its objects alike, and answer as without it."""

import json

import pytest

from attnserve.artifact import load_artifact
from tests.server.test_http import post

TEXT = "attention is all you need"


@pytest.fixture(scope="module")
def model(tiny_artifact) -> str:
    return load_artifact(tiny_artifact).manifest.model_name


@pytest.mark.parametrize("path, body, field", [
    ("/v1/embeddings", {"input": TEXT, "top_k": 3}, "top_k"),
    ("/v1/embeddings", {"input": TEXT, "chunking": {"max_tokens": 8, "size": 3}}, "chunking.size"),
    ("/v1/rerank", {"query": TEXT, "documents": [TEXT], "top_k": 1}, "top_k"),
    ("/v2/rerank", {"query": TEXT, "documents": [TEXT], "return_text": True}, "return_text"),
])
def test_openai_and_cohere_refuse_a_field_they_do_not_know(tiny_server, path, body, field):
    status, answer = post(tiny_server.http_url + path, json.dumps(body).encode())
    message = answer["error"]["message"] if path.startswith("/v1/embeddings") else answer["message"]
    assert status == 400 and message.startswith(f"{field}: unknown field; known: "), answer
    if path == "/v1/embeddings":
        assert answer["error"]["param"] == field


@pytest.mark.parametrize("path, body, extra", [
    ("/embeddings", {"input": TEXT}, {"top_n": 3}),
    ("/embed", {"inputs": TEXT}, {"normalise": False}),
    ("/embed_all", {"inputs": TEXT}, {"normalize": True}),
    ("/tokenize", {"inputs": TEXT}, {"add_special": False}),
    ("/decode", {"ids": [101, 102]}, {"skip": True}),
    ("/similarity", {"inputs": {"source_sentence": TEXT, "sentences": [TEXT, "cats"]},
                     "parameters": {"prompt": "x"}}, {"truncate": "anything"}),
    ("/v2/models/{model}/infer", {"inputs": [
        {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [101, 7, 102],
         "quantized": False},
        {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]}]},
     {"priority": "high"}),
])
def test_infinity_tei_and_kserve_ignore_a_field_they_do_not_know(tiny_server, model, path, body,
                                                                 extra):
    url = tiny_server.http_url + path.format(model=model)
    plain = post(url, json.dumps(body).encode())
    with_extra = post(url, json.dumps(body | extra).encode())
    assert plain[0] == 200, plain
    if path == "/embeddings":  # its id and creation time differ from call to call
        for answer in (plain[1], with_extra[1]):
            del answer["id"], answer["created"]
    assert with_extra == plain
