"""The HTTP side of the server, on aiohttp: the HTTP port (every door's routes, GET /health
for load balancers, /openapi.json and its page /docs, CORS, API keys) on the gRPC server's
own event loop, with the limits every port keeps (listener.py), and the metrics port (GET
/metrics) on a thread and event loop of its own, so a burst of scrapes never delays a
health probe or a call. Unmatched routes and methods answer in the protocol's error
shape, and a malformed request is logged at INFO, not as a traceback at ERROR."""

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from attnserve.server.call import CallRecord
from attnserve.server.config import ServeConfig
from attnserve.server.engine.model import NOT_SERVING
from attnserve.server.engine.plane import DataPlane
from attnserve.server.errors import NotFound, RequestError, Unauthenticated
from attnserve.server.http.calls import API_KEY, HttpCalls
from attnserve.server.http.cohere import CohereDoor
from attnserve.server.http.cors import Cors
from attnserve.server.http.docs_page import DocsPage
from attnserve.server.http.door import Door, json_response
from attnserve.server.http.kserve import KServeDoor
from attnserve.server.http.listener import Listener
from attnserve.server.http.openai import OpenAIDoor
from attnserve.server.http.openapi import openapi_document
from attnserve.server.http.schemas import Health
from attnserve.server.http.tei import TeiDoor
from attnserve.server.keys import ApiKeys
from attnserve.server.logs import ClientsDoing
from attnserve.server.metrics import Metrics
from attnserve.server.metrics_port import MetricsThread
from attnserve.server.tracing import Tracing

# Paths answered without an API key: health, for probes, and the API's description.
OPEN_PATHS = ("/health", "/v2/health/live", "/v2/health/ready", "/openapi.json", "/docs")


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


def _open(request: web.Request) -> bool:
    """Answered without an API key: OPEN_PATHS, and GET / (TEI's health, as its probes ask)."""
    return request.path.startswith(OPEN_PATHS) or (request.path == "/" and request.method in ("GET", "HEAD"))


def api_app(calls: HttpCalls, doors: list[Door], cors: Cors, document: bytes) -> web.Application:
    """The port's routes: health, the API's description and its page, and each door's, API
    keys checked before any; refusals outside a route (401, 404, 405) in the door's shape,
    outside every door's routes OpenAI's under /v1/, else {"error": ...}."""
    routes = [(door, route) for door in doors for route in door.routes()]
    shapes = {route.path: door.refusal for door, route in routes}

    @web.middleware
    async def front(request: web.Request, handler: Callable[[web.Request], Awaitable]):
        render = shapes.get(request.path) or (
            OpenAIDoor.refusal if request.path.startswith("/v1/") else Door.refusal)
        try:
            if not _open(request):
                request[API_KEY] = calls.keys.check(request.headers.get("Authorization"))
            return await handler(request)
        except Unauthenticated as err:
            record = CallRecord(calls.metrics, "http:auth")
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
        """Also TEI's (GET / too): 503 carries TEI's error and error_type beside status."""
        if calls.plane.serving():
            return json_response(Health("serving"))
        return json_response(Health("not_serving", NOT_SERVING, "Unhealthy"), 503)

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=document, content_type="application/json")

    app = web.Application(middlewares=[calls.calls, cors.preflight, front])
    app.on_response_prepare.append(calls.call_headers)
    app.on_response_prepare.append(cors.mark)
    app.add_routes([web.get("/health", health), web.get("/", health), web.get("/openapi.json", openapi),
                    *DocsPage().routes(), *(route for _, route in routes)])
    return app


class HttpServers:
    """The HTTP port and the metrics port of one server, each off when its port is 0."""

    def __init__(self, config: ServeConfig, plane: DataPlane, metrics: Metrics, keys: ApiKeys,
                 max_entries: int, metrics_port: bool = True, tracing: Tracing | None = None):
        self.config = config
        self.calls = HttpCalls(plane, metrics, keys, config.http_max_body_bytes,
                               config.http_body_timeout_seconds, max_entries, tracing)
        door = (self.calls, plane, config.max_message_bytes)
        limits = {"max_concurrent_requests": config.max_queue_requests,
                  "max_batch_tokens": config.max_batch_tokens,
                  "max_batch_requests": config.max_batch_size, "max_client_batch_size": max_entries}
        doors = [OpenAIDoor(*door), TeiDoor(*door, limits=limits), CohereDoor(*door), KServeDoor(*door)]
        self.document = openapi_document([m.model_info() for m in plane.models.values()])
        self.api = Listener(api_app(self.calls, doors, Cors(config.cors_allow_origin), self.document),
                            config.http_header_timeout_seconds)
        self.scrapes = (MetricsThread(metrics, config.metrics_host, config.metrics_port)
                        if metrics_port and config.metrics_port else None)
        # aiohttp's line for a request it cannot parse (a bad request line, a header too long)
        logging.getLogger("aiohttp.server").addFilter(ClientsDoing(
            "Error handling request", "event=malformed_request error=%r",
            lambda record, _: (str(record.exc_info[1] if record.exc_info else None)[:200],)))

    async def start(self, reuse_port: bool = False) -> tuple[int, int]:
        """(the HTTP port, the metrics port) bound, 0 for one that is off."""
        config = self.config
        http_port = config.http_port and await self.api.start(config.host, config.http_port, server_ssl(
            config.tls_cert, config.tls_key, config.tls_client_ca), reuse_port)
        return http_port, self.scrapes.start() if self.scrapes else 0

    async def stop(self) -> None:
        if self.config.http_port:
            await self.api.stop()
        if self.scrapes:
            await asyncio.get_running_loop().run_in_executor(None, self.scrapes.stop)

