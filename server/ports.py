"""The doors on their ports: the gRPC port (server/grpc/server.py) and the HTTP port, with
the metrics port where this process serves it (server/http/server.py), all of them
through one data plane, one set of API keys and one tracing."""

import asyncio

from attnserve.server.config import ServeConfig
from attnserve.server.engine.plane import DataPlane
from attnserve.server.grpc.server import GrpcServer
from attnserve.server.http.server import HttpServers
from attnserve.server.keys import ApiKeys, InFlightCounts
from attnserve.server.metrics import Metrics, answered_by_code
from attnserve.server.startup import PortInUse
from attnserve.server.tracing import Tracing


class Ports:
    def __init__(self, config: ServeConfig, metrics: Metrics, key_counts: InFlightCounts | None = None):
        """`key_counts`: where capped API keys' calls are counted (default: in this process)."""
        self.config, self.metrics = config, metrics
        self.keys = ApiKeys(config.api_key, config.api_key_file, key_counts)
        self.tracing = None if config.otlp_endpoint is None else Tracing(config.otlp_endpoint)
        self.grpc = GrpcServer(config, metrics, self.keys, self.tracing)
        self.port = self.http_port = self.metrics_port = 0

    async def start(self, plane: DataPlane, requests_pool, shared_ports: bool = False,
                    metrics_port: bool = True) -> None:
        """Bind and start every port. `shared_ports`: the ports are shared with the other
        front ends of one server (SO_REUSEPORT); otherwise a port in use fails the start."""
        config = self.config
        # No request carries more entries in one field than the queue holds tokens.
        max_entries = config.max_queue_tokens
        self.http = HttpServers(config, plane, self.metrics, self.keys, max_entries, metrics_port,
                                self.tracing)
        self.port = await self.grpc.start(plane, requests_pool, max_entries, shared_ports)
        try:
            self.http_port, self.metrics_port = await self.http.start(shared_ports)
        except OSError as err:
            raise PortInUse("--http-port or --metrics-port", f"{config.host}:{config.http_port} "
                            f"or {config.metrics_host}:{config.metrics_port}") from err

    async def set_health(self, serving: bool) -> None:
        await self.grpc.set_health(serving)

    async def stop(self) -> None:
        await asyncio.gather(self.grpc.stop(), self.http.stop())
        if self.tracing is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    def answered(self) -> str:
        """Calls this process answered, by status (metrics.answered_by_code)."""
        return answered_by_code(self.metrics.requests.collect())
