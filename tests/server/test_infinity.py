"""Infinity's routes, as its users call them: the `openai` package pointed at the server's
root (Infinity serves OpenAI's API without /v1), POST /embeddings and GET /models with
Infinity's own fields, bodies valid against Infinity's own schemas (from its OpenAPI
document, infinity-emb 0.0.77), vectors equal to /v1/embeddings'; and a field a route
does not know refused naming it, on OpenAI's route too."""

import json
import urllib.request

import jsonschema
import numpy as np
import openai
import pytest

from tests.server.test_http import MODEL, TEXTS, post

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

# Infinity's schemas of its answers, as its OpenAPI document defines them.
EMBEDDING_RESULT = {
    "type": "object", "required": ["data", "model", "usage"],
    "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {"type": "array", "items": {
            "type": "object", "required": ["embedding", "index"],
            "properties": {"object": {"type": "string", "enum": ["embedding"]},
                           "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                                   {"type": "string"}]},
                           "index": {"type": "integer"}}}},
        "model": {"type": "string"},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
            "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
        "id": {"type": "string"}, "created": {"type": "integer"}}}
MODEL_INFO = {
    "type": "object", "required": ["data"],
    "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "stats"],
        "properties": {"id": {"type": "string"}, "stats": {"type": "object"},
                       "object": {"type": "string", "enum": ["model"]},
                       "owned_by": {"type": "string", "enum": ["infinity"]},
                       "created": {"type": "integer"}, "backend": {"type": "string"},
                       "capabilities": {"type": "array", "items": {"type": "string"},
                                        "uniqueItems": True}}}}}}


def at_root(server) -> openai.OpenAI:
    """As Infinity's README has it: OpenAI(base_url="http://localhost:7997/")."""
    return openai.OpenAI(base_url=server.http_url, api_key="x", max_retries=0)


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_openai_client_at_the_root_lists_and_embeds(minilm_server):
    client = at_root(minilm_server)
    assert [m.id for m in client.models.list()] == [MODEL]
    by_infinity = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    by_openai = openai.OpenAI(base_url=minilm_server.http_url + "/v1", api_key="x",
                              max_retries=0).embeddings.create(model=MODEL, input=TEXTS,
                                                               encoding_format="float")
    np.testing.assert_array_equal(vectors(by_infinity), vectors(by_openai))
    assert by_infinity.usage == by_openai.usage
    # The package's own default, base64, decoded by it.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)
    np.testing.assert_array_equal(vectors(decoded), vectors(by_openai))


def test_infinitys_fields_both_ways(minilm_server):
    status, body = post(minilm_server.http_url + "/embeddings", json.dumps({
        "input": TEXTS[0], "model": "default/not-specified", "dimensions": 0,
        "modality": "text", "encoding_format": "float"}).encode())
    assert status == 200, body
    jsonschema.validate(body, EMBEDDING_RESULT)
    assert body["model"] == MODEL and body["id"] and body["created"] > 0
    assert len(body["data"][0]["embedding"]) == 384
    with urllib.request.urlopen(minilm_server.http_url + "/models", timeout=30) as response:
        listed = json.loads(response.read())
    jsonschema.validate(listed, MODEL_INFO)
    (model,) = listed["data"]
    assert model["id"] == MODEL and model["capabilities"] == ["embed"]
    assert model["backend"] == "onnxruntime_onnx"


@pytest.mark.parametrize("route,body,param,needle", [
    ("/embeddings", {"input": "hi", "modality": "image"}, "modality", "embeds text only"),
    ("/embeddings", {"input": "hi", "dimensions": 7}, "dimensions", "one size, 384"),
    ("/embeddings", {"input": "hi", "dimensions": False}, "dimensions",
     "expected an integer or null, got true or false"),
    ("/embeddings", {"input": "hi", "model": "bge-small"}, "model", "unknown model 'bge-small'"),
    ("/embeddings", {"input": []}, "input", "not empty"),
    ("/v1/embeddings", {"input": "hi", "modality": "text"}, "modality", "unknown field"),
    ("/v1/embeddings", {"input": "hi", "model": MODEL, "extra": 1}, "extra", "unknown field"),
])
def test_bad_fields_are_refused_naming_them(minilm_server, route, body, param, needle):
    status, error = post(minilm_server.http_url + route, json.dumps(body).encode())
    assert status in (400, 404), error
    assert error["error"]["param"] == param and needle in error["error"]["message"], error
