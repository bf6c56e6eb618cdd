"""Promise: a server of several processes (--workers) holds together. A front end killed
under load fails only its own calls: the engine drops its queued sequences unrun, what it
held in the memory budget is freed, its death is counted, and a new one serves within
2 s. The engine killed: the front ends answer UNAVAILABLE at once, health says
NOT_SERVING, and the server exits non-zero (so Kubernetes restarts the pod). The group's
ports are its own: another server on either fails at start.

(The API, admission, deadlines, drain, hostile input and metrics promises run against
`--workers 2` too: the modules marked `workers`.)"""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.artifact import load_artifact
from attnserve.server.memory.budget import RESPONSE_COPIES
from attnserve.server.memory.model import load_memory_model
from attnserve.server.workers.supervisor import auto_workers
from bench.harness import ATTNSERVE, REPO, delta, sample
from tests.server.reliability import (
    BIG,
    MIB,
    ZeroWindowClient,
    embed_ids,
    ids_of,
    sequences_for,
    serve,
    stub,
    wait_for,
)


def children(pid: int) -> dict[str, list[int]]:
    """The supervisor's processes by role: {"engine": [pid], "front": [pids]}."""
    found: dict[str, list[int]] = {"engine": [], "front": []}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        role = "engine" if b"attnserve.server.workers.engine_process" in args else "front"
        found[role].append(int(child))
    return found


def owner(server_port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the server side of the loopback TCP connection from
    `client_port`: its socket's inode, from /proc/net/tcp (or tcp6: gRPC accepts IPv4 on
    dual-stack sockets), among their descriptors."""
    inode = None
    rows = [line for table in ("tcp", "tcp6")
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]]
    for line in rows:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (int(local.split(":")[1], 16) == server_port
                and int(remote.split(":")[1], 16) == client_port):
            inode = fields[9]
    if inode is None:
        return None
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


def connection_to(server, pid: int, port: int) -> socket.socket:
    """A loopback connection that front end `pid` accepted (SO_REUSEPORT spreads new
    connections over the front ends: a few tries find one)."""
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        client_port = sock.getsockname()[1]
        if wait_for(lambda client_port=client_port: owner(port, client_port, [pid]) is not None,
                    0.5):
            return sock
        sock.close()
    raise AssertionError(f"no connection reached front end {pid}")


def http_embed(model: str, texts: list[str]) -> bytes:
    body = json.dumps({"model": model, "input": texts}).encode()
    return (f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def status_of(sock: socket.socket) -> int | None:
    """The status of the answer on `sock`, or None if the connection closed without one."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    return int(data.split()[1])


def replaced(server, gone: int) -> bool:
    """A new front end has taken the place of `gone` and the group serves again (the
    engine's view of the group, which has no polling delay)."""
    fronts = children(server.proc.pid)["front"]
    return (len(fronts) == 2 and gone not in fronts
            and sample(server.scrape(), "attnserve_health_serving") == 1)


def health(address: str) -> str | None:
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=1)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except grpc.RpcError:
        return None


def test_auto_is_one_process_on_the_cpu_and_several_on_a_gpu():
    assert [auto_workers(False, cores) for cores in (1, 2, 16, 64)] == [1, 1, 1, 1]
    assert [auto_workers(True, cores) for cores in (1, 2, 8, 16, 64)] == [1, 1, 4, 8, 8]


def test_the_ready_file_lists_the_group_and_one_metrics_answers_for_it(tiny_artifact):
    with serve(tiny_artifact, "--workers", "2") as server:
        ready = json.loads(server.ready_path.read_text())
        group = children(server.proc.pid)
        assert sorted(ready["pids"]) == sorted(group["engine"] + group["front"])
        assert len(group["engine"]) == 1 and len(group["front"]) == 2
        with grpc.insecure_channel(server.address) as channel:
            for _ in range(20):  # on one connection: one front end
                stub(channel).Embed(embed_ids([[101, 2000, 102]]), timeout=10)
        for _ in range(20):  # a connection each: both front ends
            with grpc.insecure_channel(server.address) as channel:
                stub(channel).Embed(embed_ids([[101, 2000, 102]]), timeout=10)
        samples = server.scrape()
    assert sample(samples, "attnserve_requests_total", rpc="Embed", code="OK") == 40
    assert sample(samples, "attnserve_batch_size_sum") == 40
    assert sample(samples, "attnserve_health_serving") == 1


def infer_request(model: str, ids: list[int]) -> bytes:
    """KServe REST: one sequence, every layer's attention maps back as binary data."""
    body = json.dumps({"inputs": [
        {"name": name, "datatype": "INT64", "shape": [1, len(ids)], "data": data}
        for name, data in (("input_ids", ids), ("attention_mask", [1] * len(ids)))],
        "outputs": [{"name": "attentions", "parameters": {"binary_data": True}}]}).encode()
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_a_killed_front_end_fails_only_its_calls_and_is_replaced(minilm_artifact):
    model = load_artifact(minilm_artifact).manifest.model_name
    rng = np.random.default_rng(3)
    # One onnxruntime thread and at most one batch's worth of sequences: the long request is
    # one batch, seconds long, that outlasts the kill and the replacement.
    with serve(minilm_artifact, "--workers", "2", "--intra-op-threads", "1") as server:
        a, b = children(server.proc.pid)["front"]
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            count = sequences_for(stub(channel), rng, 8.0, most=32)
        # The engine busy with a long request (from b), a call queued behind it on each.
        long_call = connection_to(server, b, server.http_port)
        long_call.sendall(http_embed(model, ["word " * 500] * count))
        assert wait_for(lambda: sample(server.scrape(), "attnserve_queue_depth") == 0
                        and sample(server.scrape(), "attnserve_inflight_requests") == 1, 30)
        queued_a = connection_to(server, a, server.http_port)
        queued_b = connection_to(server, b, server.http_port)
        queued_a.sendall(http_embed(model, ["queued on a"] * 8))
        queued_b.sendall(http_embed(model, ["queued on b"] * 3))
        assert wait_for(lambda: sample(server.scrape(), "attnserve_queue_depth") == 2, 30)
        before = server.scrape()
        os.kill(a, signal.SIGKILL)
        killed = time.monotonic()
        assert status_of(queued_a) is None  # its call failed: the connection went with it
        back = wait_for(lambda: replaced(server, a), 10)
        back_in = time.monotonic() - killed
        assert sample(server.scrape(), "attnserve_inflight_requests") >= 1, \
            "the long request ended before the checks"
        assert status_of(long_call) == 200 and status_of(queued_b) == 200
        after = server.scrape()
    assert back and back_in < 2.0, back_in
    assert delta(before, after, "attnserve_worker_deaths_total") == 1
    assert delta(before, after, "attnserve_dropped_sequences_total", reason="cancelled") == 8
    # Run after the kill: the long batch and b's 3 texts; never a's 8.
    assert delta(before, after, "attnserve_batch_size_sum") == count + 3
    print(f"\nfront end killed: replaced and SERVING in {back_in:.2f}s; its 8 queued "
          "sequences dropped unrun, the other's calls answered")


def test_a_killed_front_ends_held_memory_is_freed(minilm_artifact):
    """A front end holds an answer it cannot send (a reader that never reads); the same
    request on the other front end is refused for memory; once the first is killed, it
    fits."""
    manifest = load_artifact(minilm_artifact).manifest
    memory_model = load_memory_model(Path(minilm_artifact), manifest, "CPUExecutionProvider",
                                     "fp32")
    # A's answer and B's are alike: every layer's maps of 480 tokens, each held
    # RESPONSE_COPIES times over beside its batch's peak. The budget holds one of them
    # and half another.
    maps = manifest.num_layers * manifest.num_heads * 480 * 480 * 4
    peak = memory_model.predict(1, 480, manifest.num_heads, manifest.num_layers)
    budget = int(1.5 * RESPONSE_COPIES * maps + peak)
    rng = np.random.default_rng(4)
    with serve(minilm_artifact, "--workers", "2", "--memory-budget-bytes", str(budget),
               "--max-message-bytes", str(256 * MIB)) as server:
        fronts = children(server.proc.pid)["front"]
        stalled = ZeroWindowClient(server.address)
        try:
            port = stalled.sock.getsockname()[1]
            assert wait_for(lambda: owner(server.port, port, fronts) is not None, 10)
            a = owner(server.port, port, fronts)
            b = next(pid for pid in fronts if pid != a)
            stalled.call("/attnserve.v1.EncoderService/Embed", embed_ids([ids_of(rng, 480)], []))
            assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") == 1, 60)
            request = infer_request(manifest.model_name, ids_of(rng, 480))
            refused = connection_to(server, b, server.http_port)
            refused.sendall(request)
            assert status_of(refused) == 429
            os.kill(a, signal.SIGKILL)
            assert wait_for(lambda: replaced(server, a), 10)
            served = connection_to(server, b, server.http_port)
            served.sendall(request)
            assert status_of(served) == 200
        finally:
            stalled.close()


def test_a_killed_engine_makes_every_door_unavailable_and_the_server_exit(minilm_artifact):
    rng = np.random.default_rng(5)
    server = serve(minilm_artifact, "--workers", "2")
    try:
        engine = children(server.proc.pid)["engine"][0]
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder = stub(channel)
            count = sequences_for(encoder, rng, 3.0)
            long_call = encoder.Embed.future(embed_ids([ids_of(rng, 512)] * count), timeout=300)
            assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") >= 1, 30)
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                long_call.result(timeout=10)
            answered_in = time.monotonic() - killed
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as refused:
                encoder.Embed(embed_ids([ids_of(rng, 12)]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert health(server.address) in ("NOT_SERVING", None)
        code = server.proc.wait(60)
    finally:
        server.stop()
    assert answered_in < 1.0, answered_in
    assert code != 0
    assert re.search(r"event=engine_died", server.output())


def test_only_the_groups_own_front_ends_share_its_ports(tiny_artifact):
    with serve(tiny_artifact, "--workers", "2") as server:
        for extra in ([], ["--workers", "2"]):
            for flag, port in (("--port", server.port), ("--http-port", server.http_port)):
                other = ["--port", "0", "--http-port", "0", flag, str(port)]
                out = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact),
                                      "--device", "cpu", "--host", "127.0.0.1", "--metrics-port",
                                      "0", *other, *extra], cwd=REPO, capture_output=True,
                                     text=True, timeout=120)
                assert out.returncode == 2, out.stderr[-2000:]
                assert "address already in use" in out.stderr and flag in out.stderr
        assert health(server.address) == "SERVING"
