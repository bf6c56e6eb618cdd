"""Assemble and run the server: artifact -> runtime -> scheduler -> servicers, beside
grpc.health.v1, reflection and the Prometheus endpoint; drain on SIGTERM."""

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from attnserve.artifact import MEMORY_MODEL, TOKENIZER, Artifact, ArtifactError, load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2, encoder_pb2_grpc
from attnserve.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
from attnserve.server.calls import RejectUndecodable
from attnserve.server.config import ServeConfig
from attnserve.server.encoder_service import EncoderService
from attnserve.server.kserve_service import KServeService
from attnserve.server.memory import MemoryProbe
from attnserve.server.memory_model import load_memory_model
from attnserve.server.metrics import Metrics
from attnserve.server.runtime import CUDA, Runtime
from attnserve.server.schedule import Limits, Scheduler
from attnserve.server.tokenize import TextTokenizer

log = logging.getLogger("attnserve.server")

SERVICES = (
    encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
)
# A batch may take this share of the memory that is free when the server starts.
DEFAULT_BUDGET_SHARE = 0.5


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


class Server:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.artifact: Artifact = load_artifact(config.artifact)
        manifest = self.artifact.manifest
        self.runtime = Runtime(self.artifact, config.device, config.precision,
                               config.intra_op_threads)
        self.metrics = Metrics(manifest.max_positions)
        self.probe = MemoryProbe(cuda=self.runtime.provider == CUDA)
        try:
            self.memory_model = load_memory_model(self.artifact.directory, manifest)
        except (ValueError, TypeError) as err:
            raise ArtifactError(f"{self.artifact.path(MEMORY_MODEL)}: not a valid memory model "
                                f"({err})") from err
        budget = config.memory_budget_bytes or int(self.probe.available_bytes() * DEFAULT_BUDGET_SHARE)
        self.limits = Limits(config.max_batch_size, config.max_batch_tokens,
                             config.max_queue_requests, config.max_queue_tokens, budget,
                             config.max_wait_ms / 1000)
        try:
            self.tokenizer = TextTokenizer(self.artifact.path(TOKENIZER), manifest.max_positions)
        except Exception as err:  # noqa: BLE001 - `tokenizers` raises a bare Exception
            raise ArtifactError(f"{self.artifact.path(TOKENIZER)}: not a valid tokenizer "
                                f"({err})") from err
        self.health = health.aio.HealthServicer()
        self.serving = False
        self.bound_port = 0
        self.metrics_port = 0

    def _describe(self) -> None:
        m, memory = self.metrics, self.probe.device_memory()
        m.info.info({"model": self.artifact.manifest.model_name, "provider": self.runtime.provider,
                     "precision": self.runtime.precision,
                     "artifact_sha256": self.artifact.manifest_sha256})
        m.device_memory_used.labels(memory.device).set_function(lambda: self.probe.device_memory().used)
        m.device_memory_total.labels(memory.device).set(memory.total)
        m.health_serving.set_function(lambda: 1 if self.serving else 0)

    async def _set_health(self, serving: bool) -> None:
        self.serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def start(self) -> None:
        config = self.config
        self.scheduler = Scheduler(self.runtime, self.metrics, self.probe, self.memory_model,
                                   self.limits)
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", config.max_message_bytes)]
        if config.max_connection_age_seconds:
            # A connection past its age gets GOAWAY; calls on it may still finish.
            options += [("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(config.drain_seconds * 1000))]
        self.grpc = grpc.aio.server(interceptors=[RejectUndecodable(self.metrics)],
                                    options=options)
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(
            EncoderService(self.artifact, self.runtime, self.tokenizer, self.scheduler,
                           self.metrics, config.max_message_bytes), self.grpc)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeService(self.artifact, self.scheduler, self.metrics, config.max_message_bytes,
                          lambda: self.serving), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        await self._set_health(False)
        address = f"{config.host}:{config.port}"
        creds = credentials(config)
        self.bound_port = (self.grpc.add_secure_port(address, creds) if creds
                           else self.grpc.add_insecure_port(address))
        if config.metrics_port:
            http, _ = start_http_server(config.metrics_port, config.metrics_host,
                                        registry=self.metrics.registry)
            self.metrics_port = http.server_port
        self._describe()
        await self.grpc.start()
        self.scheduler.start()
        # Ready only once both graphs have run: the first caller must not pay for it.
        await asyncio.get_running_loop().run_in_executor(
            self.scheduler.executor, self.runtime.warm_up, self.limits.max_batch_tokens)
        await self._set_health(True)
        log.info("event=serving port=%d metrics_port=%d tls=%s mtls=%s model=%s budget_bytes=%d "
                 "memory_model=%r", self.bound_port, self.metrics_port, creds is not None,
                 config.tls_client_ca is not None, self.artifact.manifest.model_name,
                 self.limits.memory_budget_bytes, self.memory_model.source)

    async def drain(self) -> None:
        """NOT_SERVING at once, UNAVAILABLE to new work, finish what was accepted."""
        log.info("event=draining seconds=%.0f", self.config.drain_seconds)
        await self._set_health(False)
        finished = await self.scheduler.drain(self.config.drain_seconds)
        # Give answered requests a moment to reach their callers, then close. Calls still
        # waiting inside gRPC for a handler at this instant were never accepted; gRPC
        # cancels them (CANCELLED).
        await self.grpc.stop(grace=1.0)
        log.info("event=stopped all_finished=%s answered=%s", finished, self._answered())

    def _answered(self) -> str:
        """Calls answered over the server's life by status, e.g. OK:12,UNAVAILABLE:3: what
        callers must have received, to compare against their count."""
        counts: dict[str, int] = {}
        for metric in self.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    code = sample.labels["code"]
                    counts[code] = counts.get(code, 0) + int(sample.value)
        return ",".join(f"{code}:{n}" for code, n in sorted(counts.items())) or "none"


async def run(config: ServeConfig) -> None:
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain()
