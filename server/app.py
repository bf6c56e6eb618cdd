"""Assemble and run the server: artifacts -> backends -> each model's request queue and
batch loop -> the data plane -> the doors on their ports; drain on SIGTERM. One process,
or with --workers N (server/workers/) front-end processes around one engine process."""

import asyncio
import logging
import signal
import time

from attnserve.server.config import ServeConfig
from attnserve.server.engine.offload import Offload
from attnserve.server.engine.plane import build_plane
from attnserve.server.engine.registry import load_models, load_tokenizers, log_default_prompts
from attnserve.server.engine.runner import Runners
from attnserve.server.metrics import Metrics
from attnserve.server.ports import Ports
from attnserve.server.startup import write_ready_file

log = logging.getLogger("attnserve.server")


class Server:
    """One process: the runners and the doors, the data plane between them."""

    def __init__(self, config: ServeConfig):
        """Every start-up check, and nothing bound yet: `serve --check-config` stops here."""
        self.config = config
        self.named = load_models(config)
        log_default_prompts(config, self.named)
        self.metrics = Metrics(max(n.artifact.manifest.max_positions for n in self.named))
        self.runners = Runners(config, self.named, self.metrics)
        self.tokenizers = load_tokenizers(self.named)
        self.ports = Ports(config, self.metrics)
        self.draining = False

    def serving(self) -> bool:
        return self.runners.warm and not self.draining

    async def start(self) -> None:
        runners, config = self.runners, self.config
        runners.start()
        offload = Offload()
        self.plane = build_plane(config, self.named, self.tokenizers,
                                 [(r.queue, r.memory, r.backend.placement) for r in runners.models],
                                 runners.budget, offload, self.metrics, self.serving)
        runners.describe()
        self.metrics.live.serving = self.serving
        await self.ports.start(self.plane, offload.requests_pool)
        await runners.warm_up()
        ports = self.ports
        await ports.set_health(True)
        log.info("event=serving port=%d metrics_port=%d http_port=%d tls=%s mtls=%s api_keys=%d "
                 "models=%s budget_bytes=%d memory_model=%r time_model=%r", ports.port,
                 ports.metrics_port, ports.http_port, ports.grpc.credentials is not None,
                 config.tls_client_ca is not None, len(ports.keys.keys), ",".join(self.plane.models),
                 runners.limits.memory_budget_bytes, runners.memory_source(), runners.time_source())
        if config.ready_file is not None:
            write_ready_file(config.ready_file, {"port": ports.port, "metrics_port": ports.metrics_port,
                                                 "http_port": ports.http_port})

    async def drain(self) -> None:
        """NOT_SERVING at once, UNAVAILABLE to new work, finish what was accepted."""
        log.info("event=draining seconds=%.0f", self.config.drain_seconds)
        self.draining = True
        await self.ports.set_health(False)
        deadline = time.monotonic() + self.config.drain_seconds
        finished = await self.runners.drain(self.config.drain_seconds)
        finished = await self.plane.answers_sent(deadline - time.monotonic()) and finished
        await self.ports.stop()
        log.info("event=stopped all_finished=%s answered=%s", finished, self.ports.answered())


async def run(config: ServeConfig) -> None:
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain()
