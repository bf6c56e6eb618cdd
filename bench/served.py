"""attnserve end to end: `attnserve serve` as the benchmarks run it (a subprocess on
loopback, the client here: no torch, no onnxruntime in this process), what its /metrics
say around a measurement, and the attention maps' cost per request."""

import http.client
import json
import logging
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import grpc

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from bench.load import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES
from bench.measure import latency_summary, time_calls
from bench.workloads import Workload
from tests.harness import ATTNSERVE, REPO, Samples, ServerProcess, delta, make_tiny_checkpoint, sample

log = logging.getLogger("bench.served")


def bench_server(artifact: Path, log_path: Path, extra: list[str], threads: int) -> ServerProcess:
    """The server as the benchmark runs it, started: `threads` onnxruntime threads,
    messages large enough for every attention map, then `extra`."""
    return ServerProcess(artifact, "--intra-op-threads", str(threads),
                         "--max-message-bytes", str(MAX_MESSAGE_BYTES), *extra, log_path=log_path)


def tiny_artifact(directory: Path) -> Path:
    """The tests' tiny model (2 layers, 32 wide), exported once into `directory`: so cheap
    to run that the server's request path, not its model, decides its rate."""
    if (directory / "manifest.json").is_file():
        return directory
    checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tiny-checkpoint-")))
    subprocess.run([*ATTNSERVE, "export", "--out", str(directory), "--from", str(checkpoint)],
                   check=True, cwd=REPO, capture_output=True)
    shutil.rmtree(checkpoint)
    return directory


def answered(server: ServerProcess, **labels: str) -> float:
    """Embed calls the server has answered OK so far (of one model, given `model`)."""
    return sample(server.scrape(), "attnserve_requests_total", rpc="Embed", code="OK", **labels)


class HttpEmbedder:
    """POST /v1/embeddings on one kept-alive connection, the body an OpenAI client sends.
    The server closes a connection idle for --http-header-timeout-seconds (between the
    benchmark's blocks, say); a new one replaces it, as a client's connection pool does."""

    def __init__(self, server: ServerProcess, model: str):
        self.connection = http.client.HTTPConnection("127.0.0.1", server.http_port)
        self.model = model

    def embed(self, texts: list[str]) -> dict:
        body = json.dumps({"input": texts, "model": self.model})
        headers = {"Content-Type": "application/json"}
        try:
            self.connection.request("POST", "/v1/embeddings", body, headers)
            response = self.connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.connection.close()  # the next request opens a new connection
            self.connection.request("POST", "/v1/embeddings", body, headers)
            response = self.connection.getresponse()
        answer = response.read()
        if response.status != 200:
            raise RuntimeError(f"/v1/embeddings: HTTP {response.status}: {answer[:300]!r}")
        return json.loads(answer)

    def close(self) -> None:
        self.connection.close()


def server_breakdown(before: Samples, after: Samples) -> dict:
    """Seconds per server stage, batch counts and tokens over a measurement."""
    stages = defaultdict(float)
    for stage in ("queue", "tokenize", "inference", "respond"):
        stages[stage] = delta(before, after, "attnserve_stage_duration_seconds_sum", stage=stage)
    requests = delta(before, after, "attnserve_request_duration_seconds_count", rpc="Embed")
    return {
        "stage_seconds": dict(stages),
        "request_seconds": delta(before, after, "attnserve_request_duration_seconds_sum",
                                 rpc="Embed"),
        "requests": requests,
        "batches": delta(before, after, "attnserve_batch_size_count"),
        "sequences": delta(before, after, "attnserve_batch_size_sum"),
        "real_tokens": delta(before, after, "attnserve_batch_tokens_sum", kind="real"),
        "padded_tokens": delta(before, after, "attnserve_batch_tokens_sum", kind="padded"),
    }


class Measured:
    """Scrapes, CPU seconds of server and client around one measurement; `merge` adds up
    the summaries of several blocks of the same measurement."""

    def __init__(self, server: ServerProcess):
        self.server = server

    def __enter__(self):
        self.before = self.server.scrape()
        self.status = self.server.status()
        self.client_cpu = time.process_time()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.client_cpu = time.process_time() - self.client_cpu
        self.after = self.server.scrape()
        status = self.server.status()
        self.server_cpu = status["cpu_s"] - self.status["cpu_s"]

    def summary(self) -> dict:
        out = server_breakdown(self.before, self.after)
        out.update(wall_s=self.wall, server_cpu_s=self.server_cpu, client_cpu_s=self.client_cpu)
        return out

    @staticmethod
    def merge(summaries: list[dict]) -> dict:
        out: dict = {}
        for summary in summaries:
            for key, value in summary.items():
                if isinstance(value, dict):
                    inner = out.setdefault(key, {})
                    for k, v in value.items():
                        inner[k] = inner.get(k, 0.0) + v
                else:
                    out[key] = out.get(key, 0.0) + value
        return out


ATTENTION_CONFIGS = (("none", None, False), ("none", None, True), ("one", [0], False),
                     ("one", [0], True), ("all", [], False), ("all", [], True))


def attention_request(texts: list[str], layers: list[int] | None, fp16: bool) -> pb.EmbedRequest:
    request = pb.EmbedRequest(texts=texts, dtype=pb.DTYPE_FLOAT16 if fp16 else pb.DTYPE_FLOAT32)
    if layers is not None:
        request.attention.CopyFrom(pb.AttentionOptions(layers=layers))  # []: every layer
    return request


def measure_attention(server: ServerProcess, workload: Workload, reps, num_layers: int) -> dict:
    """Per request at the attention shape: time and response bytes, for no maps, one
    layer and all layers, each in float32 and float16."""
    shape = workload.attention
    out = {"shape": shape.name}
    with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        for name, layers, fp16 in ATTENTION_CONFIGS:
            request = attention_request(shape.inputs.texts, layers, fp16)
            nbytes = stub.Embed(request).ByteSize()
            seconds = time_calls(lambda request=request: stub.Embed(request), reps)
            row = latency_summary(seconds)
            row.update(layers=name, dtype="float16" if fp16 else "float32", response_bytes=nbytes,
                       layers_returned=0 if layers is None else len(layers) or num_layers)
            out[f"{name}_{row['dtype']}"] = row
            log.info("phase=grpc attention=%s dtype=%s p50_ms=%.1f bytes=%d", name, row["dtype"],
                     row["p50_ms"], nbytes)
    return out


def measure_attention_memory(artifact: Path, workload: Workload, log_dir: Path,
                             extra: list[str], threads: int, quick: bool) -> dict:
    """The memory one request at the attention shape takes in a FRESH server per choice
    (memory an earlier request freed stays resident and would hide the next one's cost):
    the server's own attnserve_batch_peak_memory_bytes for that batch, and the rise of
    the server's resident high-water mark over its idle resident set."""
    out = {}
    for name, layers, fp16 in ATTENTION_CONFIGS:
        if quick and fp16:  # float16 changes the response, not the batch: full runs only
            continue
        dtype = "float16" if fp16 else "float32"
        server = bench_server(artifact, log_dir / f"server-memory-{name}-{dtype}.log", extra,
                              threads)
        try:
            idle = server.status()["rss"]
            before = server.scrape()
            with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
                pb_grpc.EncoderServiceStub(channel).Embed(
                    attention_request(workload.attention.inputs.texts, layers, fp16))
            status, after = server.status(), server.scrape()
        finally:
            server.stop()
        label = "false" if layers is None else "true"
        out[f"{name}_{dtype}"] = {
            "batch_peak_bytes": delta(before, after, "attnserve_batch_peak_memory_bytes_sum",
                                      attention=label),
            "request_peak_rss_bytes": max(0, status["hwm"] - idle),
            "idle_rss_bytes": idle,
        }
        log.info("phase=grpc_memory attention=%s dtype=%s batch_peak_mib=%.0f "
                 "request_peak_mib=%.0f", name, dtype,
                 out[f"{name}_{dtype}"]["batch_peak_bytes"] / 2**20,
                 out[f"{name}_{dtype}"]["request_peak_rss_bytes"] / 2**20)
    return out
