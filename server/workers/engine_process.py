"""The engine process of a server with --workers: every model's sessions, queue and batch
loop and the memory budget, for every front end at once (each submits token ids and gets
its sequences' results back: messages.py), and the group's merged /metrics."""

import asyncio
import logging
import os
import socket
import struct
import sys

import numpy as np

from attnserve.server.config import config_from_json
from attnserve.server.engine import timings
from attnserve.server.engine.offload import COPY_BYTE_S, Offload
from attnserve.server.engine.queue import RequestQueue
from attnserve.server.engine.registry import load_models, log_default_prompts
from attnserve.server.engine.requests import Submission
from attnserve.server.engine.runner import Runners
from attnserve.server.errors import RequestError
from attnserve.server.host import resident_bytes
from attnserve.server.logs import setup_logging
from attnserve.server.metrics import Metrics
from attnserve.server.metrics_port import MetricsThread
from attnserve.server.workers import messages, signals
from attnserve.server.workers.channel import Channel, encode
from attnserve.server.workers.shared import (
    CONFIG_ENV,
    ENGINE_SLOT,
    FRONT_ENDS_METRICS_ENV,
    SharedState,
    SharedTotals,
)

log = logging.getLogger("attnserve.workers")


class FrontEndLink:
    """One front end's connection: its submissions queued, its results sent back, and,
    when it goes, its queued sequences dropped unrun."""

    def __init__(self, process: "EngineProcess", sock: socket.socket, index: int):
        self.process, self.index, self.said_bye = process, index, False
        self.jobs: dict[int, asyncio.Task] = {}
        self.channel = Channel(sock, self.message, self.closed)
        self.channel.send(*messages.welcome(process.facts))

    def message(self, header, arrays: list[np.ndarray]) -> None:
        kind = header[0]
        if kind == "submit":
            job, model = header[1:3]
            queue = self.process.runners.models[model].queue
            self.jobs[job] = asyncio.get_running_loop().create_task(
                self.run(queue, job, messages.submitted(header, arrays)))
        elif kind == "cancel":
            task = self.jobs.get(header[1])
            if task is None:  # answered already: its place is free
                self.channel.send(["cancelled", header[1]])
            else:
                task.cancel()
        elif kind == "bye":
            self.said_bye = True

    async def run(self, queue: RequestQueue, job: int, submission: Submission) -> None:
        times = timings.begin()  # this task's own: the queue fills it in for the front end
        try:
            results = await queue.submit(submission)
            header, entries = messages.results(job, results, submission.layers, times)
            del results
            nbytes = sum(part.nbytes for parts in entries for part in parts)
            frame = await self.process.offload.response(nbytes * COPY_BYTE_S, encode, header, entries)
            self.channel.send_frame(frame)
        except RequestError as err:
            self.channel.send(*messages.error(job, err))
        except asyncio.CancelledError:
            # The front end cancelled it, or went away: its sequences are out of the queue.
            self.channel.send(["cancelled", job])
        finally:
            self.jobs.pop(job, None)

    def closed(self) -> None:
        for task in list(self.jobs.values()):
            task.cancel()
        self.process.links.discard(self)
        if not self.said_bye:
            self.process.metrics.worker_deaths.inc()
            log.warning("event=front_end_lost worker=%s jobs_dropped=%d", self.index,
                        len(self.jobs))


class EngineProcess:
    def __init__(self, config, shared: SharedState, listener: socket.socket):
        self.config, self.shared, self.listener = config, shared, listener
        named = load_models(config)
        log_default_prompts(config, named)
        self.metrics = Metrics(max(n.artifact.manifest.max_positions for n in named),
                               os.environ[FRONT_ENDS_METRICS_ENV])

        def totals(limit: float) -> SharedTotals:
            shared.fields.ledger_limit = limit
            return SharedTotals(shared, ENGINE_SLOT)

        runners = self.runners = Runners(config, named, self.metrics, totals, alone=False)
        self.facts = messages.EngineFacts(runners.limits.memory_budget_bytes, runners.budget.shared,
                                          [m.backend.placement for m in runners.models])
        self.links: set[FrontEndLink] = set()
        self.offload = Offload()
        shared.fields.budget, shared.fields.engine_pid = self.facts.budget, os.getpid()
        shared.fields.engine_loaded = 1

    def _counted(self, model: str, requests: int, tokens: int) -> None:
        fields, index = self.shared.fields, self.index[model]
        fields.queue_requests[index], fields.queue_tokens[index] = requests, tokens

    async def run(self) -> None:
        runners, config, fields = self.runners, self.config, self.shared.fields
        self.index = {m.name: i for i, m in enumerate(runners.models)}
        runners.start(self._counted)
        runners.describe()
        live = self.metrics.live
        live.serving = self.shared.serving
        if runners.device == "cpu":
            live.device_memory_used = lambda: sum(map(resident_bytes, self.shared.pids()))
        scrapes = MetricsThread(self.metrics, config.metrics_host, config.metrics_port) \
            if config.metrics_port else None
        if scrapes:
            fields.metrics_port = scrapes.start()
        stop = signals.take_stop()
        accepting = asyncio.get_running_loop().create_task(self._accept())
        await runners.warm_up()
        fields.engine_warm = 1
        log.info("event=engine_serving models=%s budget_bytes=%d memory_model=%r time_model=%r",
                 ",".join(self.index), self.facts.budget, runners.memory_source(),
                 runners.time_source())
        await stop.wait()
        # The front ends have drained (the supervisor stops them first); what they left is
        # answered within the drain time.
        finished = await runners.drain(config.drain_seconds)
        fields.engine_drained = int(finished)
        accepting.cancel()
        if scrapes:
            scrapes.stop()
        log.info("event=engine_stopped all_finished=%s", finished)

    async def _accept(self) -> None:
        """Connections from the group's own front ends only: the peer's pid (from the
        kernel, SO_PEERCRED) must be one the supervisor started."""
        loop = asyncio.get_running_loop()
        self.listener.setblocking(False)
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
            fields = self.shared.fields
            index = next((i for i in range(fields.workers) if fields.worker_pids[i] == pid), None)
            if index is None:
                log.warning("event=connection_refused peer_pid=%d reason='not a front end of "
                            "this server'", pid)
                sock.close()
                continue
            self.links.add(FrontEndLink(self, sock, index))


def main() -> int:
    config = config_from_json(os.environ.pop(CONFIG_ENV))
    setup_logging(config.log_level)
    shared_fd, listen_fd = int(sys.argv[1]), int(sys.argv[2])
    shared = SharedState(shared_fd)
    signals.become_child(shared.fields.supervisor_pid)
    listener = socket.socket(fileno=listen_fd)
    try:
        engine = EngineProcess(config, shared, listener)
    except Exception as err:  # noqa: BLE001 - a start-up failure, reported by the supervisor
        log.error("event=engine_failed error=%r", str(err))
        return 2
    asyncio.run(engine.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
