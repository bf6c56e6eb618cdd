"""One aiohttp application on one port, with the limits every port of the server keeps: a
header timeout, a request line and header of at most 8 KiB, bodies never inflated, a deep
listen backlog, and a body whose chunked framing breaks ended at once.

A request body that breaks HTTP/1.1's framing (a chunk size that is not hex or does not
fit in 64 bits, a malformed chunk extension, trailer or chunk end) ends that request's
body at once, with the parser's reason, so its route answers 400 in its own error shape
and the connection closes after the answer, as nginx does. aiohttp's parser raises such
an error to the connection, which queues a 400 of its own behind the request being read
and leaves that request's body open: its route waits for bytes that will never come,
until the body timeout. And when the head and the bad body arrive in one read, the
request never reaches its route at all. So each connection's parser is wrapped to hand
the error to the body it belongs to, and a read that holds a request's head and the start
of its body is fed to the parser as two. aiohttp offers no public hook for either: the
wrapping reaches into its request handler (`_parser`) and server (`_kwargs`,
`_make_server`), which is why pyproject.toml pins aiohttp to the releases it is tested on
(tests/server/http/test_listener.py fails when a release breaks it)."""

import logging
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http import HttpProcessingError, RawRequestMessage
from aiohttp.streams import StreamReader

log = logging.getLogger("attnserve.http")
HEAD_END = b"\r\n\r\n"
# A malformed body's reason, as logged and as the route quotes it, is cut to this.
REASON_CHARS = 120


class MalformedBody(HttpProcessingError):
    """What reading a body whose framing broke raises: the parser's reason."""


class FramedParser:
    """One connection's request parser, remembering the request whose body it is reading
    and handing an error inside that body to `broken(message, body, error)` instead of
    raising it. Everything else is the wrapped parser's."""

    def __init__(self, parser: Any,
                 broken: Callable[[RawRequestMessage, StreamReader, HttpProcessingError], None]):
        self._parser = parser
        self._broken = broken
        self._message: RawRequestMessage | None = None
        self._body: StreamReader | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)

    def between_requests(self) -> bool:
        return self._body is None or self._body.is_eof()

    def feed_data(self, data: bytes) -> tuple[Any, bool, bytes]:
        try:
            messages, upgraded, tail = self._parser.feed_data(data)
        except HttpProcessingError as err:
            if self.between_requests():  # a bad request line or head: aiohttp answers it
                raise
            self._broken(self._message, self._body, err)
            return (), False, b""
        if messages:
            self._message, self._body = messages[-1]
        return messages, upgraded, tail


class FramedHandler(web.RequestHandler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._parser = FramedParser(self._parser, self._body_broken)

    def data_received(self, data: bytes) -> None:
        # The head alone first, so that its request is queued for its route before the
        # parser can fail on the body after it. (No parser: the connection is gone.)
        reading_head = self._parser is not None and self._parser.between_requests()
        end = data.find(HEAD_END) if reading_head else -1
        if 0 <= end < len(data) - len(HEAD_END):
            split = end + len(HEAD_END)
            super().data_received(data[:split])
            data = data[split:]
        super().data_received(data)

    def _body_broken(self, message: RawRequestMessage, body: StreamReader, err: HttpProcessingError) -> None:
        # The parser's reason alone: its message's first line, without the bytes it quotes.
        reason = str(err.message).split("\n", 1)[0].rstrip(" :")[:REASON_CHARS] or type(err).__name__
        log.info("event=malformed_request method=%s path=%r error=%r", message.method[:16],
                 message.path[:64], reason)
        # End of file first: a read waiting for more bytes wakes without an error, which is
        # what aiohttp's own read of a body left unread by its route (after the answer, to
        # keep the connection) needs. The error after it: the route's next read raises it.
        body.feed_eof()
        body.set_exception(MalformedBody(message=f"malformed chunked encoding ({reason})"))
        self.close()  # nothing after a broken framing can be parsed


class FramedServer(web.Server):
    def __call__(self) -> FramedHandler:
        return FramedHandler(self, loop=self._loop, **self._kwargs)


class FramedAppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return FramedServer(made.request_handler, request_factory=made.request_factory,
                            handler_cancellation=made.handler_cancellation, **made._kwargs)

LISTEN_BACKLOG = 1024
# Once every answer owed has been written (DataPlane.answers_sent), or the drain ran out of
# time, what is left gets this long before the connections close.
SEND_GRACE_S = 1.0
MAX_LINE_BYTES = 8190


class Listener:
    def __init__(self, app: web.Application, header_timeout_s: float = 75.0):
        # handler_cancellation: a caller that hangs up cancels its handler, which frees its
        # place in the queue as a cancelled gRPC call does. No access log: one line per
        # request is the metrics' job. aiohttp's keep-alive timer runs from a connection's
        # opening and from each answer, until the next request's headers are in: the
        # header timeout.
        self.runner = FramedAppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False,
                                      shutdown_timeout=SEND_GRACE_S, keepalive_timeout=header_timeout_s,
                                      max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    reuse_port: bool = False) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=ssl_context,
                           reuse_port=reuse_port)
        await site.start()
        return self.runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop listening, let answers in progress finish within SEND_GRACE_S, close."""
        await self.runner.cleanup()
