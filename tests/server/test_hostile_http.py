"""Promise: the HTTP port answers a hostile client as the gRPC port does. Every case gets a
4xx in the protocol's own shape within bounded time, never a 500, a hang or a traceback
at ERROR; health answers within 250 ms throughout; a connection holds no memory budget
for bytes it has not sent, and no connection slot past a named timeout.

One server of its own, with short HTTP timeouts (a 1 s header timeout, a 2 s body
timeout) and a 256 MiB budget, probed by a health checker in a process of its own; and one
with a 30 s body timeout, for the answers that must come long before it."""

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
from tests.harness import delta, sample
from tests.server.reliability import MIB, HealthProbe, read_answer, serve, stub, wait_for

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

BUDGET = 256 * MIB
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MAX_BODY = 8 * MIB
# Every refusal here comes back this fast, or the server is doing the work it refuses.
PROMPT_S = 2.0


# A body timeout no test waits for, and the bound an answer to a broken body comes within:
# far below it, so an answer that waited for the body timeout misses it on any machine.
PATIENT_BODY_TIMEOUT_S = 30.0
UNLIKE_THE_BODY_TIMEOUT_S = 5.0


def serving(artifact, *flags: str):
    process = serve(artifact, *flags)
    process.model = load_artifact(artifact).manifest.model_name
    yield process
    log = process.output()
    assert process.stop() == 0
    assert "Traceback" not in log and "level=ERROR" not in log, log[-3000:]


@pytest.fixture(scope="module")
def server(tiny_artifact):
    yield from serving(tiny_artifact, "--memory-budget-bytes", str(BUDGET),
                       "--http-header-timeout-seconds", str(HEADER_TIMEOUT_S),
                       "--http-body-timeout-seconds", str(BODY_TIMEOUT_S),
                       "--http-max-body-bytes", str(MAX_BODY))


@pytest.fixture(scope="module")
def patient(tiny_artifact):
    yield from serving(tiny_artifact, "--http-body-timeout-seconds", str(PATIENT_BODY_TIMEOUT_S))


def raw(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Send `data` on a new connection and read one answer (read_answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_answer(sock)


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


@pytest.mark.workers
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
    (b'{"model": "M", "input": [true, false]}', "got true or false"),
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
    (infer_header([101, 102], id=7), "id: expected a string or null, got an integer"),
    ({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [True, 2], "data": [1, 2]},
                 {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]}]},
     "inputs[0].shape[0]: expected an integer, got true or false"),
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


# Chunked bodies whose framing breaks: each gets 400 at once, the connection closed.
BROKEN_CHUNKED = {
    "size not hex": b"zz\r\n{}\r\n0\r\n\r\n",
    "size past 64 bits": b"ffffffffffffffffff\r\n{}\r\n0\r\n\r\n",
    "extension of a control byte": b"2;\x01\r\n{}\r\n0\r\n\r\n",
    "extension with a bare LF": b"2;a\nb\r\n{}\r\n0\r\n\r\n",
    "trailer without a colon": b"2\r\n{}\r\n0\r\nno colon\r\n\r\n",
    "data longer than its size": b"2\r\n{}XX\r\n0\r\n\r\n",
}
ROUTES = {"openai": "/v1/embeddings", "kserve": "/v2/models/{model}/infer"}
RPCS = {"openai": "http:/v1/embeddings", "kserve": "http:/v2/infer"}


def chunked_head(path: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def malformed_logged(process) -> int:
    """The server's INFO lines for malformed requests so far."""
    return sum("level=INFO" in line and "event=malformed_request" in line
               for line in process.output().splitlines())


def closed_after(sock: socket.socket) -> bool:
    """Whether the server closes the connection once its answer is read (a bounded wait:
    the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("arrives", ["with the head", "after the head"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", BROKEN_CHUNKED)
def test_a_broken_chunked_body_is_400_at_once_and_the_connection_closes(patient, case, route,
                                                                        arrives):
    """Whether the broken body comes in the head's packet or once the call is in its
    route: 400 in the route's shape long before the 30 s body timeout, counted as the
    route's INVALID_ARGUMENT, logged as one line at INFO, the connection closed after,
    and the server serving the next caller."""
    rpc = RPCS[route]
    before = patient.scrape()
    logged = malformed_logged(patient)
    head = chunked_head(ROUTES[route].format(model=patient.model))
    with socket.create_connection(("127.0.0.1", patient.http_port),
                                  timeout=UNLIKE_THE_BODY_TIMEOUT_S) as sock:
        if arrives == "with the head":
            sock.sendall(head + BROKEN_CHUNKED[case])
        else:
            sock.sendall(head)
            assert wait_for(lambda: sample(patient.scrape(), "attnserve_inflight_requests") == 1, 5)
            sock.sendall(BROKEN_CHUNKED[case])
        status, _, body = read_answer(sock)
        closed = closed_after(sock)
    answer = json.loads(body)
    message = answer["error"]["message"] if route == "openai" else answer["error"]
    assert status == 400 and message.startswith("body: malformed chunked encoding ("), answer
    assert closed, "the connection stayed open after a broken body"
    assert wait_for(lambda: delta(before, patient.scrape(), "attnserve_requests_total", rpc=rpc,
                                  code="INVALID_ARGUMENT") == 1, 5)
    assert wait_for(lambda: malformed_logged(patient) == logged + 1, 5)
    still_serving(patient)
    status, _, body = raw(patient.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                          b"Connection: close\r\n\r\n")
    assert status == 200 and json.loads(body) == {"status": "serving"}


def test_a_broken_chunked_body_on_a_route_that_reads_none_closes_after_its_answer(patient):
    """A route answered without its body (an unknown model, 404) keeps its answer; the
    broken body behind it then ends the connection, not at the body timeout."""
    with socket.create_connection(("127.0.0.1", patient.http_port),
                                  timeout=UNLIKE_THE_BODY_TIMEOUT_S) as sock:
        sock.sendall(chunked_head("/v2/models/nothing/infer") + BROKEN_CHUNKED["size not hex"])
        status, _, body = read_answer(sock)
        closed = closed_after(sock)
    assert status == 404 and "nothing" in json.loads(body)["error"]
    assert closed
    still_serving(patient)


def test_a_chunk_cut_short_then_stalled_waits_for_the_body_timeout(server):
    """A good chunk size whose data stops short, then silence: nothing is wrong with the
    bytes sent, so the call waits for the rest until the body timeout (408), and the
    connection closes."""
    with socket.create_connection(("127.0.0.1", server.http_port),
                                  timeout=BODY_TIMEOUT_S + PROMPT_S) as sock:
        sock.sendall(chunked_head("/v1/embeddings") + b"10\r\n{}")
        status, _, body = read_answer(sock)
        closed = closed_after(sock)
    assert status == 408 and "--http-body-timeout-seconds" in json.loads(body)["error"]["message"]
    assert closed
    assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") == 0, 5)
    still_serving(server)


def nested(value, depth: int):
    """`value` inside `depth` lists, built without recursion (json.dumps would recurse)."""
    return "[" * depth + json.dumps(value) + "]" * depth


@pytest.mark.parametrize("shape,data,needle", [
    ([1, 1], nested(101, 900), "nested deeper than shape [1, 1]: [0][0] is a list"),
    ([1, 2], "[[101, [102]]]", "nested deeper than shape [1, 2]: [0][1] is a list"),
    ([1, 2], "[[101, 102, 103]]", "[0] is a list of 3 where shape [1, 2] needs a list of 2"),
    ([2, 2], "[[101, 102], [103]]", "[1] is a list of 1 where shape [2, 2] needs a list of 2"),
    ([2, 2], "[[101, 102], 103]", "[1] is 103 where shape [2, 2] needs a list of 2"),
    ([1, 2], "[101, [102]]", "a list of 2 where shape [1, 2] needs a list of 1"),
    ([1, 2], '[[101, "a"]]', "'a' is not an INT64 value"),
])
def test_kserve_data_shaped_unlike_its_shape_is_400_naming_the_input(server, shape, data, needle):
    """Checked level by level before any value is read; the other input is never reached."""
    body = (f'{{"inputs": [{{"name": "input_ids", "datatype": "INT64", "shape": {shape}, '
            f'"data": {data}}}, {{"name": "attention_mask", "datatype": "INT64", "shape": '
            f'{shape}, "data": []}}]}}').encode()
    status, answer = post(server, f"/v2/models/{server.model}/infer", body)
    assert status == 400 and answer["error"] == f"inputs[0].data: {needle}", answer


def test_kserve_data_nested_far_past_json_depth_is_400_and_harms_nothing(server):
    """100,000 lists deep (200 KB): refused as JSON nested past its depth limit, four at
    once, while health checks and another caller are served."""
    body = (f'{{"inputs": [{{"name": "input_ids", "datatype": "INT64", "shape": [1, 1], '
            f'"data": {nested(101, 100_000)}}}]}}').encode()
    with HealthProbe(server.http_url) as probe, ThreadPoolExecutor(4) as pool:
        refused = [pool.submit(post, server, f"/v2/models/{server.model}/infer", body)
                   for _ in range(4)]
        still_serving(server)
        answers = [f.result() for f in refused]
    for status, answer in answers:
        assert status == 400 and "depth" in answer["error"], answer
    assert probe.failed == [] and probe.slowest < 0.25, str(probe)


@pytest.mark.parametrize("data", [[101, 102], [[101, 102]]])
def test_kserve_data_flat_or_nested_as_its_shape_is_served(server, data):
    header = infer_header([101, 102])
    header["inputs"][0]["data"] = data
    status, answer = post(server, f"/v2/models/{server.model}/infer", json.dumps(header).encode())
    assert status == 200 and answer["outputs"][0]["shape"][:2] == [1, 2], answer


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


@pytest.mark.workers
def test_base64_vectors_are_the_float_vectors(server):
    floats = post(server, "/v1/embeddings", embed_body(server, "same text"))[1]
    packed = post(server, "/v1/embeddings", json.dumps(
        {"model": server.model, "input": "same text", "encoding_format": "base64"}).encode())[1]
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(floats["data"][0]["embedding"], dtype=np.float32))
