"""Promise: a body whose chunked framing breaks ends at once, on the aiohttp installed. The
listener (server/http/listener.py) reaches into aiohttp's request handler to give the
route the parser's error; this fails when an aiohttp release changes what it reaches
into, whatever pyproject.toml allows: the route reading the body gets MalformedBody at
once (not at a body timeout), answers 400 in its own shape, and the connection closes
after the answer; a good chunked body still arrives whole."""

import asyncio
import socket

import pytest
from aiohttp import web

from attnserve.server.http.listener import Listener, MalformedBody

# Far longer than any answer here takes: an answer that waited for more bytes misses it.
PATIENCE_S = 10.0
HEAD = (b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")
BROKEN = [b"zz\r\n{}\r\n0\r\n\r\n", b"2;\x01\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX\r\n0\r\n\r\n"]


async def read(request: web.Request) -> web.Response:
    """As a door reads a body: its chunks until the end, then the error that ended it."""
    received = b""
    try:
        while chunk := await request.content.readany():
            received += chunk
        if (broken := request.content.exception()) is not None:
            raise broken
    except MalformedBody as err:
        response = web.json_response({"error": f"body: {err.message}"}, status=400)
        response.force_close()
        return response
    return web.json_response({"received": received.decode()})


def exchange(port: int, parts: list[bytes]) -> tuple[bytes, bool]:
    """Send `parts` one at a time on a new connection: (the answer, closed after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S) as sock:
        for part in parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                return answer, True
            answer += chunk
        try:
            return answer, sock.recv(1) == b""
        except ConnectionResetError:
            return answer, True


@pytest.mark.parametrize("body", BROKEN)
@pytest.mark.parametrize("with_the_head", [True, False])
def test_a_broken_chunked_body_is_400_at_once_and_closes(body, with_the_head):
    async def scenario():
        app = web.Application()
        app.add_routes([web.post("/read", read)])
        listener = Listener(app, header_timeout_s=PATIENCE_S)
        port = await listener.start("127.0.0.1", 0)
        try:
            parts = [HEAD + body] if with_the_head else [HEAD, body]
            answer, closed = await asyncio.wait_for(
                asyncio.to_thread(exchange, port, parts), PATIENCE_S / 2)
            good, _ = await asyncio.to_thread(exchange, port, [
                HEAD.replace(b"Host: x", b"Host: x\r\nConnection: close") + b"2\r\n{}\r\n0\r\n\r\n"])
        finally:
            await listener.stop()
        assert answer.startswith(b"HTTP/1.1 400") and b"body: malformed chunked encoding (" in answer
        assert closed, "the connection stayed open after a broken body"
        assert good.startswith(b"HTTP/1.1 200") and b'{"received": "{}"}' in good
    asyncio.run(scenario())
