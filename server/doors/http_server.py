"""The HTTP side of the server, on aiohttp: the HTTP port (OpenAI /v1/embeddings, KServe v2
REST, GET /health for load balancers, /openapi.json) on the gRPC server's own event loop,
and the metrics port (GET /metrics) on a thread and event loop of its own, so a burst of
scrapes never delays a health probe or a call.

What the port takes is bounded before any route runs: a connection has
--http-header-timeout-seconds to send a request's headers (from its opening, or from its
last answer: an idle keep-alive connection closes after it too), a request line and
header of at most 8 KiB, a body never inflated (Content-Encoding is refused, see
http_calls.py). Unmatched routes and methods answer in the protocol's error shape, and a
malformed request is logged at INFO, not as a traceback at ERROR. Each port listens with
a deep backlog, so a burst of connections queues in the kernel instead of being dropped."""

import asyncio
import logging
import ssl
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from attnserve.server.config import ServeConfig
from attnserve.server.doors.front import ApiKeys, CallRecord
from attnserve.server.doors.http_calls import HttpCalls
from attnserve.server.doors.http_kserve import KServeHttp
from attnserve.server.doors.http_openai import OpenAIEmbeddings
from attnserve.server.doors.http_openai import refusal as openai_refusal
from attnserve.server.doors.openapi import openapi_document
from attnserve.server.engine.engine import Engine
from attnserve.server.engine.errors import NotFound, RequestError, Unauthenticated
from attnserve.server.metrics import Metrics

LISTEN_BACKLOG = 1024
# After the request queue has drained, answers already computed get this long to be sent.
SEND_GRACE_S = 1.0
MAX_LINE_BYTES = 8190
# Paths answered without an API key: health, for probes, and the API's description.
OPEN_PATHS = ("/health", "/v2/health/live", "/v2/health/ready", "/openapi.json")


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


class QuietMalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad chunk size, a header line too long) at
    ERROR with a traceback: the client's doing, which any client could repeat to flood the
    log. One key=value line at INFO instead. Installed on aiohttp's `aiohttp.server`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Error handling request"):
            error = record.exc_info[1] if record.exc_info else None
            record.msg = "event=malformed_request error=%r"
            record.args = (str(error)[:200],)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def _json_error(err: RequestError, status: int) -> web.Response:
    return web.json_response({"error": err.message}, status=status)


def api_app(calls: HttpCalls, engine: Engine, keys: ApiKeys, openai: OpenAIEmbeddings,
            kserve: KServeHttp, document: bytes) -> web.Application:
    metrics = calls.metrics

    @web.middleware
    async def front(request: web.Request, handler: Callable[[web.Request], Awaitable]):
        """API keys before any route; unmatched routes and methods in the protocol's error
        shape ({"error": ...}, or OpenAI's under /v1)."""
        render = openai_refusal if request.path.startswith("/v1/") else _json_error
        try:
            if not request.path.startswith(OPEN_PATHS):
                keys.check(request.headers.get("Authorization"))
            return await handler(request)
        except Unauthenticated as err:
            record = CallRecord(metrics, "http:auth")
            record.refusal(err)
            record.end()
            response = render(err, 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        except web.HTTPMethodNotAllowed as err:
            allowed = ", ".join(sorted(err.allowed_methods))
            response = render(RequestError(f"{request.method[:16]} {request.path[:64]}: method "
                                           f"not allowed; use {allowed}"), 405)
            response.headers["Allow"] = allowed
            return response
        except web.HTTPNotFound:
            return render(NotFound(f"{request.path[:64]}: no such route; see /openapi.json"), 404)

    async def health(request: web.Request) -> web.Response:
        serving = engine.ready()
        return web.json_response({"status": "serving" if serving else "not_serving"},
                                 status=200 if serving else 503)

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=document, content_type="application/json")

    app = web.Application(middlewares=[front])
    app.add_routes([web.get("/health", health), web.get("/openapi.json", openapi),
                    web.post("/v1/embeddings", openai.handle), *kserve.routes()])
    return app


def metrics_app(metrics: Metrics) -> web.Application:
    async def scrape(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encode(metrics.registry))
        response.headers["Content-Type"] = content_type
        return response

    app = web.Application()
    app.add_routes([web.get("/metrics", scrape)])
    return app


class Listener:
    """One aiohttp application on one port."""

    def __init__(self, app: web.Application, header_timeout_s: float = 75.0):
        # handler_cancellation: a caller that hangs up cancels its handler, which frees its
        # place in the queue as a cancelled gRPC call does. No access log: one line per
        # request is the metrics' job. aiohttp's keep-alive timer runs from a connection's
        # opening and from each answer, until the next request's headers are in: the
        # header timeout.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=SEND_GRACE_S, auto_decompress=False,
                                    keepalive_timeout=header_timeout_s,
                                    max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES)
        self.port = 0

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    reuse_port: bool = False) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=ssl_context,
                           reuse_port=reuse_port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Stop listening, let answers in progress finish within SEND_GRACE_S, close."""
        await self.runner.cleanup()


class MetricsThread:
    """The metrics port on a thread with its own event loop: collecting and encoding a
    scrape never runs on the event loop that serves calls and health probes."""

    def __init__(self, metrics: Metrics, host: str, port: int):
        self.listener = Listener(metrics_app(metrics))
        self.host, self.requested = host, port
        self.loop = asyncio.new_event_loop()
        self.port = 0

    def start(self) -> int:
        started = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.port = self.loop.run_until_complete(self.listener.start(self.host,
                                                                             self.requested))
            except BaseException as err:  # noqa: BLE001 - reported to the starting thread
                failed.append(err)
                return
            finally:
                started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="metrics", daemon=True)
        self.thread.start()
        started.wait()
        if failed:
            raise failed[0]
        return self.port

    def stop(self) -> None:
        future = asyncio.run_coroutine_threadsafe(self.listener.stop(), self.loop)
        future.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class HttpServers:
    """The HTTP port and the metrics port of one server, each off when its port is 0."""

    def __init__(self, config: ServeConfig, engine: Engine, metrics: Metrics, keys: ApiKeys,
                 max_entries: int, metrics_port: bool = True):
        self.config = config
        self.calls = HttpCalls(engine, metrics, config.http_max_body_bytes,
                               config.http_body_timeout_seconds, max_entries)
        openai = OpenAIEmbeddings(self.calls, engine, config.max_message_bytes)
        kserve = KServeHttp(self.calls, engine, config.max_message_bytes)
        self.api = Listener(api_app(self.calls, engine, keys, openai, kserve,
                                    openapi_document(engine.model_info())),
                            config.http_header_timeout_seconds)
        self.scrapes = (MetricsThread(metrics, config.metrics_host, config.metrics_port)
                        if metrics_port and config.metrics_port else None)
        logging.getLogger("aiohttp.server").addFilter(QuietMalformedRequests())

    async def start(self, reuse_port: bool = False) -> tuple[int, int]:
        """(the HTTP port, the metrics port) bound, 0 for one that is off."""
        config = self.config
        http_port = 0
        if config.http_port:
            http_port = await self.api.start(config.host, config.http_port, server_ssl(
                config.tls_cert, config.tls_key, config.tls_client_ca), reuse_port)
        metrics_port = self.scrapes.start() if self.scrapes else 0
        return http_port, metrics_port

    async def stop(self) -> None:
        if self.config.http_port:
            await self.api.stop()
        if self.scrapes:
            await asyncio.get_running_loop().run_in_executor(None, self.scrapes.stop)

