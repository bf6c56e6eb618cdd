"""Cross-origin calls from web pages (--cors-allow-origin), as browsers ask for them
(docs/api.md, "HTTP: calls from web pages"): a preflight from an allowed origin is answered
204 with what it may send, and every answer to an allowed origin is marked for it. Nothing
is allowed unless configured, and cookies never ride along (no
Access-Control-Allow-Credentials), so `*` cannot lend a visitor's session to another site."""

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from attnserve.server.config import ANY_ORIGIN

METHODS = "GET, POST"
HEADERS = "Authorization, Content-Type, Inference-Header-Content-Length"
# How long a browser may reuse a preflight's answer.
MAX_AGE_S = 600


class Cors:
    def __init__(self, origins: tuple[str, ...]):
        self.any = ANY_ORIGIN in origins
        self.origins = frozenset(origins)

    def allowed(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin value for this request's origin, None for none."""
        origin = request.headers.get(hdrs.ORIGIN)
        if self.any and origin is not None:
            return ANY_ORIGIN
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        wanted = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_METHOD, "")
        origin = self.allowed(request) if request.method == hdrs.METH_OPTIONS else None
        if origin is None or wanted not in ("GET", "POST"):
            return await handler(request)
        return web.Response(status=204, headers={
            hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: origin, hdrs.ACCESS_CONTROL_ALLOW_METHODS: METHODS,
            hdrs.ACCESS_CONTROL_ALLOW_HEADERS: HEADERS, hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S)})

    async def mark(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: every answer to an allowed origin (errors too, so a page
        can read why) but to an OPTIONS that is no preflight allowed. An answer that
        depends on the origin says so, so that no cache hands one origin's answer to
        another."""
        if self.origins and not self.any:
            response.headers.add(hdrs.VARY, hdrs.ORIGIN)
        origin = self.allowed(request)
        if origin is not None and request.method != hdrs.METH_OPTIONS:
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
