"""The Prometheus metrics port (GET /metrics) on a thread with its own event loop, so that
collecting and encoding a scrape never runs on the event loop that serves calls and health
probes. Served by whichever process owns the counts: the one process of a server, or the
engine process of a server with --workers."""

import asyncio
import threading

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from attnserve.server.http.listener import Listener
from attnserve.server.metrics import Metrics


def metrics_app(metrics: Metrics) -> web.Application:
    async def scrape(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encode(metrics.registry))
        response.headers["Content-Type"] = content_type
        return response

    app = web.Application()
    app.add_routes([web.get("/metrics", scrape)])
    return app


class MetricsThread:
    def __init__(self, metrics: Metrics, host: str, port: int):
        self.listener = Listener(metrics_app(metrics))
        self.host, self.port = host, port
        self.loop = asyncio.new_event_loop()

    def start(self) -> int:
        self.thread = threading.Thread(target=self.loop.run_forever, name="metrics", daemon=True)
        self.thread.start()
        bound = asyncio.run_coroutine_threadsafe(self.listener.start(self.host, self.port), self.loop)
        try:
            return bound.result()
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.listener.stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
