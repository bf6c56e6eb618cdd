"""The load generator: groups of concurrent callers, each group sending its requests to one
API of a server, over gRPC (a method of attnserve.v1, on a few channels) or HTTP (a JSON
body POSTed to one route, a kept-alive connection per caller), back to back or paced, with
per-call metadata (gRPC metadata, HTTP headers: a priority, say), each request once or
round and round for a time (each group its own). The groups run in this process, or, given a pool of client
processes (`client_pool`), spread over processes that start together, so that the client
is not what is measured. Beside it, h2load (nghttp2's), where even that client costs too
much: a few microseconds of client CPU a call.

    bulk = Callers(Grpc(address), [big_request], callers=4, seconds=10)
    interactive = Callers(Grpc(address, metadata=(("x-priority", "interactive"),)),
                          [small_request], pace_s=0.05, seconds=10)
    bulk_run, interactive_run = run(bulk, interactive)
"""

import asyncio
import itertools
import json
import multiprocessing
import re
import shutil
import struct
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 1 << 30
"""every layer's maps in float32 at 8 × 256 fit (the default 64 MiB refuses them, as it should)"""
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Grpc:
    """attnserve.v1's `method` at `address`, over at most `channels` channels in each client
    process (and never more than its callers): with --workers, connections, not calls, are
    spread over the front ends."""

    address: str
    method: str = "Embed"
    channels: int = 1
    metadata: tuple[tuple[str, str], ...] = ()

    @asynccontextmanager
    async def connect(self, callers: int):
        """(connections, call(caller, request) -> answer)"""
        from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc

        channels = [grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
                    for _ in range(max(1, min(self.channels, callers)))]
        methods = [getattr(pb_grpc.EncoderServiceStub(channel), self.method) for channel in channels]
        try:
            yield len(methods), lambda k, request: methods[k % len(methods)](
                request, metadata=self.metadata or None)
        finally:
            for channel in channels:
                await channel.close()


@dataclass(frozen=True)
class Http:
    """A JSON body POSTed to `url`, with `headers`: a kept-alive connection per caller, as
    HTTP/1.1 clients keep a pool (one call at a time on a connection)."""

    url: str
    headers: tuple[tuple[str, str], ...] = ()

    @asynccontextmanager
    async def connect(self, callers: int):
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def call(k: int, body) -> dict:
                async with session.post(self.url, json=body, headers=dict(self.headers)) as response:
                    answer = await response.read()
                if response.status != 200:
                    raise HttpError(response.status, f"{self.url}: HTTP {response.status}: {answer[:300]!r}")
                return json.loads(answer)

            yield 1, call


@dataclass(frozen=True)
class Callers:
    """`callers` callers of `target`: each takes the next of `requests` not yet taken (round
    and round for `seconds`, when given), sends it, waits for the answer, and starts its next
    call `pace_s` after its last one started (0: at once)."""

    target: Grpc | Http
    requests: list
    callers: int = 1
    seconds: float | None = None
    pace_s: float = 0.0
    processes: int = 1
    """client processes the callers are spread over, in a run given a pool"""
    errors_ok: bool = False
    """count failed calls by code (Run.errors) rather than stop"""
    keep: bool = False
    """keep every answer (Run.answers)"""


@dataclass
class Run:
    begin: float = float("inf")
    end: float = 0.0
    """wall clock (time.time) of the start and of the last answer"""
    latencies: list[float] = field(default_factory=list)
    """seconds of each answered call"""
    errors: dict[str, int] = field(default_factory=dict)
    answers: list = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.end - self.begin

    @property
    def rate(self) -> float:
        """answered calls a second"""
        return len(self.latencies) / self.seconds


def client_pool(processes: int) -> ProcessPoolExecutor:
    """Client processes for `run`: as many as the groups' `processes` add up to, so that
    every part starts together. A group's callers and requests are split among its
    processes (each process goes round all the requests of a timed group)."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))


def run(*groups: Callers, warm: bool = True, pool: ProcessPoolExecutor | None = None) -> list[Run]:
    """Every group at once, in this process or spread over `pool`'s processes; a Run per
    group. `warm`: one untimed call on each connection first."""
    if pool is None:
        return asyncio.run(_run(groups, warm, None))
    start_at = time.time() + 1.0
    parts = []
    for group in groups:
        # Never more processes than callers, nor (each request sent once) than requests.
        n = min(group.processes, group.callers, group.callers if group.seconds else len(group.requests))
        parts.append([pool.submit(_in_process, replace(
            group, callers=group.callers // n + (k < group.callers % n),
            requests=group.requests if group.seconds else group.requests[k::n]), warm, start_at)
            for k in range(n)])
    runs = []
    for futures in parts:
        done = [f.result() for f in futures]
        runs.append(Run(min(r.begin for r in done), max(r.end for r in done),
                        [x for r in done for x in r.latencies],
                        {c: sum(r.errors.get(c, 0) for r in done) for r in done for c in r.errors},
                        [a for r in done for a in r.answers]))
    return runs


def _in_process(group: Callers, warm: bool, start_at: float) -> Run:
    return asyncio.run(_run([group], warm, start_at))[0]


async def _run(groups, warm: bool, start_at: float | None) -> list[Run]:
    async with AsyncExitStack() as stack:
        connected = [await stack.enter_async_context(g.target.connect(g.callers)) for g in groups]
        if warm:
            await asyncio.gather(*(call(k, g.requests[0]) for g, (connections, call)
                                   in zip(groups, connected, strict=True) for k in range(connections)))
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        runs = [Run(begin=time.time()) for _ in groups]
        await asyncio.gather(*(
            _caller(g, call, k, pending, r)
            for g, (_, call), r in zip(groups, connected, runs, strict=True)
            for pending in [itertools.cycle(g.requests) if g.seconds else iter(g.requests)]
            for k in range(g.callers)))
        for r in runs:
            r.end = time.time()
        return runs


async def _caller(group: Callers, call, k: int, pending, run: Run) -> None:
    next_start = time.perf_counter()
    deadline = next_start + group.seconds if group.seconds else None
    for request in pending:  # shared by the group's callers
        if next_start > time.perf_counter():
            await asyncio.sleep(next_start - time.perf_counter())
        if deadline is not None and time.perf_counter() >= deadline:
            return
        started = time.perf_counter()
        next_start = started + group.pace_s
        try:
            answer = await call(k, request)
        except (grpc.aio.AioRpcError, HttpError) as err:
            if not group.errors_ok:
                raise
            code = f"HTTP {err.status}" if isinstance(err, HttpError) else err.code().name
            run.errors[code] = run.errors.get(code, 0) + 1
            continue
        run.latencies.append(time.perf_counter() - started)
        if group.keep:
            run.answers.append(answer)


def flood_client(choice: str) -> str:
    """h2load where it is installed (`choice` auto), else our callers in client processes
    (python)."""
    return choice if choice != "auto" else ("h2load" if shutil.which("h2load") else "python")


def h2load(address: str, request, callers: int, seconds: float, body: Path) -> subprocess.Popen:
    """h2load sending `request` (an EmbedRequest, in gRPC's framing over plain HTTP/2, written
    to `body`) to attnserve.v1's Embed from `callers` connections for `seconds`, started;
    `h2load_calls` waits for it and counts the calls answered."""
    message = request.SerializeToString()
    body.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    return subprocess.Popen(
        ["h2load", "-D", str(round(seconds)), "-c", str(callers), "-m", "1", "-t", "1", "-d", str(body),
         "-H", "content-type: application/grpc", "-H", "te: trailers",
         f"http://{address}/attnserve.v1.EncoderService/Embed"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def h2load_calls(process: subprocess.Popen, timeout: float) -> int:
    out = process.communicate(timeout=timeout)[0]
    done = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out)
    if not done:
        raise RuntimeError(f"h2load said:\n{out}")
    return int(done.group(1))
