"""Cross-origin calls from web pages (--cors-allow-origin), as browsers ask for them: a
preflight (OPTIONS with Origin and Access-Control-Request-Method) from an allowed origin
is answered 204 with what it may send, and every answer to an allowed origin is marked
for it. Nothing is allowed unless configured: a preflight from any other origin, or with
no origin configured, goes on to the routes (which answer OPTIONS 405) and gets no CORS
header, so the browser never sends the call.

Only GET and POST are allowed, with the headers the routes read (Authorization,
Content-Type, and KServe's binary Inference-Header-Content-Length); cookies never ride
along (no Access-Control-Allow-Credentials), so `*` cannot lend a visitor's session to
another site. A body of a type a page may post without a preflight is refused by every
route anyway (calls.py)."""

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
        if origin is None:
            return None
        if self.any:
            return ANY_ORIGIN
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        wanted = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_METHOD, "")
        if request.method != hdrs.METH_OPTIONS or wanted not in ("GET", "POST") \
                or self.allowed(request) is None:
            return await handler(request)
        return web.Response(status=204, headers={
            hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: self.allowed(request),
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: METHODS,
            hdrs.ACCESS_CONTROL_ALLOW_HEADERS: HEADERS,
            hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S)})

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
