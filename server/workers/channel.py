"""One connection between a front end and the engine process: whole messages over a Unix
SOCK_SEQPACKET socket, on the event loop. A message is a small JSON header (lists, numbers,
strings: nothing a peer could make run) and a list of arrays, in one datagram under
INLINE_BYTES, else written once into a memfd whose descriptor travels instead (SCM_RIGHTS):
the receiver's arrays are views of its mapping, which lives as long as they do. A memfd
belongs to no path, so nothing is left behind when a process dies."""

import asyncio
import collections
import logging
import mmap
import os
import socket
import struct
from collections.abc import Callable, Sequence

import numpy as np
import orjson

log = logging.getLogger("attnserve.workers")

# Messages up to this size go inline: far under a Unix socket's send buffer, and larger
# ones are cheaper through a memfd (one copy) than through the kernel's buffers (two).
INLINE_BYTES = 32 << 10
_ALIGN = 64
_HEAD = struct.Struct("<I")

Entry = Sequence[np.ndarray]
"""the parts of one array: raveled and laid end to end, the receiver gets one flat array"""


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _layout(entries: Sequence[Entry]) -> tuple[list[tuple[str, int, int]], int]:
    """(dtype, offset, count) per entry, from the start of the data, and the data's size."""
    spans, offset = [], 0
    for parts in entries:
        dtype = np.dtype(parts[0].dtype) if parts else np.dtype(np.float32)
        count = sum(p.size for p in parts)
        spans.append((dtype.str, offset, count))
        offset = _aligned(offset + count * dtype.itemsize)
    return spans, offset


def _fill(buffer, start: int, entries: Sequence[Entry], spans) -> None:
    for parts, (dtype, offset, count) in zip(entries, spans, strict=True):
        dest = np.frombuffer(buffer, dtype=dtype, count=count, offset=start + offset)
        at = 0
        for part in parts:
            dest[at:at + part.size] = part.reshape(-1)
            at += part.size


def encode(header: object, entries: Sequence[Entry]) -> tuple[bytes, int | None]:
    """(the datagram, the memfd carrying it when it is large)"""
    spans, size = _layout(entries)
    text = orjson.dumps([header, spans])
    head = _HEAD.pack(len(text)) + text
    start = _aligned(len(head))
    total = start + size
    if total <= INLINE_BYTES:
        frame = bytearray(total)
        frame[:len(head)] = head
        _fill(frame, start, entries, spans)
        return bytes(frame), None
    fd = os.memfd_create("attnserve-message", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as mapped:
            mapped[:len(head)] = head
            _fill(mapped, start, entries, spans)
    except BaseException:
        os.close(fd)
        raise
    return b"", fd


def decode(frame: bytes | mmap.mmap) -> tuple[object, list[np.ndarray]]:
    (length,) = _HEAD.unpack_from(frame)
    header, spans = orjson.loads(bytes(memoryview(frame)[_HEAD.size:_HEAD.size + length]))
    start = _aligned(_HEAD.size + length)
    return header, [np.frombuffer(frame, dtype=dtype, count=count, offset=start + offset)
                    for dtype, offset, count in spans]


class Channel:
    """Messages both ways on a connected SOCK_SEQPACKET socket. `on_message(header,
    arrays)` runs on the event loop for each message; `on_closed()` once, when the peer
    has gone."""

    def __init__(self, sock: socket.socket, on_message: Callable[[object, list[np.ndarray]], None],
                 on_closed: Callable[[], None]):
        self.sock, self.on_message, self.on_closed = sock, on_message, on_closed
        self.loop = asyncio.get_running_loop()
        self.pending: collections.deque[tuple[bytes, int | None]] = collections.deque()
        self.closed = False
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._readable)

    def send(self, header: object, entries: Sequence[Entry] = ()) -> None:
        self.send_frame(encode(header, entries))

    def send_frame(self, frame: tuple[bytes, int | None]) -> None:
        """A message `encode` made (on another thread, say)."""
        if self.closed:
            if frame[1] is not None:
                os.close(frame[1])
            return
        self.pending.append(frame)
        if len(self.pending) == 1:
            self._flush()

    def _flush(self) -> None:
        while self.pending:
            data, fd = self.pending[0]
            try:
                if fd is None:
                    self.sock.send(data)
                else:
                    socket.send_fds(self.sock, [b"M"], [fd])
            except BlockingIOError:
                self.loop.add_writer(self.sock.fileno(), self._flush)
                return
            except OSError:
                self.close()
                return
            self.pending.popleft()
            if fd is not None:
                os.close(fd)
        self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        while not self.closed:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, INLINE_BYTES, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:
                self.close()
                return
            frame = data
            if fds:
                with os.fdopen(fds[0], "rb", buffering=0) as file:
                    frame = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
            try:
                self.on_message(*decode(frame))
            except Exception:  # noqa: BLE001 - one bad message never stops the channel
                log.exception("event=channel_message_failed")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock.fileno())
        self.loop.remove_writer(self.sock.fileno())
        for _, fd in self.pending:
            if fd is not None:
                os.close(fd)
        self.pending.clear()
        self.sock.close()
        self.on_closed()
