"""One aiohttp application on one port, with the limits every port of the server keeps:
a connection has a header timeout (from its opening, or from its last answer: an idle
keep-alive connection closes after it too), a request line and header of at most 8 KiB,
bodies never inflated, a body whose chunked framing breaks ended at once (see
http_framing.py), a deep listen backlog so a burst of connections queues in the kernel
instead of being dropped."""

import ssl

from aiohttp import web

from attnserve.server.http_framing import FramedAppRunner

LISTEN_BACKLOG = 1024
# After the request queue has drained, answers already computed get this long to be sent.
SEND_GRACE_S = 1.0
MAX_LINE_BYTES = 8190


class Listener:
    """One aiohttp application on one port."""

    def __init__(self, app: web.Application, header_timeout_s: float = 75.0):
        # handler_cancellation: a caller that hangs up cancels its handler, which frees its
        # place in the queue as a cancelled gRPC call does. No access log: one line per
        # request is the metrics' job. aiohttp's keep-alive timer runs from a connection's
        # opening and from each answer, until the next request's headers are in: the
        # header timeout.
        self.runner = FramedAppRunner(app, handler_cancellation=True, access_log=None,
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
