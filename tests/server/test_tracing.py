"""Traces, against a real OTLP receiver: the collector's gRPC TraceService served on
loopback by the test, a real `attnserve serve --otlp-endpoint` exporting to it. One span
per call with children for tokenize, queue, inference (the batch's size and padded
shape) and respond, each carrying the model; a caller's W3C traceparent continued over
HTTP and gRPC, a malformed one starting a trace of its own; failures marked; probes not
traced; with --workers the spans made by the front end from the engine's timings; without
the flag OpenTelemetry never imported, and with it but without the extra a start-up error
naming the extra."""

import json
import subprocess
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tokenizers import Tokenizer

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.conftest import without_module
from tests.harness import ATTNSERVE, REPO, ServerProcess
from tests.server.test_kserve import MODEL, infer_request

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
STEPS = {"tokenize", "queue", "inference", "respond"}
# Spans leave the server in batches; this often, for the test to wait less.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
WAIT_S = 60


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every span it is sent, flattened."""

    def __init__(self):
        self.spans: list = []
        self.changed = threading.Condition()

    def Export(self, request, context):
        with self.changed:
            for resource in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes, count: int) -> list:
        """The spans of `trace_id`, once `count` have come (bounded wait)."""
        deadline = time.monotonic() + WAIT_S
        with self.changed:
            while True:
                found = [s for _, s in self.spans if s.trace_id == trace_id]
                if len(found) >= count or time.monotonic() > deadline:
                    return found
                self.changed.wait(0.5)

    def named(self, name: str, attribute: tuple[str, str]) -> list:
        """Root spans called `name` whose string attribute `attribute` has its value."""
        key, value = attribute
        return [s for _, s in self.spans if s.name == name
                and any(a.key == key and a.value.string_value == value for a in s.attributes)]


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    collector.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector
    server.stop(0)


@pytest.fixture(scope="module")
def traced(minilm_artifact, receiver):
    with ServerProcess(minilm_artifact, "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}",
                       env=FAST_EXPORT) as server:
        yield server


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        out[a.key] = (list(v.int_value for v in value.array_value.values)
                      if kind == "array_value" else getattr(value, kind))
    return out


def embed_http(server, body: dict, headers: dict) -> int:
    request = urllib.request.Request(server.http_url + "/v1/embeddings",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def check_call(spans: list, name: str, model: str) -> tuple:
    """The call's span and its steps: every step a child of it, carrying the model."""
    roots = [s for s in spans if s.name == name]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    steps = [s for s in spans if s is not root]
    assert {s.name for s in steps} == STEPS
    for step in steps:
        assert step.parent_span_id == root.span_id
        assert attributes(step)["attnserve.model"] == model
        assert root.start_time_unix_nano <= step.start_time_unix_nano
        assert step.start_time_unix_nano <= step.end_time_unix_nano <= root.end_time_unix_nano
    assert attributes(root)["attnserve.model"] == model
    assert sorted(s.name for s in steps if s.name != "inference") == sorted(STEPS - {"inference"})
    return root, {s.name: s for s in steps}


def test_http_call_continues_the_callers_trace(traced, receiver, minilm_artifact):
    texts = ["hello world", "good morning"]  # of one length: one batch
    status = embed_http(traced, {"input": texts},
                        {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "t-1"})
    assert status == 200
    spans = receiver.trace(bytes.fromhex(TRACE_ID), 5)
    root, steps = check_call(spans, "POST /v1/embeddings", "all-MiniLM-L6-v2")
    assert root.parent_span_id == bytes.fromhex(PARENT_ID)
    assert root.kind == root.SPAN_KIND_SERVER
    info = attributes(root)
    assert info["attnserve.request_id"] == "t-1" and info["http.response.status_code"] == 200
    assert info["attnserve.compute_tokens"] > 0
    assert [s.name for s in spans].count("inference") == 1
    inference = attributes(steps["inference"])
    assert inference["attnserve.batch_size"] == 2
    tokenizer = Tokenizer.from_file(str(minilm_artifact / "tokenizer.json"))
    tokenizer.no_padding()
    longest = max(len(e.ids) for e in tokenizer.encode_batch(texts))
    assert inference["attnserve.padded_shape"] == [2, longest]


def test_grpc_call_continues_the_callers_trace(traced, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with grpc.insecure_channel(traced.address) as channel:
        pb_grpc.EncoderServiceStub(channel).Embed(
            pb.EmbedRequest(texts=["hello"]),
            metadata=[("traceparent", f"00-{trace_id}-b7ad6b7169203331-01")])
    spans = receiver.trace(bytes.fromhex(trace_id), 5)
    root, _ = check_call(spans, "attnserve.v1.EncoderService/Embed", "all-MiniLM-L6-v2")
    assert root.parent_span_id == bytes.fromhex("b7ad6b7169203331")
    assert attributes(root)["rpc.method"] == "Embed"


def test_a_rerank_call_times_every_step(bert_reranker_artifact, receiver):
    """A reranker tokenizes its pairs on a path of its own: that step is in its trace too."""
    trace_id = "feedfacefeedfacefeedfacefeedface"
    with ServerProcess(bert_reranker_artifact, "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}",
                       env=FAST_EXPORT) as server:
        request = urllib.request.Request(
            server.http_url + "/rerank", data=json.dumps({"query": "q", "texts": ["a b", "c d"]}).encode(),
            headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{PARENT_ID}-01"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        spans = receiver.trace(bytes.fromhex(trace_id), 5)
    model = json.loads((bert_reranker_artifact / "manifest.json").read_text())["model_name"]
    check_call(spans, "POST /rerank", model)


def test_kserve_calls_time_each_step_once(traced, receiver):
    """Raw tensors are read (tokenize), run, and answered in one respond step, whether the
    answer is protobuf's or JSON."""
    grpc_trace, http_trace = "12341234123412341234123412341234", "56785678567856785678567856785678"
    with grpc.insecure_channel(traced.address) as channel:
        kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request(), metadata=[("traceparent", f"00-{grpc_trace}-{PARENT_ID}-01")])
    request = urllib.request.Request(
        f"{traced.http_url}/v2/models/{MODEL}/infer", data=json.dumps({"inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [101, 7592, 102]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [1, 3], "data": [1, 1, 1]}]}).encode(),
        headers={"Content-Type": "application/json", "traceparent": f"00-{http_trace}-{PARENT_ID}-01"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    for trace_id, name in ((grpc_trace, "inference.GRPCInferenceService/ModelInfer"),
                           (http_trace, "POST /v2/models/{name}/infer")):
        check_call(receiver.trace(bytes.fromhex(trace_id), 5), name, MODEL)


@pytest.mark.parametrize("traceparent", ["00-zz-not-a-trace", f"00-{'0' * 32}-{PARENT_ID}-01",
                                         f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01"])
def test_a_malformed_traceparent_starts_a_new_trace(traced, receiver, traceparent):
    request_id = f"malformed-{hash(traceparent) & 0xffff}"
    assert embed_http(traced, {"input": "hi"}, {"traceparent": traceparent,
                                               "X-Request-Id": request_id}) == 200
    deadline = time.monotonic() + WAIT_S
    while not (roots := receiver.named("POST /v1/embeddings", ("attnserve.request_id", request_id))):
        assert time.monotonic() < deadline, "no span arrived"
        time.sleep(0.2)
    (root,) = roots
    assert root.parent_span_id == b"" and len(root.trace_id) == 16
    assert root.trace_id not in (bytes.fromhex(TRACE_ID), bytes(16))
    check_call(receiver.trace(root.trace_id, 5), "POST /v1/embeddings", "all-MiniLM-L6-v2")


def test_a_refused_call_is_an_error_span_and_probes_are_not_traced(traced, receiver):
    trace_id = "11112222333344445555666677778888"
    parent = f"00-{trace_id}-{PARENT_ID}-01"
    urllib.request.urlopen(urllib.request.Request(traced.http_url + "/health",
                                                  headers={"traceparent": parent}), timeout=30)
    assert embed_http(traced, {"input": []}, {"traceparent": parent}) == 400
    (root,) = receiver.trace(bytes.fromhex(trace_id), 1)
    assert root.name == "POST /v1/embeddings"  # the health check made none
    assert root.status.code == root.status.STATUS_CODE_ERROR
    assert attributes(root)["attnserve.code"] == "INVALID_ARGUMENT"


def test_workers_front_end_makes_the_spans(tiny_artifact, receiver):
    trace_id = "99990000aaaabbbbccccddddeeeeffff"
    with ServerProcess(tiny_artifact, "--workers", "2", "--otlp-endpoint",
                       f"http://127.0.0.1:{receiver.port}", env=FAST_EXPORT) as server:
        assert embed_http(server, {"input": ["a b c", "d e f"]},
                          {"traceparent": f"00-{trace_id}-{PARENT_ID}-01"}) == 200
        spans = receiver.trace(bytes.fromhex(trace_id), 5)
    model = json.loads((tiny_artifact / "manifest.json").read_text())["model_name"]
    _, steps = check_call(spans, "POST /v1/embeddings", model)
    assert attributes(steps["inference"])["attnserve.padded_shape"] == [2, 5]


def test_a_call_of_many_batches_keeps_a_bounded_trace(tiny_artifact, receiver):
    """40 texts run one a batch: the first 32 batches are spans, the rest counted; the
    call's other steps are all there."""
    trace_id = "abcdefabcdefabcdefabcdefabcdef12"
    with ServerProcess(tiny_artifact, "--max-batch-size", "1", "--otlp-endpoint",
                       f"http://127.0.0.1:{receiver.port}", env=FAST_EXPORT) as server:
        assert embed_http(server, {"input": [f"text {i}" for i in range(40)]},
                          {"traceparent": f"00-{trace_id}-{PARENT_ID}-01"}) == 200
        spans = receiver.trace(bytes.fromhex(trace_id), 1 + 32 + 3)
    names = [s.name for s in spans]
    assert names.count("inference") == 32
    assert {"tokenize", "queue", "respond"} <= set(names)
    (root,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert attributes(root)["attnserve.steps_dropped"] == 8


def test_without_the_flag_opentelemetry_is_never_imported(tmp_path, tiny_artifact):
    """A server whose OpenTelemetry cannot be imported serves every door: nothing on its
    path imports it."""
    env = without_module(tmp_path / "hidden", "opentelemetry")
    with ServerProcess(tiny_artifact, env={"PYTHONPATH": env["PYTHONPATH"]}) as server:
        assert embed_http(server, {"input": "hi"}, {}) == 200
        with grpc.insecure_channel(server.address) as channel:
            pb_grpc.EncoderServiceStub(channel).Embed(pb.EmbedRequest(texts=["hi"]))


def test_the_flag_without_the_extra_is_a_start_up_error(tmp_path, tiny_artifact):
    env = without_module(tmp_path / "hidden", "opentelemetry")
    result = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--check-config",
                             "--otlp-endpoint", "http://127.0.0.1:4317"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--otlp-endpoint: needs the 'otlp' extra" in result.stderr
    assert "pip install 'attnserve[otlp]'" in result.stderr


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4317", "grpc://collector:4317", "http://",
                                      "http://collector:4317/v1/traces"])
def test_a_bad_endpoint_is_a_start_up_error(tiny_artifact, endpoint):
    result = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--check-config",
                             "--otlp-endpoint", endpoint], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "--otlp-endpoint:" in result.stderr and "is not http://HOST:PORT" in result.stderr
