"""Output types per request, through the real MiniLM server and the clients people use:
Cohere's embedding_types on OpenAI's door and embedding_type on gRPC, each quantized
vector equal, byte for byte, to what sentence-transformers' quantize_embeddings makes of
the float vector the server returns beside it (int8 and uint8 given the calibration
embeddings the export fitted its ranges on); float16 as base64; every refusal naming its
field; an artifact exported without ranges refusing int8 and uint8 only."""

import base64
import json
import shutil
import urllib.error
import urllib.request

import grpc
import numpy as np
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sentence_transformers.util import quantize_embeddings

from attnserve.artifact import MANIFEST, load_artifact
from attnserve.client import EncoderClient
from attnserve.export.embedding_ranges import calibration_embeddings
from attnserve.export.int8_texts import CALIBRATION_TEXTS, PARITY_TEXTS
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from tests.harness import ServerProcess

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

# Varied texts the ranges were not fitted on: some of their values fall outside the
# calibration ranges, so the clipping to levels 0 and 255 is exercised too.
TEXTS = list(PARITY_TEXTS)
TYPES = ["float", "int8", "uint8", "binary", "ubinary"]
ST_DTYPES = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def post(server: ServerProcess, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.http_url + "/v1/embeddings",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def calibration(minilm_artifact) -> dict[str, np.ndarray]:
    """The export's calibration embeddings of each pooled output, recomputed as the
    export computes them, from the artifact's own graph."""
    manifest = load_artifact(minilm_artifact).manifest
    graph = manifest.graph(attention=False, precision="fp32").file
    return calibration_embeddings(minilm_artifact / graph, minilm_artifact / "tokenizer.json",
                                  manifest.max_positions)


def test_the_manifest_holds_the_ranges_of_the_calibration_embeddings(minilm_artifact, calibration):
    fitted = load_artifact(minilm_artifact).manifest.embedding_ranges
    assert fitted.texts == len(CALIBRATION_TEXTS)
    assert sorted(fitted.ranges) == sorted(calibration)
    for name, rows in calibration.items():
        ranges = np.asarray(fitted.ranges[name], dtype=np.float32)
        np.testing.assert_array_equal(ranges, np.vstack([rows.min(axis=0), rows.max(axis=0)]))


@pytest.mark.workers
def test_openai_door_types_equal_sentence_transformers(minilm_server, calibration):
    status, body = post(minilm_server, {"input": TEXTS, "embedding_types": TYPES,
                                        "encoding_format": "float"})
    assert status == 200
    items = body["data"]
    assert [d["index"] for d in items] == list(range(len(TEXTS)))
    assert all(d["embedding"] == [] and list(d["embeddings"]) == TYPES for d in items)
    floats = np.array([d["embeddings"]["float"] for d in items], dtype=np.float32)
    # The float vectors are those OpenAI's own field carries without embedding_types.
    _, plain = post(minilm_server, {"input": TEXTS})
    np.testing.assert_array_equal(floats, np.array([d["embedding"] for d in plain["data"]],
                                                   dtype=np.float32))
    clipped = 0
    for kind in TYPES[1:]:
        got = np.array([d["embeddings"][kind] for d in items])
        want = quantize_embeddings(floats, kind,
                                   calibration_embeddings=calibration["pooled_mean_normalized"])
        assert want.dtype == ST_DTYPES[kind]
        np.testing.assert_array_equal(got, want, err_msg=kind)
        if kind == "uint8":
            clipped = int(((got == 0) | (got == 255)).sum())
    assert clipped > 0, "no value fell outside the calibration ranges: clipping went untested"


@pytest.mark.workers
def test_base64_carries_the_same_bytes(minilm_server):
    texts = TEXTS[:6]
    _, listed = post(minilm_server, {"input": texts, "embedding_types": TYPES,
                                     "encoding_format": "float"})
    _, encoded = post(minilm_server, {"input": texts, "embedding_types": TYPES,
                                      "encoding_format": "base64"})
    for as_lists, as_base64 in zip(listed["data"], encoded["data"], strict=True):
        assert as_base64["embedding"] == ""
        for kind in TYPES:
            dtype = "<f4" if kind == "float" else ST_DTYPES[kind]
            decoded = np.frombuffer(base64.b64decode(as_base64["embeddings"][kind]), dtype=dtype)
            np.testing.assert_array_equal(decoded, np.array(as_lists["embeddings"][kind], dtype=dtype))


@pytest.mark.workers
def test_float16_base64_through_the_openai_client(minilm_server):
    client = openai.OpenAI(base_url=minilm_server.http_url + "/v1", api_key="x", max_retries=0)
    texts = TEXTS[:4]
    full = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    half = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="base64",
                                    extra_body={"embedding_dtype": "float16"})
    for f32, f16 in zip(full.data, half.data, strict=True):
        raw = base64.b64decode(f16.embedding)
        assert len(raw) == 2 * 384
        np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f2"),
                                      np.array(f32.embedding, dtype=np.float32).astype(np.float16))
    # The client asking base64 by itself (no encoding_format) still reads the typed answer.
    typed = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts,
                                     extra_body={"embedding_types": ["ubinary"]})
    assert typed.data[0].embedding == []
    assert len(base64.b64decode(typed.data[0].model_extra["embeddings"]["ubinary"])) == 48


@pytest.mark.workers
def test_chunks_carry_their_types(minilm_server, calibration):
    text = " ".join(TEXTS[10:30])
    status, body = post(minilm_server, {"input": [text], "chunking": {"max_tokens": 48},
                                        "embedding_types": ["float", "int8", "binary"]})
    assert status == 200 and len(body["data"]) > 2
    floats = np.array([d["embeddings"]["float"] for d in body["data"]], dtype=np.float32)
    for kind in ("int8", "binary"):
        np.testing.assert_array_equal(
            np.array([d["embeddings"][kind] for d in body["data"]]),
            quantize_embeddings(floats, kind,
                                calibration_embeddings=calibration["pooled_mean_normalized"]))


@pytest.mark.workers
@pytest.mark.parametrize("pooling, normalize", [("mean", False), ("mean", True), ("cls", False)])
def test_grpc_embedding_type_equals_sentence_transformers(minilm_server, calibration, pooling,
                                                          normalize):
    texts = TEXTS[:24]
    with EncoderClient(minilm_server.address) as client:
        floats = np.stack([e.pooled for e in client.embed(texts, pooling=pooling,
                                                          normalize=normalize)])
        source = f"pooled_{pooling}" + ("_normalized" if normalize else "")
        for kind in TYPES[1:]:
            got = np.stack([e.pooled for e in client.embed(texts, pooling=pooling,
                                                           normalize=normalize,
                                                           embedding_type=kind)])
            want = quantize_embeddings(floats, kind, calibration_embeddings=calibration[source])
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want, err_msg=kind)


@pytest.mark.workers
def test_grpc_chunks_and_wire_dtypes(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        response = stub.Embed(pb.EmbedRequest(texts=[" ".join(TEXTS[:20])], normalize=True,
                                              chunking=pb.Chunking(max_tokens=64),
                                              embedding_type=pb.EMBEDDING_TYPE_BINARY))
        chunks = response.embeddings[0].chunks
        assert len(chunks) > 1
        assert all(c.pooled.dtype == pb.DTYPE_BINARY and list(c.pooled.shape) == [48]
                   and len(c.pooled.data) == 48 for c in chunks)
        uint8 = stub.Embed(pb.EmbedRequest(texts=["a"], embedding_type=pb.EMBEDDING_TYPE_UINT8))
        assert uint8.embeddings[0].pooled.dtype == pb.DTYPE_UINT8


@pytest.mark.parametrize("body, param, needle", [
    ({"embedding_types": ["float", "int4"]}, "embedding_types[1]",
     "'int4'; expected one of 'binary', 'float', 'int8', 'sparse', 'ubinary', 'uint8'"),
    ({"embedding_types": ["int8", "int8"]}, "embedding_types[1]", "listed twice"),
    ({"embedding_types": "int8"}, "embedding_types", "expected a list or null, got a string"),
    ({"embedding_types": []}, "embedding_types", "expected a list of length >= 1"),
    ({"encoding_format": "hex"}, "encoding_format", "expected one of 'base64', 'float'"),
    ({"embedding_dtype": "bfloat16"}, "embedding_dtype", "expected one of 'float16', 'float32'"),
    ({"embedding_dtype": "float16"}, "embedding_dtype", "base64 only"),
])
def test_openai_door_refuses_unknown_types_naming_the_field(minilm_server, body, param, needle):
    status, answer = post(minilm_server, {"input": "hello", **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and needle in answer["error"]["message"]


@pytest.mark.parametrize("request_fields, field, needle", [
    ({"embedding_type": 99}, "embedding_type", "unknown value 99"),
    ({"dtype": pb.DTYPE_INT8}, "dtype", "set embedding_type"),
    ({"embedding_type": pb.EMBEDDING_TYPE_INT8, "pooling": pb.POOLING_NONE,
      "return_token_embeddings": True}, "embedding_type", "POOLING_NONE"),
])
def test_grpc_refuses_naming_the_field(minilm_server, request_fields, field, needle):
    with grpc.insecure_channel(minilm_server.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.EncoderServiceStub(channel).Embed(pb.EmbedRequest(texts=["a"], **request_fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in caught.value.details()
    detail = error_details_pb2.BadRequest()
    rpc_status.from_call(caught.value).details[0].Unpack(detail)
    assert detail.field_violations[0].field == field


def test_an_artifact_without_ranges_refuses_int8_and_uint8_only(tmp_path, tiny_artifact):
    """An artifact of an exporter before the ranges (format_version 3) still serves floats
    and the sign bits; int8 and uint8 are refused, naming the field and the re-export."""
    old = tmp_path / "old"
    shutil.copytree(tiny_artifact, old)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["embedding_ranges"]
    manifest["format_version"] = 3
    (old / MANIFEST).write_text(json.dumps(manifest))
    with ServerProcess(old) as server:
        for kind in ("int8", "uint8"):
            status, answer = post(server, {"input": "hello", "embedding_types": ["float", kind]})
            assert status == 400 and answer["error"]["param"] == "embedding_types"
            assert "export it again" in answer["error"]["message"]
        status, answer = post(server, {"input": "hello", "embedding_types": ["binary"]})
        assert status == 200 and len(answer["data"][0]["embeddings"]["binary"]) == 4
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.EncoderServiceStub(channel).Embed(pb.EmbedRequest(
                    texts=["a"], embedding_type=pb.EMBEDDING_TYPE_UINT8))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("embedding_type: uint8 needs the embedding ranges")
