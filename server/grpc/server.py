"""The gRPC port: attnserve.v1 and KServe over gRPC, beside grpc.health.v1 and reflection,
with TLS where configured, every call through the DecodeRequests interceptor."""

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from attnserve.server._proto.attnserve.v1 import encoder_pb2, encoder_pb2_grpc
from attnserve.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
from attnserve.server.config import ServeConfig
from attnserve.server.engine.plane import DataPlane
from attnserve.server.grpc.calls import DecodeRequests
from attnserve.server.grpc.encoder import EncoderService
from attnserve.server.grpc.kserve import KServeService
from attnserve.server.keys import ApiKeys
from attnserve.server.logs import ClientsDoing
from attnserve.server.metrics import Metrics
from attnserve.server.startup import PortInUse
from attnserve.server.tracing import Tracing

SERVICES = (encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
            grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name)
MAX_CONCURRENT_STREAMS = 1000


def credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    ca = config.tls_client_ca
    return grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                                       root_certificates=ca and ca.read_bytes(), require_client_auth=bool(ca))


class GrpcServer:
    def __init__(self, config: ServeConfig, metrics: Metrics, keys: ApiKeys, tracing: Tracing | None):
        self.config, self.metrics, self.keys, self.tracing = config, metrics, keys, tracing
        self.credentials = credentials(config)
        self.health = health.aio.HealthServicer()

    async def start(self, plane: DataPlane, requests_pool, max_entries: int, shared_port: bool) -> int:
        """Bind the port (`shared_port`: shared with the other front ends of one server,
        SO_REUSEPORT; otherwise one in use fails the start) and serve it NOT_SERVING."""
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
                   ("grpc.so_reuseport", 1 if shared_port else 0)]
        if config.max_connection_age_seconds:
            # A connection past its age gets GOAWAY and takes no new calls. No grace
            # limit: a call in flight runs to its end (a 0.6B model's large batch takes
            # minutes on a small CPU), so a stream the client holds open keeps its
            # connection until the client closes it.
            options += [("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000))]
        decode = DecodeRequests(self.metrics, plane, requests_pool, max_entries, self.keys, self.tracing)
        self.server = grpc.aio.server(interceptors=[decode], options=options)
        # gRPC's line for a caller that hung up while its answer was being sent
        logging.getLogger("grpc._cython.cygrpc").addFilter(ClientsDoing(
            "ExecuteBatchError raised in core by servicer method", "event=send_failed reason=caller_gone "
            "method=%s", lambda _, method: (method.strip(" []"),)))
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(
            EncoderService(plane, self.metrics, config.max_message_bytes), self.server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeService(plane, self.metrics, config.max_message_bytes), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        await self.set_health(False)
        address = f"{config.host}:{config.port}"
        try:
            port = (self.server.add_secure_port(address, self.credentials)
                    if self.credentials else self.server.add_insecure_port(address))
        except RuntimeError as err:  # grpc: "Failed to bind to address ..."
            raise PortInUse("--port", address) from err
        await self.server.start()
        return port

    async def set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def stop(self) -> None:
        # Every answer owed has been written (DataPlane.answers_sent), or the drain ran out
        # of time: a moment for gRPC to flush, then close. Calls still waiting inside gRPC
        # for a handler at this instant were never accepted; gRPC cancels them (CANCELLED).
        await self.server.stop(grace=1.0)
