"""A front-end process of a server with --workers: the doors on the shared ports, parsing,
validating, tokenizing and packing on an event loop of its own; the engine (the queue, the
batch loop, the sessions) is the engine process's, reached through `RemoteScheduler`.

It serves while the engine is warm and nothing drains, whatever becomes of the other front
ends: one that dies fails only its own calls. If the engine process goes, every call
waiting on it gets UNAVAILABLE at once and so does every new one; the supervisor then
stops the group. It drains when the supervisor says so (server/workers/signals.py)."""

import asyncio
import itertools
import logging
import os
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from attnserve.artifact import TOKENIZER, load_artifact
from attnserve.server.config import ServeConfig, config_from_json
from attnserve.server.doors.ports import Ports
from attnserve.server.engine.data_plane import DataPlane
from attnserve.server.engine.errors import Unavailable
from attnserve.server.engine.offload import Offload
from attnserve.server.engine.queue import Limits, check_room
from attnserve.server.engine.tokenize import load_tokenizer
from attnserve.server.logs import setup_logging
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.model import load_memory_model
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.backend import HIDDEN_ONLY, Outputs, SequenceResult
from attnserve.server.workers import messages, signals
from attnserve.server.workers.channel import Channel
from attnserve.server.workers.shared import (
    CONFIG_ENV,
    DRAIN_TIMED_OUT,
    DRAINED,
    SharedState,
    SharedTotals,
)

log = logging.getLogger("attnserve.workers")

ENGINE_GONE = "the engine process is gone; the server is restarting: retry on another replica"
# How often a front end looks at the group's state for its health answer.
HEALTH_POLL_S = 0.05


class RemoteScheduler:
    """The engine's scheduler, in the engine process: admission from the queue's counts in
    the shared state, submissions over the channel."""

    def __init__(self, sock: socket.socket, shared: SharedState, heads: int, width: int,
                 on_lost: Callable[[], None]):
        """`on_lost()`: called once if the engine process goes."""
        self.shared, self.heads, self.width, self.on_lost = shared, heads, width, on_lost
        self.limits: Limits | None = None
        self.waiting: dict[int, tuple[asyncio.Future, np.ndarray]] = {}
        self.releasing: dict[int, int] = {}
        """cancelled jobs the engine has not yet taken out: job -> tokens"""
        self.idle = asyncio.Event()
        self.idle.set()
        self.jobs = itertools.count()
        self.alive = True
        self.welcome: asyncio.Future = asyncio.get_running_loop().create_future()
        self.channel = Channel(sock, self._message, self._closed)

    def admit(self, tokens: int, at_least: bool = False) -> None:
        if not self.alive:
            raise Unavailable(ENGINE_GONE)
        # The queue's counts, less what this front end has cancelled and the engine is
        # taking out: a caller whose call was cancelled finds its place free at once.
        fields = self.shared.fields
        check_room(self.limits, bool(fields.draining),
                   fields.queue_requests - len(self.releasing),
                   fields.queue_tokens - sum(self.releasing.values()), tokens, at_least)

    async def submit(self, sequences: list[np.ndarray], layers: tuple[int, ...] = (),
                     deadline: float | None = None, outputs: Outputs = HIDDEN_ONLY,
                     alone: float = 0.0, lengths: np.ndarray | None = None,
                     spans: list[np.ndarray] | None = None) -> list[SequenceResult]:
        if lengths is None:
            lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        self.admit(int(lengths.sum()))
        job = next(self.jobs)
        future = asyncio.get_running_loop().create_future()
        self.waiting[job] = (future, lengths)
        self.idle.clear()
        self.channel.send(*messages.submit(job, sequences, lengths, layers, deadline, outputs, alone,
                                           spans))
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelling this task cancelled the future it awaited: unless an answer came
            # first, the engine still has the job.
            if future.cancelled():
                self.releasing[job] = int(lengths.sum())
                self.channel.send(["cancel", job])
            raise
        finally:
            del self.waiting[job]
            if not self.waiting:
                self.idle.set()

    def _message(self, header, arrays: list[np.ndarray]) -> None:
        kind = header[0]
        if kind == "welcome":
            self.welcome.set_result(messages.welcomed(header))
            return
        self.releasing.pop(header[1], None)
        future, lengths = self.waiting.get(header[1], (None, None))
        if future is None or future.done():
            return  # cancelled meanwhile
        if kind == "results":
            future.set_result(messages.received(header, arrays, lengths, self.heads, self.width))
        elif kind == "error":
            future.set_exception(messages.raised(header))

    def _closed(self) -> None:
        self.alive = False
        log.error("event=engine_lost waiting=%d", len(self.waiting))
        for future, _ in self.waiting.values():
            if not future.done():
                future.set_exception(Unavailable(ENGINE_GONE))
        if not self.welcome.done():
            self.welcome.set_exception(Unavailable(ENGINE_GONE))
        self.on_lost()


class FrontProcess:
    def __init__(self, config: ServeConfig, shared: SharedState, index: int, address: bytes):
        self.config, self.shared, self.index, self.address = config, shared, index, address
        # What this process reads of the artifact is checked: its tokenizer (the engine
        # process checked the graphs it loads).
        self.artifact = load_artifact(config.artifact, verify=(TOKENIZER,))
        self.metrics = Metrics(self.artifact.manifest.max_positions)
        self.tokenizer = load_tokenizer(self.artifact)
        self.ports = Ports(config, self.metrics)
        self.draining = False

    def serving(self) -> bool:
        return not self.draining and self.remote.alive and self.shared.serving()

    async def run(self) -> None:
        config, manifest = self.config, self.artifact.manifest
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(self.address)
        # Health says NOT_SERVING the moment the engine is gone, not at the next look.
        self.remote = RemoteScheduler(sock, self.shared, manifest.num_heads, manifest.hidden_size,
                                      lambda: asyncio.ensure_future(self.ports.set_health(False)))
        facts: messages.EngineFacts = await self.remote.welcome
        self.remote.limits = Limits.of(config, facts.budget)
        model = load_memory_model(self.artifact.directory, manifest, facts.provider, facts.precision)
        memory = MemoryBudget(model, facts.budget, manifest.num_heads, manifest.hidden_size,
                              facts.responses_in_budget, totals=SharedTotals(self.shared, self.index))
        requests = ThreadPoolExecutor(1, thread_name_prefix="requests")
        offload = Offload(requests, ThreadPoolExecutor(1, thread_name_prefix="responses"))
        plane = DataPlane(self.artifact, self.tokenizer, self.remote, memory, offload, self.metrics,
                          facts.provider, facts.precision, self.serving, config.max_chunking_chars)
        await self.ports.start(plane, requests, shared_ports=True, metrics_port=False)
        self.shared.fields.worker_up[self.index] = 1
        log.info("event=front_end_up worker=%d port=%d http_port=%d", self.index, self.ports.port,
                 self.ports.http_port)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals.take_stop(loop, stop.set)
        said = None
        while not stop.is_set():
            serving = self.serving()
            if serving != said:
                await self.ports.set_health(serving)
                said = serving
            try:
                await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
            except TimeoutError:
                pass
        await self.drain()

    async def drain(self) -> None:
        """NOT_SERVING at once, UNAVAILABLE to new work, finish what was accepted; the
        ports stay open (answering NOT_SERVING) until every front end has finished, so a
        probe never meets a closed port while the group drains."""
        self.draining = True
        await self.ports.set_health(False)
        deadline = asyncio.get_running_loop().time() + self.config.drain_seconds
        try:
            await asyncio.wait_for(self.remote.idle.wait(), self.config.drain_seconds)
            finished = True
        except TimeoutError:
            finished = False
        fields = self.shared.fields
        fields.worker_drained[self.index] = DRAINED if finished else DRAIN_TIMED_OUT
        while (not all(fields.worker_drained[i] for i in range(fields.workers))
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(HEALTH_POLL_S)
        self.remote.channel.send(["bye"])
        await self.ports.stop()
        log.info("event=front_end_stopped worker=%d all_finished=%s answered=%s", self.index,
                 finished, self.ports.answered())


def main() -> int:
    setup_logging()
    config = config_from_json(os.environ.pop(CONFIG_ENV))
    logging.getLogger().setLevel(config.log_level.upper())
    shared_fd, index, address = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    shared = SharedState.attach(shared_fd)
    signals.become_child(shared.fields.supervisor_pid)
    front = FrontProcess(config, shared, index, b"\0" + address.encode())
    asyncio.run(front.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
