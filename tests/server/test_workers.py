"""Promise: a server of several processes (--workers) holds together. A front end killed
under load fails only its own calls: the other goes on answering every call, health stays
SERVING, the engine drops the dead one's queued sequences unrun, what it held in the
memory budget is freed, its death is counted, and a new one takes its place. The engine
killed: the front ends answer UNAVAILABLE at once, health says NOT_SERVING, and the server
exits non-zero (so Kubernetes restarts the pod). SIGTERM or SIGINT to the whole process
group (Ctrl-C, systemd) drains it and exits 0, as to the supervisor alone; a supervisor
killed with SIGKILL takes its processes with it. The group's ports are its own: another
server on either fails at start.

(The API, admission, deadlines, drain, hostile input and metrics promises run against
`--workers 2` too: the modules marked `workers`.)"""

import json
import os
import re
import signal
import socket
import subprocess
import threading
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
from tests.harness import ATTNSERVE, REPO, ServerProcess, delta, sample
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

# A replacement front end is a new process, started on a machine the test's callers keep
# busy: a bound far past its start, not a figure it must meet.
WHOLE_WITHIN_S = 10.0


def children(pid: int) -> dict[str, list[int]]:
    """The supervisor's processes by role: {"engine": [pid], "front": [pids], "standby":
    [pids]}: a front end listens on the group's ports, the standby that waits to take a
    dead one's place on none."""
    listening = {line.split()[9] for table in ("tcp", "tcp6")
                 for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]
                 if line.split()[3] == "0A"}
    found: dict[str, list[int]] = {"engine": [], "front": [], "standby": []}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            sockets = {os.readlink(fd)[8:-1] for fd in Path(f"/proc/{child}/fd").iterdir()
                       if os.readlink(fd).startswith("socket:[")}
        except OSError:  # gone meanwhile
            continue
        role = ("engine" if b"attnserve.server.workers.engine_process" in args else
                "front" if sockets & listening else "standby")
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
    """The status of the answer on `sock`, or None if the connection closed without one.
    A wait past the socket's timeout raises: a slow answer is not a lost one."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
    except ConnectionError:
        return None
    return int(data.split()[1])


def replaced(server, gone: int) -> bool:
    """A new front end has taken the place of `gone` and the group is whole again: two
    front ends, neither of them `gone`, and each death answered by a front end up (its
    ports open, the moment it marks itself up in the shared state)."""
    fronts = children(server.proc.pid)["front"]
    log = server.output()
    return (len(fronts) == 2 and gone not in fronts
            and log.count("event=front_end_up") == 2 + log.count("event=worker_died"))


def listen_once_free(port: int, within_s: float = 30.0) -> None:
    """Listen on `port` as a server of one process would (SO_REUSEADDR: past the closed
    connections' TIME_WAIT). While the kernel still holds the port only for connections
    that are closing (a dead process's sockets, FIN_WAIT to TIME_WAIT), the bind is tried
    again, for at most `within_s`; a listener on the port fails at once."""
    deadline = time.monotonic() + within_s
    while True:
        rows = [line.split() for table in ("tcp", "tcp6")
                for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]
                if int(line.split()[1].split(":")[1], 16) == port]
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
                return
            except OSError:
                listening = any(row[3] == "0A" for row in rows)
                if listening or time.monotonic() > deadline:
                    raise AssertionError(f"port {port} still held: {rows}") from None
        time.sleep(0.1)


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
    """The engine busy with a long request from b of many small batches (one onnxruntime
    thread, four sequences a batch), a call from each front end queued behind it: the
    queue itself says when a's call waits behind the long request's sequences with three
    batches of them yet to run (the oldest sequences run first, and a short one never
    joins a long one's batch), and a is killed then: its sequences cannot have run."""
    model = load_artifact(minilm_artifact).manifest.model_name
    batch, long = 4, 64
    with serve(minilm_artifact, "--workers", "2", "--intra-op-threads", "1",
               "--max-batch-size", str(batch)) as server:
        a, b = children(server.proc.pid)["front"]
        long_call, queued_b = (connection_to(server, b, server.http_port) for _ in range(2))
        queued_a = connection_to(server, a, server.http_port)
        start = server.scrape()
        # Sixteen batches on one thread: on a busy machine that is longer than a call's
        # usual 30 s socket timeout.
        long_call.settimeout(300)
        long_call.sendall(http_embed(model, ["word " * 500] * long))
        assert wait_for(lambda: sample(server.scrape(), "attnserve_queue_depth") == 1, 30)
        queued_a.sendall(http_embed(model, ["queued on a"] * 8))
        queued_b.sendall(http_embed(model, ["queued on b"] * 3))

        def waiting_behind_the_long_request() -> bool:
            now = server.scrape()
            return (sample(now, "attnserve_queue_depth") == 3
                    and delta(start, now, "attnserve_batch_size_sum") <= long - 3 * batch)

        assert wait_for(waiting_behind_the_long_request, 30)
        before = server.scrape()
        os.kill(a, signal.SIGKILL)
        killed = time.monotonic()
        assert status_of(queued_a) is None  # its call failed: the connection went with it
        back = wait_for(lambda: replaced(server, a), WHOLE_WITHIN_S)
        back_in = time.monotonic() - killed
        answers = status_of(long_call), status_of(queued_b)
        assert answers == (200, 200), server.output()[-4000:]
        after = server.scrape()
    assert back and back_in < WHOLE_WITHIN_S, back_in
    assert delta(before, after, "attnserve_worker_deaths_total") == 1
    assert delta(before, after, "attnserve_dropped_sequences_total", reason="cancelled") == 8
    # Run in all: the long request's sequences and b's 3 texts; never a's 8.
    assert delta(start, after, "attnserve_batch_size_sum") == long + 3
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
            # Closed unread: else the drain at the end waits out --drain-seconds on its answer.
            served.close()
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


CALLERS_EACH = 8
MOST_CALLS = 20_000  # a bound on every loop below, far past any test's length
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def client_ports(server_port: int) -> set[int]:
    """The local ports of this machine's established connections to `server_port`."""
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == server_port and fields[3] == "01":
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


def channels_to(server, wanted: dict[int, int]) -> dict[int, list[grpc.Channel]]:
    """`wanted[pid]` gRPC channels whose connection front end `pid` accepted: opened one
    at a time, each its own connection, the kernel spreading them; the extra ones closed."""
    found: dict[int, list[grpc.Channel]] = {pid: [] for pid in wanted}
    for _ in range(500):
        if all(len(found[pid]) >= n for pid, n in wanted.items()):
            return found
        before = client_ports(server.port)
        channel = grpc.insecure_channel(server.address, options=OWN_CONNECTION)
        grpc.channel_ready_future(channel).result(timeout=30)
        (port,) = client_ports(server.port) - before
        pid = None
        if wait_for(lambda port=port: owner(server.port, port, list(wanted)) is not None, 5):
            pid = owner(server.port, port, list(wanted))
        if pid is not None and len(found[pid]) < wanted[pid]:
            found[pid].append(channel)
        else:
            channel.close()
    raise AssertionError(f"connections did not reach every front end: {found}")


class Caller(threading.Thread):
    """Embed after Embed on one channel until `stop`: each call's start, end and code."""

    def __init__(self, channel: grpc.Channel, stop: threading.Event, seed: int):
        super().__init__(daemon=True)
        self.channel, self.stop, self.seed = channel, stop, seed
        self.calls: list[tuple[float, float, grpc.StatusCode, str]] = []
        self.in_call = False

    def run(self) -> None:
        rng = np.random.default_rng(self.seed)
        encoder = stub(self.channel)
        for _ in range(MOST_CALLS):
            if self.stop.is_set():
                return
            request = embed_ids([ids_of(rng, int(rng.integers(2, 64))) for _ in range(4)])
            started = time.monotonic()
            self.in_call = True
            try:
                encoder.Embed(request, timeout=30)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as err:
                code, details = err.code(), err.details() or ""
            self.in_call = False
            self.calls.append((started, time.monotonic(), code, details))
            if code != grpc.StatusCode.OK:
                time.sleep(0.05)  # a process going: keep knocking, gently

    def ok(self, after: float = 0.0) -> int:
        return sum(1 for started, _, code, _ in self.calls
                   if code == grpc.StatusCode.OK and started > after)

    def failures(self) -> list[grpc.StatusCode]:
        return [code for _, _, code, _ in self.calls if code != grpc.StatusCode.OK]


class Poll(threading.Thread):
    """`check()` again and again until `stop`: what each answered."""

    def __init__(self, check, stop: threading.Event):
        super().__init__(daemon=True)
        self.check, self.stop = check, stop
        self.seen: list[object] = []

    def run(self) -> None:
        for _ in range(MOST_CALLS):
            if self.stop.is_set():
                return
            self.seen.append(self.check())
            time.sleep(0.01)


def health_on(channel: grpc.Channel) -> str:
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except grpc.RpcError as err:
        return err.code().name


def http_health(sock: socket.socket) -> int | None:
    """GET /health on a kept-alive connection: the status, None if the connection went."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
        while len(body) < length:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            body += chunk
    except OSError:
        return None
    return int(head.split()[1])


def test_a_killed_front_end_fails_only_calls_on_its_connections_and_health_stays_serving(
        tiny_artifact):
    with serve(tiny_artifact, "--workers", "2") as server:
        victim, survivor = children(server.proc.pid)["front"]
        # Eight channels on each front end, and one more on the survivor for health.
        channels = channels_to(server, {victim: CALLERS_EACH, survivor: CALLERS_EACH + 1})
        health_channel = channels[survivor].pop()
        http_sock = connection_to(server, survivor, server.http_port)
        http_sock.settimeout(10)
        stop = threading.Event()
        callers = {pid: [Caller(channel, stop, seed=k + (100 if pid == survivor else 0))
                         for k, channel in enumerate(channels[pid])] for pid in channels}
        polls = {"gRPC health on the survivor": Poll(lambda: health_on(health_channel), stop),
                 "gRPC health, a connection each": Poll(lambda: health(server.address), stop),
                 "HTTP /health on the survivor": Poll(lambda: http_health(http_sock), stop)}
        everyone = [*callers[victim], *callers[survivor], *polls.values()]
        for thread in everyone:
            thread.start()
        try:
            assert wait_for(lambda: all(c.ok() >= 5 for pid in callers for c in callers[pid]), 60)
            # Killed while its callers wait on it.
            assert wait_for(lambda: sum(c.in_call for c in callers[victim]) >= 4, 30)
            before = server.scrape()
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            assert wait_for(lambda: replaced(server, victim), 30)
            whole_in = time.monotonic() - killed
            # The survivor's callers go on for a while after the group is whole again.
            whole_at = time.monotonic()
            assert wait_for(lambda: all(c.ok(after=whole_at) >= 20 for c in callers[survivor]),
                            60)
        finally:
            stop.set()
            for thread in everyone:
                thread.join(60)
        (replacement,) = set(children(server.proc.pid)["front"]) - {survivor}
        served = connection_to(server, replacement, server.http_port)
        served.sendall(http_embed(load_artifact(tiny_artifact).manifest.model_name, ["back"]))
        assert status_of(served) == 200
        after = server.scrape()
        health_channel.close()
        for channel in channels[victim] + channels[survivor]:
            channel.close()

    survivor_failures = [code for c in callers[survivor] for code in c.failures()]
    victim_failures = [code for c in callers[victim] for code in c.failures()]
    during = sum(1 for c in callers[survivor] for started, _, code, _ in c.calls
                 if killed < started < killed + whole_in and code == grpc.StatusCode.OK)
    assert survivor_failures == [], survivor_failures
    assert during > 0, "the survivor answered no call while the group was short of one"
    assert victim_failures, "no call was in flight on the killed front end"
    assert set(victim_failures) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, \
        victim_failures
    assert set(polls["gRPC health on the survivor"].seen) == {"SERVING"}, \
        polls["gRPC health on the survivor"].seen
    # A new connection may meet the dying process's port (an error), never NOT_SERVING.
    assert "NOT_SERVING" not in polls["gRPC health, a connection each"].seen
    assert set(polls["HTTP /health on the survivor"].seen) == {200}, \
        polls["HTTP /health on the survivor"].seen
    assert delta(before, after, "attnserve_worker_deaths_total") == 1
    assert whole_in < WHOLE_WITHIN_S, whole_in
    print(f"\nfront end killed under {2 * CALLERS_EACH} callers: whole again in {whole_in:.2f}s; "
          f"the survivor's {CALLERS_EACH} callers {sum(c.ok() for c in callers[survivor])} OK "
          f"({during} while one was down), 0 failed; the killed one's {CALLERS_EACH} callers "
          f"{len(victim_failures)} failed ({', '.join(sorted({c.name for c in victim_failures}))}) "
          f"and {sum(c.ok(after=killed) for c in callers[victim])} OK after the kill; "
          + "; ".join(f"{name}: {len(p.seen)} checks, "
                      f"{sum(v in ('SERVING', 200) for v in p.seen)} serving"
                      for name, p in polls.items()))


def answered(log: str) -> dict[str, int]:
    """The calls the group answered by code, from its `event=stopped` line (code=0)."""
    stopped = re.search(r"event=stopped all_finished=True answered=(\S+) code=0", log)
    assert stopped, log[-3000:]
    if stopped.group(1) == "none":
        return {}
    return {k: int(v) for k, v in (kv.split(":") for kv in stopped.group(1).split(","))}


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet, every thread of it. The
    main thread of a killed process turns zombie while its other threads still exit, and
    the last of them is the one that closes its sockets: a listener outlives a zombie main
    thread by that moment."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # that thread has exited meanwhile
            continue
        if state != "Z":
            return False
    return True


@pytest.mark.parametrize("load", [False, True], ids=["idle", "under load"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_drains_it_and_exits_0(tiny_artifact, sig, load):
    server = ServerProcess(tiny_artifact, "--workers", "2", start_new_session=True)
    stop = threading.Event()
    callers: list[Caller] = []
    try:
        pids = children(server.proc.pid)
        if load:
            callers = [Caller(grpc.insecure_channel(server.address, options=OWN_CONNECTION),
                              stop, seed) for seed in range(CALLERS_EACH)]
            for caller in callers:
                caller.start()
            assert wait_for(lambda: all(c.ok() >= 10 for c in callers), 60)
        # What Ctrl-C and systemd's KillMode=control-group do: every process at once.
        os.killpg(server.proc.pid, sig)
        signalled = time.monotonic()
        code = server.proc.wait(60)
    finally:
        stop.set()
        for caller in callers:
            caller.join(60)
            caller.channel.close()
        server.stop()
    log = server.output()
    assert code == 0, log[-3000:]
    counted = answered(log)
    assert "event=engine_lost" not in log and "event=engine_died" not in log, log[-3000:]
    assert all(gone(pid) for pid in pids["engine"] + pids["front"])
    calls = [call for caller in callers for call in caller.calls]
    ok = sum(1 for _, _, status, _ in calls if status == grpc.StatusCode.OK)
    refused = sum(1 for _, _, status, details in calls
                  if status == grpc.StatusCode.UNAVAILABLE and "draining" in details)
    for started, _, status, details in calls:
        if started < signalled:
            # Accepted and answered, or refused as new work by a group already draining, or
            # never accepted: sent before the signal, it can still wait inside gRPC for a
            # handler when the ports close, and gRPC cancels it (server/grpc/server.py). The
            # group's own count below shows it cancelled none that it had accepted.
            assert status == grpc.StatusCode.OK or status == grpc.StatusCode.CANCELLED or (
                status == grpc.StatusCode.UNAVAILABLE and "draining" in details), (status, details)
    # Every call the group answered reached its caller, with the answer it gave.
    assert counted.get("OK", 0) == ok and counted.get("UNAVAILABLE", 0) == refused, \
        (counted, ok, refused)
    assert set(counted) <= {"OK", "UNAVAILABLE"}, counted
    in_flight = sum(1 for started, ended, status, _ in calls
                    if started < signalled < ended and status == grpc.StatusCode.OK)
    if load:
        assert in_flight > 0, "no call was in flight at the signal"
    print(f"\n{sig.name} to the process group, {'under load' if load else 'idle'}: exit {code}; "
          f"{ok} OK ({in_flight} in flight at the signal), {refused} refused as draining, "
          f"{len(calls) - ok - refused} not reaching a server after it; the group counted "
          f"{counted or 'none'}")


def test_the_groups_processes_die_with_a_killed_supervisor(tiny_artifact):
    with serve(tiny_artifact, "--workers", "2") as server:
        group = children(server.proc.pid)
        pids = group["engine"] + group["front"] + group["standby"]
        assert len(group["standby"]) == 1
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        try:
            assert wait_for(lambda: all(gone(pid) for pid in pids), 30), \
                [pid for pid in pids if not gone(pid)]
        finally:
            for pid in pids:  # orphans of a broken promise, not left to hold the ports
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)
        # Nobody holds the ports: a server of one process could take them.
        for port in (server.port, server.http_port):
            listen_once_free(port)
    print(f"\nsupervisor killed: its {len(pids)} processes gone with it, the ports free")


def pipes(pid: int) -> int:
    return sum(os.readlink(fd).startswith("pipe:") for fd in Path(f"/proc/{pid}/fd").iterdir())


def test_a_dead_standby_leaves_no_pipe_open_when_a_front_end_takes_its_place(tiny_artifact):
    """The standby and a front end die at once (the supervisor stopped meanwhile, so its
    next poll finds both): a new process takes the front end's place, a new standby is
    started, and the supervisor holds as many pipes as before, the dead standby's closed."""
    with serve(tiny_artifact, "--workers", "2") as server:
        supervisor = server.proc.pid
        group = children(supervisor)
        held = pipes(supervisor)
        front, standby = group["front"][0], group["standby"][0]
        os.kill(supervisor, signal.SIGSTOP)
        try:
            for pid in (standby, front):
                os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: gone(standby) and gone(front), 30)
        finally:
            os.kill(supervisor, signal.SIGCONT)

        def whole() -> bool:
            now = children(supervisor)
            return replaced(server, front) and len(now["standby"]) == 1 and standby not in now["standby"]

        assert wait_for(whole, WHOLE_WITHIN_S), server.output()[-4000:]
        assert pipes(supervisor) == held, server.output()[-4000:]
        assert "event=worker_died" in server.output()
