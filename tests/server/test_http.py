"""The HTTP port, through the clients people already have: the `openai` package against
/v1/embeddings (vectors equal to gRPC Embed's), `tritonclient.http` against KServe v2 REST
(outputs equal to gRPC ModelInfer's), every refusal with its documented status and shape,
drain, and a burst of 200 parallel scrapes of /metrics."""

import base64
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import openai
import pytest
import tritonclient.http as triton_http

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import ServerProcess, delta, sample

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The cat sat on the mat.", "attention is all you need", "a"]
LONG_TEXT = "word " * 600
IDS = np.array([[101, 7592, 2088, 999, 102], [101, 2748, 102, 0, 0]], dtype=np.int64)
MASK = (IDS != 0).astype(np.int64)
SCRAPERS = 200


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post_json(server, path: str, body) -> tuple[int, object]:
    """`body` as JSON to the server's HTTP port at `path`: the status and the JSON answer."""
    return post(server.http_url + path, json.dumps(body).encode())


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def encoder(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        yield pb_grpc.EncoderServiceStub(channel)


def grpc_vectors(encoder, **request) -> tuple[np.ndarray, int]:
    response = encoder.Embed(pb.EmbedRequest(normalize=True, **request))
    return (np.stack([np.frombuffer(e.pooled.data, dtype="<f4") for e in response.embeddings]),
            response.total_tokens)


def openai_vectors(response, encoding: str) -> np.ndarray:
    if encoding == "base64":
        return np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in response.data])
    return np.array([d.embedding for d in response.data], dtype=np.float32)


@pytest.fixture(scope="module")
def tokenized(encoder) -> list[list[int]]:
    return [list(t.ids) for t in encoder.Tokenize(pb.TokenizeRequest(texts=TEXTS)).tokenizations]


@pytest.mark.workers
@pytest.mark.parametrize("encoding", ["float", "base64"])
@pytest.mark.parametrize("form", ["string", "strings", "token_ids", "token_ids_with_id_0",
                                  "lists_of_token_ids"])
def test_openai_client_gets_the_grpc_embed_vectors(minilm_server, encoder, tokenized, encoding, form):
    given, grpc_request = {
        "string": (TEXTS[0], {"texts": TEXTS[:1]}),
        "strings": (TEXTS, {"texts": TEXTS}),
        "token_ids": (tokenized[1], {"token_ids": [pb.TokenIds(ids=tokenized[1])]}),
        "token_ids_with_id_0": ([0, *tokenized[1]], {"token_ids": [pb.TokenIds(ids=[0, *tokenized[1]])]}),
        "lists_of_token_ids": (tokenized, {"token_ids": [pb.TokenIds(ids=t) for t in tokenized]}),
    }[form]
    response = client(minilm_server).embeddings.create(model=MODEL, input=given,
                                                       encoding_format=encoding, user="ignored")
    expected, tokens = grpc_vectors(encoder, **grpc_request)
    got = openai_vectors(response, encoding)
    assert got.shape == expected.shape and got.shape[1] == 384
    assert np.abs(got - expected).max() <= 1e-6
    assert [d.index for d in response.data] == list(range(len(expected)))
    assert response.object == "list" and response.model == MODEL
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_openai_client_default_and_exact_json_shape(minilm_server, encoder):
    # The client asks for base64 when no format is given and decodes it itself.
    decoded = client(minilm_server).embeddings.create(model=MODEL, input=TEXTS)
    expected, _ = grpc_vectors(encoder, texts=TEXTS)
    assert np.abs(np.array([d.embedding for d in decoded.data]) - expected).max() <= 1e-6
    status, body = post(minilm_server.http_url + "/v1/embeddings",
                        json.dumps({"input": "hi", "model": MODEL}).encode())
    assert status == 200 and set(body) == {"object", "data", "model", "usage"}
    assert set(body["data"][0]) == {"object", "index", "embedding"}
    assert body["data"][0]["object"] == "embedding" and len(body["data"][0]["embedding"]) == 384
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def grpc_model_infer(server: ServerProcess, outputs: list[str]) -> dict[str, np.ndarray]:
    # Our own stubs, not tritonclient.grpc: its `inference` protos clash with ours in one process.
    request = kpb.ModelInferRequest(model_name=MODEL)
    for name, array in (("input_ids", IDS), ("attention_mask", MASK)):
        request.inputs.add(name=name, datatype="INT64", shape=array.shape)
        request.raw_input_contents.append(array.astype("<i8").tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    with grpc.insecure_channel(server.address) as channel:
        response = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    return {o.name: np.frombuffer(raw, dtype="<f4").reshape(tuple(o.shape))
            for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}


@pytest.mark.workers
def test_tritonclient_http_matches_grpc_model_infer(minilm_server):
    http = triton_http.InferenceServerClient(url=f"127.0.0.1:{minilm_server.http_port}")
    assert http.is_server_live() and http.is_server_ready() and http.is_model_ready(MODEL)
    meta = http.get_model_metadata(MODEL)
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]
    assert http.get_server_metadata()["name"] == "attnserve"
    wanted = ["last_hidden_state", "attentions.4"]
    expected = grpc_model_infer(minilm_server, wanted)

    def inputs(binary: bool) -> list[triton_http.InferInput]:
        made = []
        for name, array in (("input_ids", IDS), ("attention_mask", MASK)):
            made.append(triton_http.InferInput(name, list(array.shape), "INT64"))
            made[-1].set_data_from_numpy(array, binary_data=binary)
        return made

    for binary in (True, False):
        result = http.infer(MODEL, inputs(binary), request_id="r-1",
                            outputs=[triton_http.InferRequestedOutput(n, binary_data=binary)
                                     for n in wanted])
        assert result.get_response()["id"] == "r-1"
        for name in wanted:
            got = result.as_numpy(name)
            assert got.shape == expected[name].shape, (binary, name)
            assert np.abs(got - expected[name]).max() <= 1e-6, (binary, name)
    # No outputs named: the default output (from the graph without attention outputs), as
    # binary data (tritonclient's own default).
    default = http.infer(MODEL, inputs(True)).as_numpy("last_hidden_state")
    assert np.abs(default - grpc_model_infer(minilm_server, [])["last_hidden_state"]).max() <= 1e-6


def test_tritonclient_http_with_model_version_1(minilm_server):
    """The versioned routes: the model's one version, "1", as its metadata lists it."""
    http = triton_http.InferenceServerClient(url=f"127.0.0.1:{minilm_server.http_port}")
    assert http.is_model_ready(MODEL, model_version="1")
    assert not http.is_model_ready(MODEL, model_version="2")
    assert http.get_model_metadata(MODEL, model_version="1")["versions"] == ["1"]
    inputs = []
    for name, array in (("input_ids", IDS), ("attention_mask", MASK)):
        inputs.append(triton_http.InferInput(name, list(array.shape), "INT64"))
        inputs[-1].set_data_from_numpy(array)
    got = http.infer(MODEL, inputs, model_version="1").as_numpy("last_hidden_state")
    assert np.abs(got - grpc_model_infer(minilm_server, [])["last_hidden_state"]).max() <= 1e-6


KSERVE_CLIENT = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

base, model, ids = sys.argv[1], sys.argv[2], np.array(json.loads(sys.argv[3]), dtype=np.int64)
async def calls():
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    try:
        health = [await client.is_server_live(base), await client.is_server_ready(base),
                  await client.is_model_ready(base, model)]
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", (ids != 0).astype(np.int64))):
            tensor = InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array, binary_data=False)
            inputs.append(tensor)
        response = await client.infer(base, InferRequest(model, inputs, request_id="k-1"),
                                      model_name=model)
        return health, response.id, response.outputs[0].as_numpy().tolist()
    finally:
        await client.close()
print(json.dumps(asyncio.run(calls())))
"""


def test_kserve_inference_rest_client(minilm_server):
    """KServe's own REST client, as KServe tooling calls a v2 server. In a process of its
    own: kserve's generated stubs of the same protocol clash with the server's in one
    process's protobuf registry."""
    out = subprocess.run([sys.executable, "-c", KSERVE_CLIENT, minilm_server.http_url, MODEL,
                          json.dumps(IDS.tolist())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    health, request_id, hidden = json.loads(out.stdout)
    assert health == [True, True, True] and request_id == "k-1"
    expected = grpc_model_infer(minilm_server, [])["last_hidden_state"]
    assert np.abs(np.asarray(hidden, dtype=np.float32) - expected).max() <= 1e-6


def with_model(**fields) -> dict:
    return {"model": MODEL, **fields}


@pytest.mark.parametrize("body,param,needle", [
    (with_model(input=[]), "input", "not empty"),
    (with_model(input="hi", dimensions=7), "dimensions", "one size, 384"),
    (with_model(input="hi", encoding_format="int8"), "encoding_format",
     "'int8'; expected one of 'base64', 'float'"),
    (with_model(input=[[101, 99999, 102]]), "input[0][1]", "outside the vocabulary"),
    (with_model(input=[101, 99999, 102]), "input[1]", "outside the vocabulary"),
    (with_model(input=["a", 1]), "input[1]", "expected a string"),
    (with_model(input=[[101, 102], [1.5]]), "input[1][0]", "expected an integer, got a number"),
    (with_model(input=[LONG_TEXT]), "input[0]", "longer than the model's 512 positions"),
    (with_model(input=LONG_TEXT), "input", "longer than the model's 512 positions"),
    (with_model(), "input", "required"),
    ({"input": "hi", "model": 7}, "model", "expected a string"),
    (with_model(input=""), "input", "empty string"),
    (with_model(input=["a", ""]), "input[1]", "empty string"),
    (with_model(input=[True, False]), "input[0]", "got true or false"),
    (with_model(input=[[101, True]]), "input[0][1]", "expected an integer, got true or false"),
    (with_model(input=[101, 2 ** 64 - 1]), "input[1]", "outside the vocabulary"),
    (with_model(input=[101, 10 ** 30]), "input[1]", "outside the vocabulary"),
    (with_model(input="hi", chunking={"max_tokens": "a"}), "chunking.max_tokens",
     "expected an integer, got a string"),
    (with_model(input="hi", chunking={}), "chunking.max_tokens", "required"),
    ([1, 2], "body", "expected an object, got a list"),
])
def test_openai_bad_input_is_400_naming_the_param(minilm_server, body, param, needle):
    status, error = post(minilm_server.http_url + "/v1/embeddings", json.dumps(body).encode())
    assert status == 400, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
    assert needle in error["error"]["message"]


def test_openai_errors_reach_the_client_as_its_exceptions(minilm_server):
    with pytest.raises(openai.BadRequestError) as bad:
        client(minilm_server).embeddings.create(model=MODEL, input="hi", dimensions=128)
    assert bad.value.param == "dimensions"
    with pytest.raises(openai.NotFoundError) as missing:
        client(minilm_server).embeddings.create(model="text-embedding-3-small", input="hi")
    assert missing.value.code == "model_not_found" and MODEL in missing.value.message
    status, error = post(minilm_server.http_url + "/v1/embeddings", b"{not json")
    assert status == 400 and error["error"]["param"] == "body"
    # truncate=true (beyond OpenAI's fields) cuts instead of refusing.
    cut = client(minilm_server).embeddings.create(model=MODEL, input=LONG_TEXT,
                                                  extra_body={"truncate": True})
    assert cut.usage.total_tokens == 512


@pytest.mark.parametrize("change,status,needle", [
    (lambda h: h["inputs"][0].update(datatype="INT32"), 400, "datatype 'INT32', expected INT64"),
    (lambda h: h["inputs"][0].update(data=[1.5] * 10), 400, "1.5 is not an INT64 value"),
    (lambda h: h["inputs"][0].update(data=[True] * 10), 400, "True is not an INT64 value"),
    (lambda h: h["inputs"][0].update(shape=[True, 5]), 400,
     "inputs[0].shape[0]: expected an integer, got true or false"),
    (lambda h: h["inputs"][1].update(data=[1, 1, 1, 1, 1, 1, 1, 0, 1, 0]), 400, "ones then zeros"),
    (lambda h: h.update(outputs=[{"name": "attentions.9"}]), 400, "unknown output 'attentions.9'"),
    (lambda h: h["inputs"].pop(), 400, "expected exactly"),
])
def test_kserve_bad_input_is_400_with_the_grpc_message(minilm_server, change, status, needle):
    header = {"inputs": [{"name": n, "datatype": "INT64", "shape": list(a.shape), "data": a.tolist()}
                         for n, a in (("input_ids", IDS), ("attention_mask", MASK))]}
    change(header)
    got, error = post(f"{minilm_server.http_url}/v2/models/{MODEL}/infer", json.dumps(header).encode())
    assert got == status and needle in error["error"], error


def test_kserve_unknown_model_is_404(minilm_server):
    status, error = post(minilm_server.http_url + "/v2/models/nope/infer", b"{}")
    assert status == 404 and "nope" in error["error"]
    assert get(minilm_server.http_url + "/v2/models/nope/ready") == 404
    assert get(minilm_server.http_url + "/health") == 200


@pytest.mark.workers
def test_http_calls_are_counted_by_route_and_grpc_code(minilm_server):
    before = minilm_server.scrape()
    post(minilm_server.http_url + "/v1/embeddings", json.dumps(with_model(input="hi")).encode())
    post(minilm_server.http_url + "/v1/embeddings", json.dumps(with_model(input=[])).encode())
    post(minilm_server.http_url + f"/v2/models/{MODEL}/infer", json.dumps({"inputs": []}).encode())
    calls = (("http:/v1/embeddings", "OK"), ("http:/v1/embeddings", "INVALID_ARGUMENT"),
             ("http:/v2/infer", "INVALID_ARGUMENT"))
    counts = [(name, rpc, code) for rpc, code in calls
              for name in ("attnserve_requests_total", "attnserve_request_duration_seconds_count")]

    def counted(after) -> bool:
        return all(delta(before, after, name, rpc=rpc, code=code) == 1 for name, rpc, code in counts)

    # A call is counted once its answer has been written to the socket, which the client
    # can read (and scrape after) a moment before the server's event loop gets back to it.
    after = minilm_server.scrape()
    for _ in range(100):
        if counted(after):
            break
        time.sleep(0.05)
        after = minilm_server.scrape()
    for name, rpc, code in counts:
        assert delta(before, after, name, rpc=rpc, code=code) == 1, (name, rpc, code)


@pytest.fixture(scope="module")
def tiny_model(tiny_artifact) -> str:
    return load_artifact(tiny_artifact).manifest.model_name


@pytest.fixture(scope="module")
def small_server(tiny_artifact):
    """Small limits: a body over 4 KiB, or a request over 64 queued tokens, is refused."""
    with ServerProcess(tiny_artifact, "--http-max-body-bytes", "4096",
                       "--max-queue-tokens", "64") as server:
        yield server


def test_body_over_the_limit_is_413(small_server, tiny_model):
    big = json.dumps({"model": tiny_model, "input": "word " * 1000}).encode()
    status, error = post(small_server.http_url + "/v1/embeddings", big)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    status, error = post(f"{small_server.http_url}/v2/models/{tiny_model}/infer", big)
    assert status == 413 and "4096-byte limit" in error["error"]


@pytest.mark.workers
def test_queue_full_is_429_in_openai_shape(small_server, tiny_model):
    with pytest.raises(openai.RateLimitError) as full:
        client(small_server).embeddings.create(model=tiny_model, input=[[101] + [2000] * 98 + [102]])
    assert full.value.code == "rate_limit_exceeded" and "queue full" in full.value.message


@pytest.mark.workers
def test_200_parallel_scrapes_are_all_answered(small_server):
    barrier = threading.Barrier(SCRAPERS)

    def scrape_once(_: int) -> int:
        barrier.wait(timeout=60)
        # 10 s: a listener that drops connections shows as SYN retries of 1, 3, 7 s and more.
        with urllib.request.urlopen(small_server.metrics_url, timeout=10) as response:
            return response.status if b"attnserve_requests_total" in response.read() else -1

    for _ in range(2):
        with ThreadPoolExecutor(SCRAPERS) as pool:
            assert list(pool.map(scrape_once, range(SCRAPERS))) == [200] * SCRAPERS


def test_draining_server_answers_503_and_finishes_what_it_accepted(tiny_artifact, tiny_model):
    # A 4 s gathering window keeps one accepted request in the queue while the server drains.
    server = ServerProcess(tiny_artifact, "--max-wait-ms", "4000")
    try:
        url = server.http_url + "/v1/embeddings"
        with ThreadPoolExecutor(1) as pool:
            accepted = pool.submit(post, url, json.dumps({"model": tiny_model,
                                                          "input": "accepted"}).encode())
            for _ in range(200):
                if sample(server.scrape(), "attnserve_sequence_length_tokens_count") >= 1:
                    break
                threading.Event().wait(0.02)
            server.proc.send_signal(signal.SIGTERM)
            for _ in range(200):
                if get(server.http_url + "/health") == 503:
                    break
                threading.Event().wait(0.02)
            assert get(server.http_url + "/v2/health/ready") == 400
            status, error = post(url, json.dumps({"input": "late"}).encode())
            assert status == 503 and error["error"]["type"] == "server_error", error
            assert accepted.result()[0] == 200
    finally:
        code = server.stop()
    assert code == 0, server.output()[-2000:]
