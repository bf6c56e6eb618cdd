"""What every HTTP route shares: its call record, status and X-Request-Id (server/call.py),
the body read within its limits and time and held in the memory ledger only as its bytes
arrive, JSON counted before it is decoded and decoded off the event loop (as its schema,
server/http/schemas.py), and errors turned into HTTP statuses in the route's own error
shape. The cheap limits come first: the content type, encoding and declared length before
any byte of the body is read, a JSON body's entries before it is parsed."""

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from attnserve.server.call import CANCELLED, REQUEST_ID, TRACEPARENT, CallRecord, begin_call, finish_call
from attnserve.server.engine.offload import JSON_BYTE_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.errors import Code, InvalidArgument, RequestError, RetryLater, TooLarge
from attnserve.server.http.listener import MalformedBody
from attnserve.server.http.schemas import decode
from attnserve.server.keys import ApiKeys
from attnserve.server.memory.ledger import Holds
from attnserve.server.metrics import Metrics
from attnserve.server.priority import HEADER
from attnserve.server.tracing import Tracing

S = TypeVar("S")
T = TypeVar("T")

HTTP_STATUS = {Code.INVALID_ARGUMENT: 400, Code.UNAUTHENTICATED: 401, Code.NOT_FOUND: 404,
               Code.RESOURCE_EXHAUSTED: 429, Code.INTERNAL: 500, Code.UNAVAILABLE: 503,
               Code.DEADLINE_EXCEEDED: 504}
# The entries a JSON body may carry beyond twice the entries one request may queue (ids
# and the lists holding them; the tensors of both KServe inputs): its objects' members.
JSON_ENTRY_SLACK = 1024
# The JSON text between two double quotes: a string, escapes included.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# Types a web page can post to another origin without asking first (no CORS preflight):
# never accepted, so that a page cannot make a visitor's browser call the server.
CROSS_SITE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
# The most a float32 takes in a JSON body: orjson's shortest repr (-1.1754944e-38) and a comma.
JSON_FLOAT_BYTES = 16
# A character of text as JSON: at most six bytes (a \\u escape of four hex digits).
JSON_CHAR_BYTES = 6
# Routes of probes and tools, never traced.
UNTRACED_PATHS = ("/health", "/v2/health/", "/openapi.json")
_CALL = "attnserve.call"
"""the request's key for its Call"""
API_KEY = "attnserve.api_key"
"""the request's ApiKey, once the API keys have let it in"""


class UnsupportedMediaType(RequestError):
    """415: a body of a type or encoding the route does not take."""

    code = Code.INVALID_ARGUMENT


class RequestTimeout(RequestError):
    """408: the body did not arrive within --http-body-timeout-seconds."""

    code = Code.DEADLINE_EXCEEDED


def http_status(err: RequestError) -> int:
    for kind, status in ((UnsupportedMediaType, 415), (RequestTimeout, 408), (TooLarge, 413)):
        if isinstance(err, kind):
            return status
    return HTTP_STATUS.get(err.code, 500)


def json_entries(body: bytes, limit: int) -> int:
    """An upper bound on the values in a JSON text's arrays and objects, counted without
    parsing it: its commas and opening brackets, outside strings once the count with
    those inside passes `limit`. Exact but for empty arrays and objects, which count one
    each."""
    raw = body.count(b",") + body.count(b"[") + body.count(b"{")
    if raw <= limit or b'"' not in body:
        return raw
    outside = _JSON_STRING.sub(b"", body)
    return outside.count(b",") + outside.count(b"[") + outside.count(b"{")


class HttpCalls:
    def __init__(self, plane: DataPlane, metrics: Metrics, keys: ApiKeys, max_body_bytes: int,
                 body_timeout_s: float, max_entries: int, tracing: Tracing | None = None):
        self.plane = plane
        self.keys = keys
        self.tracing = tracing
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_json_entries = 2 * max_entries + JSON_ENTRY_SLACK

    @web.middleware
    async def calls(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """The first middleware: the request becomes a call (its id from X-Request-Id, its
        trace from traceparent), traced once answered."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        tracing = None if request.path.startswith(UNTRACED_PATHS) else self.tracing
        call = begin_call(f"{request.method} {route}", request.headers.get(REQUEST_ID),
                          request.headers.get(TRACEPARENT), tracing)
        request[_CALL] = call
        status = None
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            finish_call(call, tracing, {"http.request.method": request.method, "http.route": route}
                        | ({} if status is None else {"http.response.status_code": status}))

    @staticmethod
    async def call_headers(request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: every answer's X-Request-Id and the call's timings."""
        call = request.get(_CALL)
        if call is not None:
            response.headers.update(call.metadata())

    def check_type(self, request: web.Request, accepted: tuple[str, ...], optional: bool = False) -> None:
        """Refuse (415) a body of another content type (none given is accepted with
        `optional`), or compressed: a body is never inflated here."""
        kind = request.content_type if request.headers.get("Content-Type") else None
        if (kind is not None or not optional) and (kind not in accepted or kind in CROSS_SITE_TYPES):
            raise UnsupportedMediaType(f"Content-Type: {kind or 'missing'}; send {' or '.join(accepted)}")
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            raise UnsupportedMediaType(f"Content-Encoding: {encoding[:32]!r}; bodies are taken "
                                       "uncompressed only")

    async def body(self, request: web.Request, holds: Holds) -> bytes:
        """The whole body: refused (413) past the limit before it is read when the client
        declares its length, and as soon as it passes the limit when it does not; ended
        (408) past --http-body-timeout-seconds, and (400) as soon as its chunked encoding
        breaks. Its bytes are held in the ledger (as received, parsed and converted) as they
        arrive, until the answer has been sent: never for bytes not yet sent."""
        limit, length = self.max_body_bytes, request.content_length
        if length is not None and length > limit:
            raise TooLarge(f"body: {length} bytes, over the server's {limit}-byte limit "
                           "(--http-max-body-bytes)")
        chunks, received, held = [], 0, 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while chunk := await request.content.readany():
                    received += len(chunk)
                    if received > limit:
                        raise TooLarge(f"body: over the server's {limit}-byte limit (--http-max-body-bytes)")
                    held = self.plane.hold_request(holds, received, held)
                    chunks.append(chunk)
                # A broken chunked framing ends the body and may wake the last read as its
                # end (server/http/listener.py): its error says it is not.
                if (broken := request.content.exception()) is not None:
                    raise broken
        except TimeoutError as err:
            raise RequestTimeout(f"body: {received} bytes arrived in {self.body_timeout_s:g} s "
                                 "(--http-body-timeout-seconds); send the whole body at once") from err
        except MalformedBody as err:
            raise InvalidArgument("body", err.message) from err
        return b"".join(chunks)

    async def json(self, body: bytes, schema: type[S], then: Callable[[S], T] | None = None) -> T:
        """The body decoded as `schema` (and handed to `then`), on a thread when the body is
        big. Its entries are counted first, so a body with more than any request may carry
        is refused before it is decoded."""
        def work():
            entries = json_entries(body, self.max_json_entries)
            if entries > self.max_json_entries:
                raise TooLarge(f"body: more than {self.max_json_entries} JSON values "
                               f"({entries} counted); send fewer entries per request")
            decoded = decode(body, schema)
            return decoded if then is None else then(decoded)
        return await self.plane.offload.request(len(body) * JSON_BYTE_S, work)

    async def json_body(self, request: web.Request, holds: Holds, schema: type[S]) -> S:
        self.plane.check_serving()
        self.check_type(request, ("application/json",))
        return await self.json(await self.body(request, holds), schema)

    async def answer(self, rpc: str, request: web.Request,
                     handler: Callable[[Holds], Awaitable[web.StreamResponse]],
                     refusal: Callable[[RequestError, int], web.StreamResponse]) -> web.StreamResponse:
        """Run `handler` with the call's memory holds, send its response, and record the
        call; a RequestError is answered with `refusal(error, http_status)` in the route's
        own error shape. The call's class is the `x-priority` header's, or its API key's,
        and it counts under its key's in-flight cap until answered (ApiKeys.admit).

        The response is written here rather than by aiohttp once the handler returns: the
        call's memory (its body, its answer) stays held in the ledger until the answer has
        gone to the socket, so a client that stops reading holds it, inside the budget,
        and its connection's share of it, as a gRPC caller does."""
        record = CallRecord(self.metrics, rpc)
        address = request.transport.get_extra_info("peername") if request.transport else None
        holds = self.plane.holds(f"http:{address[0]}:{address[1]}" if address else None)
        self.plane.answer_owed(holds)
        stalled, release = False, None
        try:
            try:
                release = self.keys.admit(request.get(API_KEY), request.headers.get(HEADER), HEADER)
                response = await handler(holds)
            except Exception as err:  # noqa: BLE001 - every failure is answered
                error = record.refusal(err)
                response = refusal(error, http_status(error))
                if isinstance(error, RetryLater):
                    response.headers["Retry-After"] = str(error.retry_after_s)
                if isinstance(error, RequestTimeout | TooLarge) or request.content.exception():
                    response.force_close()  # the rest of the body is not worth reading
                stalled = isinstance(error, RequestTimeout)
            if not self.plane.serving():
                response.force_close()  # a draining server sends keep-alive clients elsewhere
            await response.prepare(request)
            await response.write_eof()
            if stalled:
                # Else aiohttp waits up to 10 s more for the rest of a body that stopped
                # coming, holding the connection past the body timeout.
                request.protocol.force_close()
            return response
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            record.code = CANCELLED
            raise
        finally:
            if release is not None:
                release()
            self.plane.end_call(holds)
            record.end()
