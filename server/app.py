"""Assemble and run the server: artifact -> backend -> request queue and batch loop ->
engine -> the doors (attnserve.v1 and KServe over gRPC, beside grpc.health.v1 and
reflection; OpenAI and KServe over HTTP), the Prometheus endpoint; drain on SIGTERM."""

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from attnserve.artifact import MEMORY_MODEL, TOKENIZER, Artifact, ArtifactError, load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2, encoder_pb2_grpc
from attnserve.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
from attnserve.server.config import ServeConfig
from attnserve.server.doors.front import ApiKeys
from attnserve.server.doors.grpc_calls import DecodeRequests, QuietHungUpCalls
from attnserve.server.doors.grpc_encoder import EncoderService
from attnserve.server.doors.grpc_kserve import KServeService
from attnserve.server.doors.http_server import HttpServers
from attnserve.server.engine.batch_loop import BatchLoop
from attnserve.server.engine.engine import Engine
from attnserve.server.engine.offload import Offload, create_executors, on_every_thread
from attnserve.server.engine.queue import Limits, RequestQueue
from attnserve.server.engine.tokenize import TextTokenizer
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.model import load_memory_model
from attnserve.server.memory.probe import MemoryProbe, machine_available_bytes
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.ort_backend import CPU, CUDA, OrtBackend, Strategy

log = logging.getLogger("attnserve.server")

SERVICES = (
    encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
)
# A batch may take this share of the memory that is free when the server starts.
DEFAULT_BUDGET_SHARE = 0.5
MAX_CONCURRENT_STREAMS = 1000


def credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    chain = [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
    if config.tls_client_ca is None:
        return grpc.ssl_server_credentials(chain)
    return grpc.ssl_server_credentials(chain, root_certificates=config.tls_client_ca.read_bytes(),
                                       require_client_auth=True)


def write_ready_file(path: Path, ports: dict[str, int]) -> None:
    """Tell whoever started the server that it serves, on which ports, as which pid:
    written beside `path` and renamed onto it, so a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({**ports, "pid": os.getpid()}))
    os.replace(partial, path)


class PortInUse(OSError):
    """A port another process holds: a server never shares its ports by accident."""

    def __init__(self, flag: str, address: str):
        super().__init__(f"{flag}: {address}: address already in use (by another attnserve "
                         "server, or another program); stop it or choose another port")


def load_tokenizer(artifact: Artifact) -> TextTokenizer:
    try:
        return TextTokenizer(artifact.path(TOKENIZER), artifact.manifest.max_positions)
    except Exception as err:  # noqa: BLE001 - `tokenizers` raises a bare Exception
        raise ArtifactError(f"{artifact.path(TOKENIZER)}: not a valid tokenizer ({err})") from err


class Core:
    """What owns the model: the backend's sessions, the memory budget, the request queue
    and the batch loop. Every start-up check happens in the constructor, with nothing
    bound yet."""

    def __init__(self, config: ServeConfig, artifact: Artifact, metrics: Metrics):
        self.config, self.artifact, self.metrics = config, artifact, metrics
        manifest = artifact.manifest
        self.backend = OrtBackend(artifact, config.device, config.precision,
                                  config.intra_op_threads, Strategy(
                                      config.shape_buckets, config.bucket_seq_multiple,
                                      config.max_batch_size, config.sessions,
                                      config.cuda_graphs == "on"))
        self.probe = MemoryProbe(cuda=self.backend.provider == CUDA)
        try:
            self.memory_model = load_memory_model(artifact.directory, manifest,
                                                  self.backend.provider, self.backend.precision)
        except (ValueError, TypeError) as err:
            raise ArtifactError(f"{artifact.path(MEMORY_MODEL)}: not a valid memory model "
                                f"({err})") from err
        budget = config.memory_budget_bytes or int(self.probe.available_bytes() * DEFAULT_BUDGET_SHARE)
        self.limits = Limits(config.max_batch_size, config.max_batch_tokens,
                             config.max_queue_requests, config.max_queue_tokens, budget,
                             config.max_wait_ms / 1000)
        # On CUDA the budget is the device's; requests and responses live in host memory,
        # under a limit of their own.
        self.memory = MemoryBudget(self.memory_model, budget, manifest.num_heads,
                                   manifest.hidden_size,
                                   responses_in_budget=self.backend.provider == CPU,
                                   host_bytes=int(machine_available_bytes() * DEFAULT_BUDGET_SHARE))
        self.ready = False

    def describe(self) -> None:
        m, memory = self.metrics, self.probe.device_memory()
        m.info.info({"model": self.artifact.manifest.model_name, "provider": self.backend.provider,
                     "precision": self.backend.precision,
                     "artifact_sha256": self.artifact.manifest_sha256})
        m.device_memory_used.labels(memory.device).set_function(lambda: self.probe.device_memory().used)
        m.device_memory_total.labels(memory.device).set(memory.total)

    def start(self) -> None:
        """The queue and the batch loop, on the running event loop."""
        self.executors = create_executors(self.backend.concurrency, self.backend.bind_thread)
        self.queue = RequestQueue(self.limits, self.memory, self.metrics)
        self.batch_loop = BatchLoop(self.queue, self.backend, self.executors.inference,
                                    self.metrics, self.probe, self.limits, self.memory,
                                    self.artifact.manifest.pad_token_id)
        self.batch_loop.start()

    async def warm_up(self) -> None:
        """Ready only once both graphs have run, every shape bucket included, on every
        inference thread's sessions: the first caller must not pay for it."""
        shapes = self.backend.warm_up_shapes(self.limits.max_batch_tokens)
        threads, started = self.executors.inference_threads, time.perf_counter()
        log.info("event=warm_up_start shapes=%d threads=%d", len(shapes), threads)
        await asyncio.gather(*map(asyncio.wrap_future, on_every_thread(
            self.executors.inference, threads, lambda: self.backend.warm_up(shapes))))
        log.info("event=warmed_up shapes=%d threads=%d seconds=%.2f", len(shapes), threads,
                 time.perf_counter() - started)
        self.ready = True


class Front:
    """The doors on their ports: attnserve.v1 and KServe over gRPC, beside grpc.health.v1
    and reflection, and the HTTP port; all of them through one engine."""

    def __init__(self, config: ServeConfig, metrics: Metrics):
        self.config, self.metrics = config, metrics
        self.credentials = credentials(config)
        self.keys = ApiKeys(config.api_key, config.api_key_file)
        self.health = health.aio.HealthServicer()
        self.port = self.http_port = self.metrics_port = 0

    async def start(self, engine: Engine, requests_pool, shared_ports: bool = False,
                    metrics_port: bool = True) -> None:
        """Bind and start every port. `shared_ports`: the ports are shared with the other
        front ends of one server (SO_REUSEPORT); otherwise a port in use fails the start."""
        config = self.config
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", config.max_message_bytes),
                   # Calls one connection may have open at once, each with its state
                   # and a request of up to --max-message-bytes (whose bytes the memory
                   # ledger then holds, a connection its share). Far above what callers
                   # open: grpc's Python client does not wait for a free stream, a call
                   # past the limit fails UNAVAILABLE (a burst of 300 on one channel
                   # lost 185 of them at a limit of 100).
                   ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
                   # grpc shares a port with any process that asks by default; a server
                   # shares its ports only with its own front ends.
                   ("grpc.so_reuseport", 1 if shared_ports else 0)]
        if config.max_connection_age_seconds:
            # A connection past its age gets GOAWAY; calls on it may still finish.
            options += [("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(config.drain_seconds * 1000))]
        # No request carries more entries in one field than the queue holds tokens.
        max_entries = config.max_queue_tokens
        decode = DecodeRequests(self.metrics, engine.memory.ledger, requests_pool, max_entries,
                                self.keys)
        self.grpc = grpc.aio.server(interceptors=[decode], options=options)
        logging.getLogger("grpc._cython.cygrpc").addFilter(QuietHungUpCalls())
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(
            EncoderService(engine, self.metrics, config.max_message_bytes), self.grpc)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeService(engine, self.metrics, config.max_message_bytes), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        self.http = HttpServers(config, engine, self.metrics, self.keys, max_entries, metrics_port)
        await self.set_health(False)
        address = f"{config.host}:{config.port}"
        try:
            self.port = (self.grpc.add_secure_port(address, self.credentials) if self.credentials
                         else self.grpc.add_insecure_port(address))
        except RuntimeError as err:  # grpc: "Failed to bind to address ..."
            raise PortInUse("--port", address) from err
        try:
            self.http_port, self.metrics_port = await self.http.start(shared_ports)
        except OSError as err:
            raise PortInUse("--http-port or --metrics-port", f"{config.host}:{config.http_port} "
                            f"or {config.metrics_host}:{config.metrics_port}") from err
        await self.grpc.start()

    async def set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def stop(self) -> None:
        # Give answered requests a moment to reach their callers, then close. Calls still
        # waiting inside gRPC for a handler at this instant were never accepted; gRPC
        # cancels them (CANCELLED); the HTTP ports close likewise.
        await asyncio.gather(self.grpc.stop(grace=1.0), self.http.stop())

    def answered(self) -> str:
        """Calls answered over the process's life by status, e.g. OK:12,UNAVAILABLE:3: what
        callers must have received, to compare against their count."""
        counts: dict[str, int] = {}
        for metric in self.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    code = sample.labels["code"]
                    counts[code] = counts.get(code, 0) + int(sample.value)
        return ",".join(f"{code}:{n}" for code, n in sorted(counts.items())) or "none"


class Server:
    """One process: the core and the front, the engine between them."""

    def __init__(self, config: ServeConfig):
        """Every start-up check, and nothing bound yet: `serve --check-config` stops here."""
        self.config = config
        self.artifact: Artifact = load_artifact(config.artifact)
        self.metrics = Metrics(self.artifact.manifest.max_positions)
        self.core = Core(config, self.artifact, self.metrics)
        self.tokenizer = load_tokenizer(self.artifact)
        self.front = Front(config, self.metrics)
        self.draining = False

    @property
    def serving(self) -> bool:
        return self.core.ready and not self.draining

    async def start(self) -> None:
        core, config = self.core, self.config
        core.start()
        offload = Offload(core.executors.requests, core.executors.responses)
        self.engine = Engine(self.artifact, self.tokenizer, core.queue, core.memory, offload,
                             self.metrics, core.backend.provider, core.backend.precision,
                             lambda: self.serving, config.max_chunking_chars)
        core.describe()
        self.metrics.health_serving.set_function(lambda: 1 if self.serving else 0)
        await self.front.start(self.engine, core.executors.requests)
        await core.warm_up()
        await self.front.set_health(True)
        front = self.front
        log.info("event=serving port=%d metrics_port=%d http_port=%d tls=%s mtls=%s api_keys=%d "
                 "model=%s budget_bytes=%d memory_model=%r", front.port, front.metrics_port,
                 front.http_port, front.credentials is not None, config.tls_client_ca is not None,
                 len(front.keys.keys), self.artifact.manifest.model_name,
                 core.limits.memory_budget_bytes, core.memory_model.source)
        if config.ready_file is not None:
            write_ready_file(config.ready_file, {"port": front.port,
                                                 "metrics_port": front.metrics_port,
                                                 "http_port": front.http_port})

    async def drain(self) -> None:
        """NOT_SERVING at once, UNAVAILABLE to new work, finish what was accepted."""
        log.info("event=draining seconds=%.0f", self.config.drain_seconds)
        self.draining = True
        await self.front.set_health(False)
        finished = await self.core.queue.drain(self.config.drain_seconds)
        await self.front.stop()
        log.info("event=stopped all_finished=%s answered=%s", finished, self.front.answered())


async def run(config: ServeConfig) -> None:
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain()
