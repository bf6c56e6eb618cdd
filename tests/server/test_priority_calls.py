"""Promise: a call's priority class reaches its model's queue from every door (the
`x-priority` header or gRPC metadata, attnserve.v1's `priority` field), an API key's class
and in-flight cap hold whatever its calls say, and the queue serves interactive work
first without starving bulk work. One server of the tiny model, with API keys and the
queue's debug lines (`event=queued`, `event=batch_formed`, `event=batch_started`), which
say in what order the engine took the work."""

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import delta
from tests.server.reliability import serve, stub

PLAIN, BULK_KEY, CAPPED = "plain-key", "bulk-key", "capped-key"
CLASSES_NAMED = "the classes are interactive, bulk"
WAIT_S = 30  # bound on any wait: a broken promise fails the test instead of hanging it
BATCH = 2  # --max-batch-size: a bulk request of n sequences runs as n / 2 batches


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{PLAIN}\n{BULK_KEY} class=bulk\n{CAPPED} max_inflight=1\n")
    with serve(tiny_artifact, "--api-key-file", str(keys), "--log-level", "debug",
               "--max-batch-size", str(BATCH), "--priority-aging-ms", "200") as s:
        s.model = load_artifact(tiny_artifact).manifest.model_name
        yield s


def http(server, path: str, body: dict, key: str, priority: str | None = None
         ) -> tuple[int, dict, dict]:
    """POST `body` as JSON: the status, the headers, the JSON answer."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["x-priority"] = priority
    request = urllib.request.Request(server.http_url + path, json.dumps(body).encode(),
                                     headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def metadata(key: str, priority: str | None = None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] + ([] if priority is None else
                                                   [("x-priority", priority)])


def infer_request(model: str) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name=model)
    for name in ("input_ids", "attention_mask"):
        tensor = request.inputs.add(name=name, datatype="INT64", shape=[1, 3])
        tensor.contents.int64_contents.extend([101, 7592, 102] if name == "input_ids" else [1] * 3)
    return request


def http_calls(server) -> dict[str, tuple[str, dict]]:
    """A call of each HTTP door that runs the model: its path and body."""
    model = server.model
    return {"openai": ("/v1/embeddings", {"model": model, "input": "hi"}),
            "tei": ("/embed", {"inputs": "hi"}),
            "kserve": (f"/v2/models/{model}/infer", {"inputs": [
                {"name": "input_ids", "shape": [1, 3], "datatype": "INT64",
                 "data": [101, 7592, 102]},
                {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64",
                 "data": [1, 1, 1]}]})}


def grpc_calls(channel, server, key: str, priority: str | None = None,
               field: str = "") -> list:
    """A call of each gRPC service that runs the model, with `priority` as metadata and
    `field` as attnserve.v1's request field."""
    meta = metadata(key, priority)
    kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
    return [lambda: stub(channel).Embed(pb.EmbedRequest(texts=["hi"], priority=field),
                                        metadata=meta, timeout=WAIT_S),
            lambda: kserve.ModelInfer(infer_request(server.model), metadata=meta,
                                      timeout=WAIT_S)]


def waited(server, before, priority: str) -> float:
    """Requests the model's queue took as `priority` since the scrape `before`."""
    return delta(before, server.scrape(), "attnserve_queue_wait_seconds_count",
                 model=server.model, priority=priority)


@pytest.mark.workers
def test_each_door_takes_the_class_and_a_keys_class_wins(server):
    before = server.scrape()
    for path, body in http_calls(server).values():
        status, _, answer = http(server, path, body, PLAIN, "bulk")
        assert status == 200, answer
    with grpc.insecure_channel(server.address) as channel:
        for call in grpc_calls(channel, server, PLAIN, "bulk"):
            call()
        stub(channel).Embed(pb.EmbedRequest(texts=["hi"], priority="Bulk"),
                            metadata=metadata(PLAIN), timeout=WAIT_S)
    assert waited(server, before, "bulk") == 6
    assert waited(server, before, "interactive") == 0

    # A bulk key's calls are bulk, whatever they name; a call that names none is
    # interactive.
    before = server.scrape()
    for path, body in http_calls(server).values():
        assert http(server, path, body, BULK_KEY, "interactive")[0] == 200
    with grpc.insecure_channel(server.address) as channel:
        for call in grpc_calls(channel, server, BULK_KEY, "interactive", "interactive"):
            call()
        stub(channel).Embed(pb.EmbedRequest(texts=["hi"]), metadata=metadata(PLAIN),
                            timeout=WAIT_S)
    assert waited(server, before, "bulk") == 5
    assert waited(server, before, "interactive") == 1
    after = server.scrape()
    assert delta(before, after, "attnserve_requests_total", rpc="Embed", code="OK",
                 model=server.model, priority="bulk") == 1


def test_an_unknown_class_is_refused_naming_the_classes(server):
    for door, (path, body) in http_calls(server).items():
        status, _, answer = http(server, path, body, PLAIN, "urgent")
        assert status == (422 if door == "tei" else 400), (door, answer)
        assert "x-priority" in json.dumps(answer) and CLASSES_NAMED in json.dumps(answer)
    with grpc.insecure_channel(server.address) as channel:
        calls = (grpc_calls(channel, server, PLAIN, "urgent")
                 + grpc_calls(channel, server, PLAIN, field="urgent")[:1])
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert CLASSES_NAMED in refused.value.details()


def log_since(server, start: int) -> list[str]:
    return server.output()[start:].splitlines()


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S} s")
        time.sleep(0.01)


def started(lines: list[str], priority: str) -> list[int]:
    return [i for i, line in enumerate(lines)
            if "event=batch_started" in line and f"priority={priority}" in line]


@pytest.mark.workers
def test_an_interactive_call_runs_in_the_next_batch(server):
    """Behind a bulk request of many batches, an interactive call runs beside the bulk
    batch running when it arrives and waits for no other: one formed behind the running one
    is put back unless it had started as the call arrived."""
    start = len(server.output())
    with grpc.insecure_channel(server.address) as channel:
        bulk = stub(channel).Embed.future(pb.EmbedRequest(
            texts=["bulk text of a few words"] * 2000, priority="bulk"),
            metadata=metadata(PLAIN), timeout=WAIT_S)
        try:
            until(lambda: started(log_since(server, start), "bulk"), "a bulk batch started")
            stub(channel).Embed(pb.EmbedRequest(texts=["query"]), metadata=metadata(PLAIN),
                                timeout=WAIT_S)
            assert not bulk.done()
            # The bulk request goes on after the call; it is cancelled only once its log
            # says so, or the cancel could come before its next batch starts.
            until(lambda: resumed(log_since(server, start)),
                  "a bulk batch started after the interactive one")
        finally:
            bulk.cancel()
    # Batches are formed in order on the event loop, and each thread starts its own in the
    # order formed; but a batch beside starts on another thread than the bulk ones, so the
    # order of start lines across the two says less than the order of forming.
    lines = log_since(server, start)
    queued, _ = interactive_run(lines)
    formed = next(i for i, line in enumerate(lines) if i > queued and "event=batch_formed" in line
                  and "priority=interactive" in line)
    between = [i for i in started(lines, "bulk") if queued < i < formed]
    assert len(between) <= 1, lines[queued:formed + 1]


def interactive_run(lines: list[str]) -> tuple[int, int]:
    """The log lines where the interactive call was queued and where its batch started."""
    queued = next(i for i, line in enumerate(lines)
                  if "event=queued" in line and "priority=interactive" in line)
    return queued, next(i for i in started(lines, "interactive") if i > queued)


def resumed(lines: list[str]) -> bool:
    try:
        _, runs = interactive_run(lines)
    except StopIteration:  # the interactive batch's line is not in the log yet
        return False
    return any(i > runs for i in started(lines, "bulk"))


@pytest.mark.workers
def test_a_bulk_caller_finishes_under_a_steady_interactive_stream(server):
    """Interactive callers keep the interactive class waiting all along; the bulk
    request still finishes (its wait is bounded by --priority-aging-ms) while they go on."""
    start = len(server.output())
    done = threading.Event()
    answered = []

    def interactive() -> None:
        with grpc.insecure_channel(server.address) as channel:
            for _ in range(5000):  # bounded: far more than the bulk request needs
                if done.is_set():
                    return
                stub(channel).Embed(pb.EmbedRequest(texts=["query"]),
                                    metadata=metadata(PLAIN), timeout=WAIT_S)
                answered.append(time.monotonic())

    callers = [threading.Thread(target=interactive) for _ in range(3)]
    for caller in callers:
        caller.start()
    try:
        until(lambda: len(answered) >= 10, "the interactive stream flowing")
        with grpc.insecure_channel(server.address) as channel:
            response = stub(channel).Embed(pb.EmbedRequest(texts=["bulk text"] * 8 * BATCH,
                                                           priority="bulk"),
                                           metadata=metadata(PLAIN), timeout=WAIT_S)
        finished = time.monotonic()
        assert len(response.embeddings) == 8 * BATCH
    finally:
        done.set()
        for caller in callers:
            caller.join(WAIT_S)
    assert all(not caller.is_alive() for caller in callers)
    assert any(t > finished for t in answered), "the interactive stream had stopped"
    assert len(started(log_since(server, start), "bulk")) >= 8


def held_call(server, key: str) -> socket.socket:
    """An HTTP call whose body never comes: in flight until the socket is closed."""
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=WAIT_S)
    sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nAuthorization: Bearer {key}\r\nContent-Length: 100\r\n\r\n{{".encode())
    return sock


@pytest.mark.workers
def test_a_keys_in_flight_cap_answers_429_and_resource_exhausted_with_retry_after(server):
    path, body = http_calls(server)["openai"]
    sock = held_call(server, CAPPED)
    try:
        until(lambda: re.search(r"^attnserve_inflight_requests\{[^}]*\} [1-9]",
                                server.scrape_text(), re.M), "the held call in flight")
        # Every connection (with --workers, whichever front end takes it) is refused.
        for _ in range(4):
            status, headers, answer = http(server, path, body, CAPPED)
            assert status == 429 and headers.get("Retry-After") == "1", answer
            assert "max_inflight" in answer["error"]["message"]
            with grpc.insecure_channel(server.address) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    stub(channel).Embed(pb.EmbedRequest(texts=["hi"]),
                                        metadata=metadata(CAPPED), timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "1") in refused.value.trailing_metadata()
        # Another key's calls are not counted against it.
        assert http(server, path, body, PLAIN)[0] == 200
    finally:
        sock.close()
    # The held call ends with its connection: the key's place is free again.
    until(lambda: http(server, path, body, CAPPED)[0] == 200, "the capped key let in again")
