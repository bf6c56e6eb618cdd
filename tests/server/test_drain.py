"""Promise: graceful drain. On SIGTERM health turns NOT_SERVING, new work gets UNAVAILABLE,
accepted work finishes (correctly) within --drain-seconds, and the process exits 0: no
accepted request is lost.

"Accepted" is counted by the server itself: it logs the calls it answered by status when it
stops, and every one it answered OK must have reached its caller, correct. A call that
reaches gRPC at the instant the port closes, before any handler saw it, is cancelled by
gRPC (CANCELLED): it was never accepted, and it can only be one sent after SIGTERM."""

import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import sample
from tests.server.reliability import (
    BIG,
    MIB,
    Reference,
    ZeroWindowClient,
    answering,
    embed_ids,
    health,
    ids_of,
    read_answer,
    sequences_for,
    serve,
    stalled_http_infer,
    stub,
    wait_for,
)

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

CALLERS = 8
LOAD_BEFORE_S = 1.5
AFTER_SIGTERM_S = 3.0
# Longer than the second the ports give answers to be sent once they close.
READ_LATER_S = 3.0
EMBED = "/attnserve.v1.EncoderService/Embed"


def test_sigterm_under_load_answers_everything_accepted_and_exits_0(tiny_artifact):
    reference = Reference(tiny_artifact)
    server = serve(tiny_artifact, "--max-wait-ms", "2")
    outcomes: list[tuple[list[list[int]], grpc.StatusCode, object, float]] = []
    lock = threading.Lock()
    sigterm_at = time.monotonic() + LOAD_BEFORE_S
    stop_at = sigterm_at + AFTER_SIGTERM_S

    def caller(seed: int) -> int:
        rng = np.random.default_rng(seed)
        sent = 0
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder = stub(channel)
            while time.monotonic() < stop_at and sent < 2000:
                sequences = [ids_of(rng, int(rng.integers(1, 129)))
                             for _ in range(int(rng.integers(1, 4)))]
                sent += 1
                started = time.monotonic()
                try:
                    response = encoder.Embed(embed_ids(sequences), timeout=30)
                    outcome = (sequences, grpc.StatusCode.OK, response, started)
                except grpc.RpcError as err:
                    outcome = (sequences, err.code(), err.details(), started)
                with lock:
                    outcomes.append(outcome)
                if outcome[1] != grpc.StatusCode.OK and time.monotonic() > sigterm_at:
                    time.sleep(0.05)  # the server is going: keep knocking, gently
        return sent

    with ThreadPoolExecutor(CALLERS) as pool:
        counts = [pool.submit(caller, seed) for seed in range(CALLERS)]
        time.sleep(LOAD_BEFORE_S)
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        sent = sum(c.result() for c in counts)
    log = server.output()
    server.stop()

    assert code == 0, log[-2000:]
    stopped = re.search(r"event=stopped all_finished=True answered=(\S+)", log)
    assert stopped, log[-2000:]
    answered = {k: int(v) for k, v in (kv.split(":") for kv in stopped.group(1).split(","))}
    by_code: dict[str, int] = {}
    for sequences, status, response, started in outcomes:
        if status == grpc.StatusCode.UNAVAILABLE and "draining" not in response:
            # Not the server's answer: the port had closed (connection refused).
            status_name = "UNAVAILABLE_CLOSED"
            assert started > sigterm_at, ("a call sent before SIGTERM found no server", response)
        else:
            status_name = status.name
        by_code[status_name] = by_code.get(status_name, 0) + 1
        if status == grpc.StatusCode.OK:
            for ids, embedding in zip(sequences, response.embeddings, strict=True):
                reference.check_embedding(ids, embedding)
        elif status == grpc.StatusCode.CANCELLED:
            assert started > sigterm_at, "a call sent before SIGTERM was cancelled"
        else:
            assert status == grpc.StatusCode.UNAVAILABLE, (status, response)
    # Both of the server's own answers reached callers: work finished, and new work
    # refused as draining (not merely connections refused once it had gone).
    assert by_code.get("OK", 0) > 0 and by_code.get("UNAVAILABLE", 0) > 0, by_code
    # Every call the server answered reached its caller, with the answer it gave.
    assert answered.get("OK", 0) == by_code["OK"], (answered, by_code)
    assert answered.get("UNAVAILABLE", 0) == by_code["UNAVAILABLE"], (answered, by_code)
    assert set(answered) <= {"OK", "UNAVAILABLE"}, answered
    print(f"\ndrain under load: sent={sent} client_ok={by_code.get('OK', 0)} "
          f"server_ok={answered.get('OK', 0)} draining={by_code.get('UNAVAILABLE', 0)} "
          f"server_draining={answered.get('UNAVAILABLE', 0)} "
          f"refused_after_close={by_code.get('UNAVAILABLE_CLOSED', 0)} "
          f"cancelled_at_close={by_code.get('CANCELLED', 0)} exit={code}")


def test_sigterm_during_a_long_request_finishes_it_and_refuses_new_work(minilm_artifact):
    reference = Reference(minilm_artifact)
    server = serve(minilm_artifact, "--drain-seconds", "120")
    rng = np.random.default_rng(7)
    ids = ids_of(rng, 512)
    try:
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder = stub(channel)
            kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
            assert health(server.address) == "SERVING"
            count = sequences_for(encoder, rng, 3.0)
            long_call = encoder.Embed.future(embed_ids([ids] * count), timeout=300)
            assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") >= 1, 30)
            server.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: health(server.address) == "NOT_SERVING", 10)
            assert health(server.address, "attnserve.v1.EncoderService") == "NOT_SERVING"
            assert not kserve.ServerReady(kpb.ServerReadyRequest(), timeout=10).ready
            try:
                encoder.Embed(embed_ids([ids_of(rng, 10)]), timeout=10)
                raise AssertionError("new work was accepted while draining")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert "draining" in err.details()
            assert not long_call.done(), "the long request finished before the checks"
            response = long_call.result()
        reference.check_embedding(ids, response.embeddings[0], atol=1e-4)
        assert len(response.embeddings) == count
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    print(f"\ndrain with a long request: NOT_SERVING, new work UNAVAILABLE, the {count}x512 "
          "request answered correctly, exit 0")


def test_answers_computed_before_sigterm_reach_callers_that_read_them_only_later(minilm_artifact):
    """A finished batch is not an answer sent: the drain waits, within --drain-seconds, for
    answers still being written, here to a gRPC caller whose receive window is 0 and an HTTP
    caller that reads nothing (a 63 MiB answer), for longer than any fixed grace for sending.
    Once they read, each gets its whole answer, correct, and the server exits 0."""
    reference = Reference(minilm_artifact)
    server = serve(minilm_artifact, "--drain-seconds", "60", "--max-message-bytes", str(256 * MIB))
    rng = np.random.default_rng(11)
    ids = ids_of(rng, 128)
    model = load_artifact(minilm_artifact).manifest.model_name
    stalled = ZeroWindowClient(server.address)
    sock = None
    try:
        stream = stalled.call(EMBED, embed_ids([ids]))
        assert wait_for(lambda: sample(server.scrape(), "attnserve_requests_total", rpc="Embed") >= 1, 60)
        sock = stalled_http_infer(server, model, ids_of(rng, 480))
        assert wait_for(lambda: answering(sock), 60)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(server.address) == "NOT_SERVING", 10)
        time.sleep(READ_LATER_S)
        assert server.proc.poll() is None, "the server stopped with answers unsent"
        assert not stalled.received(ZeroWindowClient.RST_STREAM), "the gRPC answer was cut off"

        stalled.read_all(stream)
        assert wait_for(lambda: stalled.ended(stream), 30), "no trailers for the gRPC answer"
        reference.check_embedding(ids, pb.EmbedResponse.FromString(stalled.message(stream)).embeddings[0],
                                  atol=1e-4)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)  # kept small to stall; now read
        sock.settimeout(60)
        status, headers, body = read_answer(sock)
        length = len(body)
        assert status == 200 and length == int(headers["content-length"]) and length > 60 * MIB, \
            (status, length, headers)
        assert server.proc.wait(60) == 0
        log = server.output()
        assert "all_finished=True" in log and "all_finished=False" not in log, log[-2000:]
    finally:
        stalled.close()
        if sock is not None:
            sock.close()
        server.stop()
    print(f"\ndrain with answers unread for {READ_LATER_S:.0f} s: the gRPC answer and the "
          f"{length / MIB:.0f} MiB HTTP answer arrived whole, exit 0")


def test_open_streams_owed_no_answer_do_not_hold_the_drain(tiny_artifact):
    """An EmbedStream whose one answer has been read and a health Watch are open, with no
    answer owed: the drain does not wait for them (--drain-seconds is 60), it ends them and
    the server exits 0 within seconds."""
    server = serve(tiny_artifact, "--drain-seconds", "60")
    more = threading.Event()

    def requests():
        yield pb.EmbedRequest(texts=["one answer, then nothing more"])
        more.wait(60)

    try:
        with grpc.insecure_channel(server.address) as channel:
            stream = stub(channel).EmbedStream(requests(), timeout=120)
            assert len(next(stream).embeddings) == 1
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(30) == 0
            stopped_s = time.monotonic() - started
            more.set()
            for call in (stream, watch):
                with pytest.raises(grpc.RpcError):
                    list(call)
        log = server.output()
        assert "all_finished=True" in log and "all_finished=False" not in log, log[-2000:]
    finally:
        more.set()
        server.stop()
    assert stopped_s < 10, stopped_s
    print(f"\ndrain with an idle EmbedStream and a health Watch open: exit 0 in {stopped_s:.1f} s")
