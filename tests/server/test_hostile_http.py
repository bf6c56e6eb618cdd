"""Promise: the HTTP port answers a hostile client as the gRPC port does. Every case gets a
4xx in the protocol's own shape within bounded time, never a 500, a hang or a traceback
at ERROR; health answers within 250 ms throughout; a connection holds no memory budget
for bytes it has not sent, and no connection slot past a named timeout.

One server of its own, with short HTTP timeouts (a 1 s header timeout, a 2 s body
timeout) and a 256 MiB budget, probed by a health checker in a process of its own."""

import base64
import gzip
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from bench.harness import delta, sample
from tests.server.reliability import MIB, HealthProbe, serve, stub, wait_for

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

BUDGET = 256 * MIB
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MAX_BODY = 8 * MIB
# Every refusal here comes back this fast, or the server is doing the work it refuses.
PROMPT_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_artifact):
    process = serve(tiny_artifact, "--memory-budget-bytes", str(BUDGET),
                    "--http-header-timeout-seconds", str(HEADER_TIMEOUT_S),
                    "--http-body-timeout-seconds", str(BODY_TIMEOUT_S),
                    "--http-max-body-bytes", str(MAX_BODY))
    process.model = load_artifact(tiny_artifact).manifest.model_name
    yield process
    log = process.output()
    assert process.stop() == 0
    assert "Traceback" not in log and "level=ERROR" not in log, log[-3000:]


def raw(port: int, data: bytes, timeout: float = 30.0, then: bytes = b"") -> tuple[int, dict, bytes]:
    """Send `data` (and `then`, once the answer's head is in, if any) on a new connection
    and read one answer: (status, headers, body); status 0 if the server closed the
    connection without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                return 0, {}, received
            received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", 0))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        if then:
            sock.sendall(then)
        return status, headers, body


def post(server, path: str, body: bytes, content_type: str = "application/json",
         extra: str = "") -> tuple[int, dict]:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    status, _, answer = raw(server.http_port, head.encode() + body)
    return status, json.loads(answer) if answer else {}


def embed_body(server, inputs) -> bytes:
    return json.dumps({"model": server.model, "input": inputs}).encode()


def infer_header(ids: list[int], **more) -> dict:
    return {"inputs": [{"name": name, "datatype": "INT64", "shape": [1, len(ids)], "data": data}
                       for name, data in (("input_ids", ids), ("attention_mask", [1] * len(ids)))],
            **more}


def still_serving(server) -> None:
    """An ordinary call on each protocol is answered at once."""
    status, answer = post(server, "/v1/embeddings", embed_body(server, "still serving"))
    assert status == 200, answer
    with grpc.insecure_channel(server.address) as channel:
        stub(channel).Embed(pb.EmbedRequest(texts=["still serving"]), timeout=10)


def test_sockets_that_send_no_body_hold_no_budget_and_are_timed_out(server):
    """Fifty connections each declare a 4 MiB body (3 × 4 MiB each in the ledger, were it
    reserved up front: more than the whole budget) and send none of it. Meanwhile every
    other call is served, and each of them gets 408 once the body timeout has passed."""
    sockets = []
    try:
        with HealthProbe(server.http_url) as probe:
            for _ in range(50):
                sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
                sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {4 * MIB}\r\n\r\n{{".encode())
                sockets.append(sock)
            assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") >= 50, 10)
            still_serving(server)
            started = time.monotonic()
            answers = [sock.recv(4096) for sock in sockets]
            waited = time.monotonic() - started
    finally:
        for sock in sockets:
            sock.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0]
    assert waited <= BODY_TIMEOUT_S + PROMPT_S, waited
    assert probe.failed == [] and probe.slowest < 0.25, str(probe)


def test_a_compressed_body_is_refused_before_it_is_read(server):
    """A 1 MiB gzip body that would inflate to 256 MiB: 415 at once, nothing inflated."""
    bomb = gzip.compress(b"[" * (256 * MIB), compresslevel=9)
    with HealthProbe(server.http_url) as probe:
        started = time.monotonic()
        status, answer = post(server, "/v1/embeddings", bomb, extra="Content-Encoding: gzip\r\n")
        took = time.monotonic() - started
        still_serving(server)
    assert status == 415 and "Content-Encoding" in answer["error"]["message"], answer
    assert took < PROMPT_S and probe.failed == [] and probe.slowest < 0.25, (took, str(probe))


def test_json_with_too_many_entries_is_refused_before_it_is_parsed(server):
    """A million one-id lists (5 MiB): counted before it is parsed and refused (413), four
    such bodies at once, while an unrelated call and health checks go on."""
    crowd = json.dumps({"model": server.model, "input": [[101]] * 1_000_000}).encode()
    before = server.scrape()
    with HealthProbe(server.http_url) as probe, ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        refused = [pool.submit(post, server, "/v1/embeddings", crowd) for _ in range(4)]
        still_serving(server)
        answers = [f.result() for f in refused]
        took = time.monotonic() - started
    after = server.scrape()
    for status, answer in answers:
        assert status == 413 and "JSON values" in answer["error"]["message"], answer
    assert took < 4 * PROMPT_S, took
    assert delta(before, after, "attnserve_batch_size_count") == 2  # the two still_serving calls
    assert probe.failed == [] and probe.slowest < 0.25, str(probe)


SURROGATE = b'"\\ud800"'
RAW_SURROGATE = b'"\xed\xa0\x80"'


@pytest.mark.parametrize("body,needle", [
    (b'{"model": "M", "input": ' + SURROGATE + b"}", "not valid JSON"),
    (b'{"model": "M", "input": ["a", ' + RAW_SURROGATE + b"]}", "not valid JSON"),
    (b'{"model": "M", "input": ""}', "empty string"),
    (b'{"model": "M", "input": ["", ""]}', "empty string"),
    (b'{"model": "M", "input": [true, false]}', "expected a string"),
    (b'{"input": "a"}', "model: required"),
    (b'{"model": 3, "input": "a"}', "expected a string"),
])
def test_openai_bad_bodies_are_400(server, body, needle):
    status, answer = post(server, "/v1/embeddings", body.replace(b'"M"', f'"{server.model}"'.encode()))
    assert status == 400 and needle in answer["error"]["message"], answer


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_content_types_a_web_page_can_send_cross_site_are_refused(server, content_type):
    status, answer = post(server, "/v1/embeddings", embed_body(server, "a"), content_type)
    assert status == 415, answer
    path = f"/v2/models/{server.model}/infer"
    status, answer = post(server, path, json.dumps(infer_header([101, 102])).encode(), content_type)
    assert status == 415, answer


@pytest.mark.parametrize("header,needle", [
    (infer_header([101, 102], id="\ud800"), "not valid JSON"),
    (infer_header([101, 102], outputs=[{"name": "\ud800"}]), "not valid JSON"),
    (infer_header([101, 102], id=None), None),
    (infer_header([101, 102], id=7), "id: 7; expected a string"),
    ({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [True, 2], "data": [1, 2]},
                 {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]}]},
     "expected a list of integers"),
    (infer_header([101, True]), "True is not an INT64 value"),
])
def test_kserve_bad_headers_are_400(server, header, needle):
    body = json.dumps(header).encode()  # json.dumps writes a lone surrogate as its escape
    status, answer = post(server, f"/v2/models/{server.model}/infer", body)
    if needle is None:  # `"id": null` is no id: answered, echoing none
        assert status == 200 and "id" not in answer, answer
    else:
        assert status == 400 and needle in answer["error"], answer


@pytest.mark.parametrize("length", ["²", "1" * 5000, "-1", "0x10"])
def test_a_bad_inference_header_length_is_400(server, length):
    body = json.dumps(infer_header([101, 102])).encode()
    status, answer = post(server, f"/v2/models/{server.model}/infer", body,
                          "application/octet-stream",
                          f"Inference-Header-Content-Length: {length}\r\n")
    assert status == 400 and "Inference-Header-Content-Length" in answer["error"], answer


def test_a_malformed_chunked_body_is_answered_and_the_call_ends(server):
    """A bad chunk size after the headers: aiohttp's parser drops the body without a word
    to the route, so the body timeout ends the call (408) and frees its place."""
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(head)
        assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") == 1, 5)
        started = time.monotonic()
        sock.sendall(b"zz\r\n{}\r\n0\r\n\r\n")
        sock.settimeout(BODY_TIMEOUT_S + PROMPT_S)
        answer = sock.recv(4096)
        took = time.monotonic() - started
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 408")), answer
    assert took <= BODY_TIMEOUT_S + PROMPT_S
    assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") == 0, 5)


def test_slow_headers_are_cut_off_at_the_header_timeout(server):
    """A connection that sends a header byte every 100 ms is closed once the header
    timeout has passed, and never gets a slot for longer."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        started, closed = time.monotonic(), False
        for byte in (b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000):
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - started > HEADER_TIMEOUT_S + PROMPT_S:
                break
        if not closed:
            sock.settimeout(1.0)
            try:
                closed = sock.recv(1) == b""
            except OSError:
                closed = True
    assert closed, "the slow connection was still open"
    assert time.monotonic() - started <= HEADER_TIMEOUT_S + PROMPT_S + 1.0


def test_grpc_errors_quote_the_caller_within_bounds(server):
    """A 5,000-character model name: NOT_FOUND, its message quoting the name cut short, so
    the status and its details fit in the trailers every client accepts (8 KiB)."""
    name = "m" * 5000
    with grpc.insecure_channel(server.address) as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            kserve.ModelMetadata(kpb.ModelMetadataRequest(name=name), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "5000 characters" in err.value.details() and len(err.value.details()) < 400


def test_a_thousand_scrapes_do_not_delay_health(server):
    import urllib.request

    def scrape(_):
        with urllib.request.urlopen(server.metrics_url, timeout=60) as response:
            return response.status

    with HealthProbe(server.http_url) as probe, ThreadPoolExecutor(200) as pool:
        codes = list(pool.map(scrape, range(1000)))
    assert codes == [200] * 1000
    assert probe.failed == [] and probe.slowest < 0.25, str(probe)


def test_unmatched_routes_and_methods_answer_in_the_protocols_shape(server):
    status, headers, body = raw(server.http_port, b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\n"
                                b"Connection: close\r\n\r\n")
    assert status == 404 and "error" in json.loads(body)
    status, headers, body = raw(server.http_port, b"DELETE /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                                b"Connection: close\r\n\r\n")
    assert status == 405 and "POST" in headers["allow"]
    assert json.loads(body)["error"]["message"].startswith("DELETE")


def test_health_answers_have_the_protocols_bodies(server):
    for path, expected in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
                           (f"/v2/models/{server.model}/ready", {"name": server.model, "ready": True}),
                           (f"/v2/models/{server.model}/versions/1/ready",
                            {"name": server.model, "ready": True})):
        status, _, body = raw(server.http_port, f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                              "Connection: close\r\n\r\n".encode())
        assert status == 200 and json.loads(body) == expected, path
    status, _, body = raw(server.http_port, f"GET /v2/models/{server.model}/versions/2/ready "
                          "HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert status == 404 and "version" in json.loads(body)["error"]


def test_base64_vectors_are_the_float_vectors(server):
    floats = post(server, "/v1/embeddings", embed_body(server, "same text"))[1]
    packed = post(server, "/v1/embeddings", json.dumps(
        {"model": server.model, "input": "same text", "encoding_format": "base64"}).encode())[1]
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(floats["data"][0]["embedding"], dtype=np.float32))
