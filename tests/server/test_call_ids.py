"""Request ids and TEI's timing headers, on a real server: the caller's X-Request-Id (or a
new one) on every HTTP answer and in gRPC's trailing metadata, one that cannot be echoed
replaced; x-total-time, x-tokenization-time, x-queue-time, x-inference-time (whole
milliseconds, as TEI writes them) and x-compute-tokens on both doors, the inference time
coming from the batch loop (across the --workers channel too); the id at the end of the
call's log lines."""

import http.client
import json
import re

import grpc
import numpy as np
import pytest

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import ServerProcess

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

TIMES = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")
NEW_ID = re.compile(r"[0-9a-f]{32}")
KEY = "secret-key"
# 32 texts of 512 tokens: a batch the CPU runs for well over a millisecond, however idle.
LONG = ["word " * 600] * 32


def request(server: ServerProcess, method: str, path: str, body: dict | None = None,
            headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={
            "Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def times_of(metadata: dict[str, str]) -> dict[str, int]:
    """The timing headers as integers; they fit inside the call's total."""
    values = {name: int(metadata[name]) for name in TIMES}
    assert all(v >= 0 for v in values.values())
    # Tokenizing, queueing and running are parts of the call, one after another.
    assert sum(values[name] for name in TIMES[1:]) <= values["x-total-time"]
    return values


@pytest.fixture(scope="module")
def keyed_server(tiny_artifact):
    with ServerProcess(tiny_artifact, "--api-key", KEY, "--log-level", "debug") as server:
        yield server


@pytest.mark.workers
def test_http_echoes_the_id_and_times_the_call(minilm_server):
    status, headers, body = request(minilm_server, "POST", "/v1/embeddings",
                                    {"input": LONG, "truncate": True},
                                    {"X-Request-Id": "caller-id-7"})
    assert status == 200
    assert headers["x-request-id"] == "caller-id-7"
    times = times_of(headers)
    assert times["x-inference-time"] >= 1
    usage = json.loads(body)["usage"]
    assert int(headers["x-compute-tokens"]) == usage["total_tokens"] == 32 * 512


@pytest.mark.parametrize("given", [None, "", "x" * 129, "tab\there", "caf\u00e9"])
def test_an_id_that_cannot_be_echoed_is_replaced(minilm_server, given):
    headers = {} if given is None else {"X-Request-Id": given.encode().decode("latin-1")}
    _, first, _ = request(minilm_server, "POST", "/v1/embeddings", {"input": "hi"}, headers)
    _, second, _ = request(minilm_server, "POST", "/v1/embeddings", {"input": "hi"}, headers)
    assert NEW_ID.fullmatch(first["x-request-id"]) and NEW_ID.fullmatch(second["x-request-id"])
    assert first["x-request-id"] != second["x-request-id"]


def test_the_longest_id_is_echoed(minilm_server):
    given = "id-" + "7" * 125
    _, headers, _ = request(minilm_server, "POST", "/v1/embeddings", {"input": "hi"},
                            {"X-Request-Id": given})
    assert headers["x-request-id"] == given


def test_an_id_sent_twice_is_the_first_on_both_doors(minilm_server):
    connection = http.client.HTTPConnection("127.0.0.1", minilm_server.http_port, timeout=60)
    try:
        connection.putrequest("POST", "/v1/embeddings")
        body = json.dumps({"input": "hi"}).encode()
        for name, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("X-Request-Id", "first-1"), ("X-Request-Id", "second-2")):
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("x-request-id") == "first-1"
    finally:
        connection.close()
    with grpc.insecure_channel(minilm_server.address) as channel:
        twice = [("x-request-id", "first-1"), ("x-request-id", "second-2")]
        stub = pb_grpc.EncoderServiceStub(channel)
        _, call = stub.Embed.with_call(pb.EmbedRequest(texts=["hi"]), metadata=twice)
    assert trailers(call)["x-request-id"] == "first-1"


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/embeddings", {"input": []}, 400),
    ("POST", "/v1/embeddings", {"input": "hi", "model": "nope"}, 404),
    ("GET", "/no/such/route", None, 404),
    ("GET", "/v1/embeddings", None, 405),
    ("GET", "/health", None, 200),
    ("POST", "/v2/models/all-MiniLM-L6-v2/infer", {"inputs": []}, 400),
])
def test_every_http_answer_carries_the_id_and_times(minilm_server, method, path, body, status):
    got, headers, _ = request(minilm_server, method, path, body, {"X-Request-Id": "r-1"})
    assert got == status
    assert headers["x-request-id"] == "r-1"
    times_of(headers)
    assert headers["x-compute-tokens"] == "0"


@pytest.mark.workers
def test_kserve_rest_times_its_inference(minilm_server):
    ids = [101, 7592, 2088, 102]
    status, headers, _ = request(minilm_server, "POST", "/v2/models/all-MiniLM-L6-v2/infer", {
        "inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": ids},
                   {"name": "attention_mask", "shape": [1, 4], "datatype": "INT64",
                    "data": [1] * 4}]})
    assert status == 200 and headers["x-compute-tokens"] == "4"
    times_of(headers)


def trailers(call) -> dict[str, str]:
    return {m.key: m.value for m in call.trailing_metadata() if not m.key.endswith("-bin")}


@pytest.mark.workers
def test_grpc_trailers_carry_the_id_and_times(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        response, call = stub.Embed.with_call(pb.EmbedRequest(texts=LONG, truncate=True),
                                              metadata=[("x-request-id", "grpc-9")])
        got = trailers(call)
        assert got["x-request-id"] == "grpc-9"
        assert times_of(got)["x-inference-time"] >= 1
        assert int(got["x-compute-tokens"]) == response.total_tokens == 32 * 512
        # A new id without one, and on a refusal beside its status details.
        _, call = stub.Embed.with_call(pb.EmbedRequest(texts=["a"]))
        assert NEW_ID.fullmatch(trailers(call)["x-request-id"])
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(pb.EmbedRequest(), metadata=[("x-request-id", "bad-1")])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        refused = trailers(caught.value)
        assert refused["x-request-id"] == "bad-1" and refused["x-compute-tokens"] == "0"
        assert any(m.key == "grpc-status-details-bin" for m in caught.value.trailing_metadata())
        # A stream's trailers: its id and every message's tokens.
        responses = stub.EmbedStream(iter([pb.EmbedRequest(texts=["one two"]),
                                           pb.EmbedRequest(texts=["three"])]),
                                     metadata=[("x-request-id", "stream-2")])
        tokens = sum(r.total_tokens for r in responses)
        got = trailers(responses)
        assert got["x-request-id"] == "stream-2" and int(got["x-compute-tokens"]) == tokens
        # KServe's door too.
        ids = np.array([[101, 7592, 102]], dtype=np.int64)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        _, call = kserve.ModelInfer.with_call(kpb.ModelInferRequest(
            model_name="all-MiniLM-L6-v2", inputs=[
                kpb.ModelInferRequest.InferInputTensor(name=name, datatype="INT64", shape=[1, 3])
                for name in ("input_ids", "attention_mask")],
            raw_input_contents=[ids.tobytes(), np.ones_like(ids).tobytes()]),
            metadata=[("x-request-id", "kserve-3")])
        got = trailers(call)
        assert got["x-request-id"] == "kserve-3" and got["x-compute-tokens"] == "3"


def test_grpc_replaces_an_id_it_cannot_echo(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        _, call = pb_grpc.EncoderServiceStub(channel).Embed.with_call(
            pb.EmbedRequest(texts=["a"]), metadata=[("x-request-id", "y" * 200)])
    assert NEW_ID.fullmatch(trailers(call)["x-request-id"])


@pytest.mark.workers
def test_refusals_carry_the_id_and_log_it(keyed_server):
    status, headers, _ = request(keyed_server, "POST", "/v1/embeddings", {"input": "hi"},
                                 {"X-Request-Id": "no-key-1"})
    assert status == 401 and headers["x-request-id"] == "no-key-1"
    status, headers, _ = request(keyed_server, "POST", "/v1/embeddings", {"input": []},
                                 {"X-Request-Id": "empty-1", "Authorization": f"Bearer {KEY}"})
    assert status == 400 and headers["x-request-id"] == "empty-1"
    with grpc.insecure_channel(keyed_server.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.EncoderServiceStub(channel).Embed(pb.EmbedRequest(texts=["a"]),
                                                      metadata=[("x-request-id", "no-key-2")])
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert trailers(caught.value)["x-request-id"] == "no-key-2"
    log = keyed_server.output()
    lines = [line for line in log.splitlines() if "event=refused" in line]
    assert any(line.endswith("request_id=empty-1") and "code=INVALID_ARGUMENT" in line
               for line in lines), log[-3000:]
    assert any(line.endswith("request_id=no-key-1") for line in lines), log[-3000:]


@pytest.mark.workers
def test_workers_hand_the_engines_timings_to_the_front_end(tiny_artifact):
    with ServerProcess(tiny_artifact, "--workers", "2") as server:
        status, headers, body = request(server, "POST", "/v1/embeddings",
                                        {"input": ["word " * 200] * 512, "truncate": True},
                                        {"X-Request-Id": "w-1"})
        assert status == 200 and headers["x-request-id"] == "w-1"
        assert int(headers["x-compute-tokens"]) == json.loads(body)["usage"]["total_tokens"]
        assert times_of(headers)["x-inference-time"] >= 1
