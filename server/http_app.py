"""The HTTP side of the server, on aiohttp in the gRPC server's own event loop: the HTTP
port (OpenAI /v1/embeddings, KServe v2 REST, GET /health for load balancers) and the
metrics port (GET /metrics). Each listens with a deep backlog, so a burst of connections
(200 parallel scrapes) queues in the kernel instead of being dropped."""

import asyncio
import ssl
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from attnserve.server.config import ServeConfig
from attnserve.server.holds import Ledger
from attnserve.server.http_calls import HttpCalls
from attnserve.server.kserve_http import KServeHttp
from attnserve.server.kserve_service import KServeService
from attnserve.server.metrics import Metrics
from attnserve.server.openai_api import Embed, OpenAIEmbeddings

LISTEN_BACKLOG = 1024
# After the request queue has drained, answers already computed get this long to be sent.
SEND_GRACE_S = 1.0


def server_ssl(cert: Path | None, key: Path | None, client_ca: Path | None) -> ssl.SSLContext | None:
    """The gRPC port's TLS settings for the HTTP port too: with --tls-cert, no plaintext
    inference port is left open beside the encrypted one."""
    if cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


def api_app(calls: HttpCalls, openai: OpenAIEmbeddings, kserve: KServeHttp) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        serving = calls.ready()
        return web.json_response({"status": "serving" if serving else "not_serving"},
                                 status=200 if serving else 503)

    # aiohttp's own limit backs up the Content-Length check for bodies sent without one.
    app = web.Application(client_max_size=calls.max_body_bytes)
    app.add_routes([web.get("/health", health), web.post("/v1/embeddings", openai.handle),
                    *kserve.routes()])
    return app


def metrics_app(registry: CollectorRegistry, executor: Executor) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        # Collecting reads the device's memory (NVML, /proc): not on the event loop.
        body = await asyncio.get_running_loop().run_in_executor(executor, encode, registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    return app


class Listener:
    """One aiohttp application on one port."""

    def __init__(self, app: web.Application):
        # handler_cancellation: a caller that hangs up cancels its handler, which frees its
        # place in the queue as a cancelled gRPC call does. No access log: one line per
        # request is the metrics' job.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=SEND_GRACE_S)
        self.port = 0

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=ssl_context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Stop listening, let answers in progress finish within SEND_GRACE_S, close."""
        await self.runner.cleanup()


class HttpServers:
    """The HTTP port and the metrics port of one server, each off when its port is 0."""

    def __init__(self, config: ServeConfig, metrics: Metrics, embed: Embed, kserve: KServeService,
                 ready: Callable[[], bool], respond: Executor, scrape: Executor, ledger: Ledger):
        self.config = config
        self.listeners: list[Listener] = []
        self.calls = HttpCalls(metrics, respond, config.http_max_body_bytes, ready, ledger)
        model = kserve.manifest
        self.api = api_app(self.calls, OpenAIEmbeddings(self.calls, embed, model.model_name,
                                                        model.hidden_size), KServeHttp(self.calls, kserve))
        self.metrics = metrics_app(metrics.registry, scrape)

    async def start(self) -> tuple[int, int]:
        """(the HTTP port, the metrics port) bound, 0 for one that is off."""
        config = self.config
        ports = []
        for app, host, port, context in (
                (self.api, config.host, config.http_port,
                 server_ssl(config.tls_cert, config.tls_key, config.tls_client_ca)),
                (self.metrics, config.metrics_host, config.metrics_port, None)):
            if not port:
                ports.append(0)
                continue
            listener = Listener(app)
            self.listeners.append(listener)
            ports.append(await listener.start(host, port, context))
        return ports[0], ports[1]

    async def stop(self) -> None:
        await asyncio.gather(*(listener.stop() for listener in self.listeners))
