"""A front-end process of a server with --workers (docs/architecture.md, "Worker processes"):
the doors on the shared ports before every model's engine in the engine process, reached
through `RemoteEngine`, one `RemoteScheduler` a model."""

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import sys
from collections.abc import Callable

import numpy as np

from attnserve.artifact import TOKENIZER
from attnserve.server.config import ServeConfig, config_from_json
from attnserve.server.engine import timings
from attnserve.server.engine.offload import RECEIVE_S, SUBMIT_S, Offload
from attnserve.server.engine.plane import build_plane
from attnserve.server.engine.queue import Limits, check_room
from attnserve.server.engine.registry import load_models, load_tokenizers
from attnserve.server.engine.requests import Submission
from attnserve.server.errors import Unavailable
from attnserve.server.logs import setup_logging
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.model import load_memory_model
from attnserve.server.metrics import Metrics
from attnserve.server.ports import Ports
from attnserve.server.priority import Priority
from attnserve.server.runtime.backend import SequenceResult
from attnserve.server.workers import messages, signals
from attnserve.server.workers.channel import Channel, encode
from attnserve.server.workers.shared import (
    CONFIG_ENV,
    DRAIN_TIMED_OUT,
    DRAINED,
    STANDBY,
    SharedKeyCounts,
    SharedState,
    SharedTotals,
)

log = logging.getLogger("attnserve.workers")

ENGINE_GONE = "the engine process is gone; the server is restarting: retry on another replica"
# How often a front end looks at the group's state for its health answer.
HEALTH_POLL_S = 0.05


class RemoteEngine:
    """The engine process, as this front end reaches it: one channel for every model's
    submissions, their answers, and the engine's facts."""

    def __init__(self, sock: socket.socket, shared: SharedState, offload: Offload,
                 on_lost: Callable[[], None]):
        """`on_lost()`: called once if the engine process goes."""
        self.shared, self.offload, self.on_lost = shared, offload, on_lost
        self.waiting: dict[int, tuple[asyncio.Future, timings.CallTimes | None]] = {}
        self.releasing: dict[int, tuple[int, int]] = {}
        """cancelled jobs the engine has not yet taken out: job -> (model, tokens)"""
        self.idle = asyncio.Event()  # no job waiting
        self.idle.set()
        self.jobs = itertools.count()
        self.alive = True
        self.welcome: asyncio.Future = asyncio.get_running_loop().create_future()
        self.channel = Channel(sock, self._message, self._closed)

    def released(self, model: int) -> tuple[int, int]:
        """(requests, tokens) of `model` cancelled here and not yet taken out there."""
        mine = [tokens for index, tokens in self.releasing.values() if index == model]
        return len(mine), sum(mine)

    async def submit(self, scheduler: "RemoteScheduler", submission: Submission) -> list[SequenceResult]:
        # A large request's message is made, and its answer unpacked, off the event loop
        # (87,381 sequences: 0.1 s and 0.33 s), which health checks would otherwise wait for.
        # Cancelled while it is made, nothing has gone to the engine and nothing is undone.
        job, lengths = next(self.jobs), submission.lengths
        frame = await self.offload.request(len(lengths) * SUBMIT_S, lambda: encode(
            *messages.submit(job, scheduler.index, submission)))
        future = asyncio.get_running_loop().create_future()
        self.waiting[job] = (future, timings.current())
        self.idle.clear()
        self.channel.send_frame(frame)
        try:
            header, arrays = await future
        except asyncio.CancelledError:
            # Cancelling this task cancelled the future it awaited: unless an answer came
            # first, the engine still has the job.
            if future.cancelled():
                self.releasing[job] = (scheduler.index, int(lengths.sum()))
                self.channel.send(["cancel", job])
            raise
        finally:
            del self.waiting[job]
            if not self.waiting:
                self.idle.set()
        return await self.offload.response(len(lengths) * RECEIVE_S, messages.received, header,
                                           arrays, lengths, scheduler.heads, scheduler.width)

    def _message(self, header, arrays: list[np.ndarray]) -> None:
        kind = header[0]
        if kind == "welcome":
            self.welcome.set_result(messages.welcomed(header))
            return
        self.releasing.pop(header[1], None)
        future, times = self.waiting.get(header[1], (None, None))
        if future is None or future.done():
            return  # cancelled meanwhile
        if kind == "results":
            if times is not None:
                times.add_wire(header[6])
            future.set_result((header, arrays))
        elif kind == "error":
            future.set_exception(messages.raised(header))

    def _closed(self) -> None:
        self.alive = False
        log.error("event=engine_lost waiting=%d", len(self.waiting))
        for future in [future for future, _ in self.waiting.values()] + [self.welcome]:
            if not future.done():
                future.set_exception(Unavailable(ENGINE_GONE))
        self.on_lost()


class RemoteScheduler:
    """One model's scheduler, in the engine process: admission from its queue's counts in
    the shared state, submissions over the engine's channel."""

    def __init__(self, engine: RemoteEngine, index: int, limits: Limits, heads: int, width: int):
        self.engine, self.index, self.limits, self.heads, self.width = engine, index, limits, heads, width

    def admit(self, tokens: int, at_least: bool = False, priority: Priority | None = None) -> None:
        if not self.engine.alive:
            raise Unavailable(ENGINE_GONE)
        # The queue's counts, less what this front end has cancelled and the engine is
        # taking out: a caller whose call was cancelled finds its place free at once.
        fields = self.engine.shared.fields
        requests, released = self.engine.released(self.index)
        check_room(self.limits, bool(fields.draining), fields.queue_requests[self.index] - requests,
                   fields.queue_tokens[self.index] - released, tokens, at_least, priority)

    async def submit(self, submission: Submission) -> list[SequenceResult]:
        self.admit(int(submission.lengths.sum()), priority=submission.priority)
        return await self.engine.submit(self, submission)


class FrontProcess:
    def __init__(self, config: ServeConfig, shared: SharedState, index: int, address: bytes):
        self.config, self.shared, self.index, self.address = config, shared, index, address
        # What this process reads of each artifact is checked: its tokenizer (the engine
        # process checked the graphs it loads).
        self.named = load_models(config, verify=(TOKENIZER,))
        self.metrics = Metrics(max(n.artifact.manifest.max_positions for n in self.named))
        self.tokenizers = load_tokenizers(self.named)
        self.ports = Ports(config, self.metrics, SharedKeyCounts(shared, lambda: self.index))
        self.draining = False

    def serving(self) -> bool:
        return not self.draining and self.remote.alive and self.shared.serving()

    async def run(self) -> None:
        config = self.config
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(self.address)
        # Health says NOT_SERVING the moment the engine is gone, not at the next look.
        offload = Offload()
        self.remote = RemoteEngine(sock, self.shared, offload,
                                   lambda: asyncio.ensure_future(self.ports.set_health(False)))
        facts: messages.EngineFacts = await self.remote.welcome
        limits = Limits.of(config, facts.budget)
        budget = MemoryBudget(facts.budget, facts.responses_in_budget,
                              totals=SharedTotals(self.shared, self.index))
        runs = []
        for i, (named, placement) in enumerate(zip(self.named, facts.models, strict=True)):
            manifest = named.artifact.manifest
            memory = budget.for_model(named.name, load_memory_model(
                named.artifact.directory, manifest, placement.provider, placement.precision),
                manifest.num_heads, manifest.hidden_size)
            runs.append((RemoteScheduler(self.remote, i, limits, manifest.num_heads,
                                         manifest.hidden_size), memory, placement))
        self.plane = build_plane(config, self.named, self.tokenizers, runs, budget, offload,
                                 self.metrics, self.serving)
        await self.ports.start(self.plane, offload.requests_pool, shared_ports=True, metrics_port=False)
        self.shared.fields.worker_up[self.index] = 1
        log.info("event=front_end_up worker=%d port=%d http_port=%d", self.index, self.ports.port,
                 self.ports.http_port)
        stop = signals.take_stop()
        said = None
        while not stop.is_set():
            serving = self.serving()
            if serving != said:
                await self.ports.set_health(serving)
                said = serving
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
        await self.drain()

    async def drain(self) -> None:
        """NOT_SERVING at once, UNAVAILABLE to new work, finish what was accepted; the
        ports stay open (answering NOT_SERVING) until every front end has finished, so a
        probe never meets a closed port while the group drains."""
        self.draining = True
        await self.ports.set_health(False)
        deadline = asyncio.get_running_loop().time() + self.config.drain_seconds
        finished = True
        try:
            await asyncio.wait_for(self.remote.idle.wait(), self.config.drain_seconds)
        except TimeoutError:
            finished = False
        finished = await self.plane.answers_sent(deadline - asyncio.get_running_loop().time()) and finished
        fields = self.shared.fields
        fields.worker_drained[self.index] = DRAINED if finished else DRAIN_TIMED_OUT
        while (not all(fields.worker_drained[i] for i in range(fields.workers))
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(HEALTH_POLL_S)
        self.remote.channel.send(["bye"])
        await self.ports.stop()
        log.info("event=front_end_stopped worker=%d all_finished=%s answered=%s", self.index,
                 finished, self.ports.answered())


def assignment(fd: int) -> int:
    """A standby's index, once the supervisor writes it (a line) to the pipe `fd`."""
    with os.fdopen(fd) as pipe:
        line = pipe.readline()
    if not line.endswith("\n"):  # the supervisor is gone: PR_SET_PDEATHSIG ends this process anyway
        sys.exit(0)
    return int(line)


def main() -> int:
    config = config_from_json(os.environ.pop(CONFIG_ENV))
    setup_logging(config.log_level)
    shared_fd, index, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    shared = SharedState(shared_fd)
    signals.become_child(shared.fields.supervisor_pid)
    # A standby does everything that takes time (the interpreter, the imports, every
    # model's tokenizer) before it is needed, then waits to be told whose place it takes:
    # a dead front end's replacement then only connects and binds.
    front = FrontProcess(config, shared, -1 if index == STANDBY else int(index),
                         b"\0" + address.encode())
    if index == STANDBY:
        shared.fields.standby_waiting_pid = os.getpid()
        front.index = assignment(int(sys.argv[4]))
        log.info("event=standby_takes_over worker=%d", front.index)
    asyncio.run(front.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
