"""Promise: every door keeps the same rules. Before the server says SERVING (while it warms
up) new work gets UNAVAILABLE on gRPC and 503 on HTTP, as it does while draining; with
API keys, every call but health checks and scrapes needs one, on gRPC and HTTP alike."""

import json
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import ATTNSERVE, REPO, free_port
from tests.server.reliability import serve, stub, wait_for

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

KEY = "s3cret-key"
FILE_KEY = "second-key"


def http(url: str, body: dict | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.workers
def test_work_before_serving_is_unavailable_on_every_door(minilm_artifact, tmp_path):
    """Shape buckets on the CPU make warm-up long (every bucket runs): the ports are open
    meanwhile, and every door refuses work the same way until health says SERVING."""
    port, http_port = free_port(), free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([*ATTNSERVE, "serve", "--artifact", str(minilm_artifact),
                             "--host", "127.0.0.1", "--port", str(port), "--http-port",
                             str(http_port), "--metrics-port", "0", "--device", "cpu",
                             "--shape-buckets", "on", "--bucket-seq-multiple", "64",
                             "--max-batch-size", "4"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    model = load_artifact(minilm_artifact).manifest.model_name
    try:
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check

            def status() -> str | None:
                try:
                    return health_pb2.HealthCheckResponse.ServingStatus.Name(
                        check(health_pb2.HealthCheckRequest(), timeout=1).status)
                except grpc.RpcError:
                    return None
            assert wait_for(lambda: status() is not None, 60), "the gRPC port never opened"
            assert status() == "NOT_SERVING"
            codes = []
            for call in (lambda: stub(channel).Embed(pb.EmbedRequest(texts=["early"]), timeout=30),
                         lambda: stub(channel).Tokenize(pb.TokenizeRequest(texts=["early"]),
                                                        timeout=30),
                         lambda: kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                             kpb.ModelInferRequest(model_name=model), timeout=30)):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                codes.append(refused.value.code())
            statuses = [http(f"http://127.0.0.1:{http_port}/v1/embeddings",
                             {"model": model, "input": "early"}),
                        http(f"http://127.0.0.1:{http_port}/v2/models/{model}/infer", {"inputs": []}),
                        http(f"http://127.0.0.1:{http_port}/health")]
            still_warming = status() == "NOT_SERVING"
            assert wait_for(lambda: status() == "SERVING", 300), "never SERVING"
            served = stub(channel).Embed(pb.EmbedRequest(texts=["late"]), timeout=30)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    assert still_warming, "warm-up ended before the checks: the test proves nothing"
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 3, codes
    assert statuses == [503, 503, 503], statuses
    assert len(served.embeddings) == 1


@pytest.fixture(scope="module")
def keyed(tiny_artifact, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"\n{FILE_KEY}\n")
    with serve(tiny_artifact, "--api-key", KEY, "--api-key-file", str(key_file)) as server:
        server.model = load_artifact(tiny_artifact).manifest.model_name
        yield server


@pytest.mark.workers
@pytest.mark.parametrize("key,allowed", [(None, False), ("wrong", False), (KEY, True),
                                         (FILE_KEY, True), (KEY + "x", False)])
def test_api_keys_are_checked_alike_on_grpc_and_http(keyed, key, allowed):
    metadata = [] if key is None else [("authorization", f"Bearer {key}")]
    with grpc.insecure_channel(keyed.address) as channel:
        calls = [lambda: stub(channel).Embed(pb.EmbedRequest(texts=["hi"]), metadata=metadata,
                                             timeout=10),
                 lambda: stub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata,
                                                    timeout=10),
                 lambda: kpb_grpc.GRPCInferenceServiceStub(channel).ModelMetadata(
                     kpb.ModelMetadataRequest(name=keyed.model), metadata=metadata, timeout=10)]
        for call in calls:
            if allowed:
                call()
            else:
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization" in refused.value.details()
    body = {"model": keyed.model, "input": "hi"}
    expected = 200 if allowed else 401
    assert http(keyed.http_url + "/v1/embeddings", body, key) == expected
    assert http(f"{keyed.http_url}/v2/models/{keyed.model}", None, key) == expected
    assert http(f"{keyed.http_url}/v2", None, key) == expected


@pytest.mark.workers
def test_health_reflection_and_metrics_need_no_key(keyed):
    with grpc.insecure_channel(keyed.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10).status
        ready = kpb_grpc.GRPCInferenceServiceStub(channel).ServerReady(
            kpb.ServerReadyRequest(), timeout=10)
    assert status == health_pb2.HealthCheckResponse.SERVING and ready.ready
    for path in ("/health", "/v2/health/live", "/v2/health/ready", "/openapi.json"):
        assert http(keyed.http_url + path) == 200, path
    assert "attnserve_requests_total" in keyed.scrape_text()
    refused = keyed.scrape()
    assert any(key[0] == "attnserve_requests_total" and ("code", "UNAUTHENTICATED") in key[1]
               for key in refused)


def test_the_openai_client_sends_its_key(keyed):
    ok = openai.OpenAI(base_url=keyed.http_url + "/v1", api_key=KEY, max_retries=0)
    assert len(ok.embeddings.create(model=keyed.model, input="hi").data) == 1
    bad = openai.OpenAI(base_url=keyed.http_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model=keyed.model, input="hi")


@pytest.mark.workers
def test_a_key_file_without_keys_stops_the_start(tiny_artifact, tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("\n\n")
    out = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--device", "cpu",
                          "--api-key-file", str(empty), "--check-config"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds no key" in out.stderr, out.stderr


def test_a_port_in_use_stops_a_second_server(tiny_artifact):
    with serve(tiny_artifact) as first:
        for flag, port in (("--port", first.port), ("--http-port", first.http_port)):
            started = time.monotonic()
            out = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact),
                                  "--device", "cpu", "--host", "127.0.0.1", flag, str(port),
                                  "--metrics-port", "0", *(["--port", "0"] if flag != "--port"
                                                           else ["--http-port", "0"])],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
            assert out.returncode == 2, out.stderr
            assert "address already in use" in out.stderr and flag in out.stderr, out.stderr
            assert time.monotonic() - started < 60
