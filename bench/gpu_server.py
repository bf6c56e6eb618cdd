"""The GPU benchmark's server phase: `attnserve serve` (bench/harness.py) in one
configuration, called from client processes of their own (spawned), so the client is not
what is measured: cold start (spawn to SERVING, warm-up seconds and shapes), one caller at
the fixed shapes, concurrent callers of one batch, many callers of single mixed-length
texts, the smallest calls' rate, never-seen shapes after all of it, and the pooled
vectors' cosine to onnxruntime's at its default options."""

import asyncio
import logging
import re
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench.gpu_plan import CONCURRENT_SHAPE, Config, Inputs, Plan
from bench.measure import Budget, latency_summary, shape_row, time_calls
from bench.workloads import shape_name
from tests.harness import ServerProcess, sample

log = logging.getLogger("bench.gpu_bench")

CHANNELS_PER_CLIENT = 8
UNSEEN = "attnserve_unseen_shape_runs_total"


def _client(address: str, requests: list[list[str]], callers: int, start_at: float) -> dict:
    """One client process: `callers` concurrent callers sending `requests` in turn, from
    `start_at` (wall clock) so every process starts together."""
    return asyncio.run(_callers(address, requests, callers, start_at))


async def _callers(address: str, requests: list[list[str]], callers: int, start_at: float) -> dict:
    import grpc

    from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
    from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
    from bench.serving import CHANNEL_OPTIONS

    latencies: list[float] = []
    pending = iter(requests)
    # Connections, not calls, are spread over a server's front ends (--workers): a few per
    # client process.
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                for _ in range(min(callers, CHANNELS_PER_CLIENT))]
    try:
        stubs = [pb_grpc.EncoderServiceStub(channel) for channel in channels]
        # Connected before the start.
        await asyncio.gather(*(s.Embed(pb.EmbedRequest(texts=requests[0][:1])) for s in stubs))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        begin = time.time()

        async def caller(stub) -> None:
            for texts in pending:
                t0 = time.perf_counter()
                await stub.Embed(pb.EmbedRequest(texts=texts))
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(caller(stubs[k % len(stubs)]) for k in range(callers)))
        return {"begin": begin, "end": time.time(), "latencies": latencies}
    finally:
        for channel in channels:
            await channel.close()


def _rate_client(address: str, rpc: str, text: str, callers: int, start_at: float, seconds: float) -> int:
    """One client process: calls of `rpc` (GetModelInfo, or Embed of one text) answered
    in `seconds` from `start_at`, by `callers` concurrent callers."""
    return asyncio.run(_rate(address, rpc, text, callers, start_at, seconds))


async def _rate(address: str, rpc: str, text: str, callers: int, start_at: float, seconds: float) -> int:
    import grpc

    from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
    from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        call = ((lambda: stub.GetModelInfo(pb.GetModelInfoRequest())) if rpc == "GetModelInfo"
                else (lambda: stub.Embed(pb.EmbedRequest(texts=[text]))))
        await call()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop, answered = time.time() + seconds, 0

        async def caller() -> None:
            nonlocal answered
            while time.time() < stop:
                await call()
                answered += 1

        await asyncio.gather(*(caller() for _ in range(callers)))
        return answered


def front_end(pool: ProcessPoolExecutor, address: str, text: str, plan: Plan, seconds: float = 2.0) -> dict:
    """Requests/s one server process answers for the smallest calls, from every client
    process at once (32 callers each): where the Python front end, not the device, is
    the limit."""
    out = {}
    for rpc in ("GetModelInfo", "Embed"):
        start_at = time.time() + 1.0
        futures = [pool.submit(_rate_client, address, rpc, text, 32, start_at, seconds)
                   for _ in range(plan.client_processes)]
        out[rpc] = sum(f.result() for f in futures) / seconds
    return out


def drive(pool: ProcessPoolExecutor, address: str, requests: list[list[str]], tokens: int,
          callers: int, processes: int) -> dict:
    """Every request sent by `callers` callers spread over `processes` client processes:
    tokens/s over the whole run and latency percentiles over every request."""
    processes = max(1, min(processes, callers))
    start_at = time.time() + 1.0
    shares = [requests[k::processes] for k in range(processes)]
    split = [callers // processes + (k < callers % processes) for k in range(processes)]
    futures = [pool.submit(_client, address, share, n, start_at)
               for share, n in zip(shares, split, strict=True) if share]
    results = [f.result() for f in futures]
    seconds = max(r["end"] for r in results) - min(r["begin"] for r in results)
    latencies = [x for r in results for x in r["latencies"]]
    out = latency_summary(latencies)
    out.update(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, callers=callers,
               requests=len(requests))
    return out


def server_phase(artifact: Path, device: str, config: Config, plan: Plan, inputs: Inputs,
                 reference: list | None, pool: ProcessPoolExecutor, work: Path, budget: Budget) -> dict:
    """One server configuration; `reference`: onnxruntime's pooled vectors of the
    concurrent batch at its default options (the raw phase), when it ran."""
    from attnserve.client import EncoderClient

    flags = ("--device", device, *plan.server_args, *config.flags)
    started = time.perf_counter()
    server = ServerProcess(artifact, *flags, log_path=work / f"server-{config.name.replace(' ', '-')}.log",
                           start_timeout_s=240)
    out: dict = {"flags": list(flags), "ready_s": time.perf_counter() - started, "shapes": {}}
    try:
        warm = re.search(r"event=warmed_up model=\S+ shapes=(\d+) threads=(\d+) seconds=([\d.]+)",
                         server.output())
        if warm:
            out.update(warm_up_shapes=int(warm[1]), lanes=int(warm[2]), warm_up_s=float(warm[3]))
        with EncoderClient(server.address) as client:
            t0 = time.perf_counter()
            client.embed(inputs.shapes[plan.one_caller_shapes[0]].texts)
            out["first_request_ms"] = (time.perf_counter() - t0) * 1e3
            shapes = plan.one_caller_shapes if config.full else plan.one_caller_shapes[:2]
            for shape in shapes:
                if budget.left() < 25:
                    break
                batch = inputs.shapes[shape].texts
                seconds = time_calls(lambda batch=batch: client.embed(batch), plan.reps)
                out["shapes"][shape_name(*shape)] = shape_row(seconds, *shape)
                log.info("phase=server config=%r shape=%s p50_ms=%.3f", config.name, shape_name(*shape),
                         out["shapes"][shape_name(*shape)]["p50_ms"])
            if reference is not None:
                got = np.stack([r.pooled for r in client.embed(inputs.shapes[CONCURRENT_SHAPE].texts)])
                want = np.asarray(reference)
                out["min_cosine_vs_raw"] = float(((got * want).sum(1) / np.linalg.norm(got, axis=1)
                                                  / np.linalg.norm(want, axis=1)).min())
        batch, seq = CONCURRENT_SHAPE
        if budget.left() >= 20:
            requests = [inputs.shapes[CONCURRENT_SHAPE].texts] * plan.concurrent_requests
            out["concurrent"] = drive(pool, server.address, requests, len(requests) * batch * seq,
                                      plan.concurrent_callers, plan.client_processes)
            log.info("phase=server config=%r concurrent tokens_per_s=%.0f p99_ms=%.1f", config.name,
                     out["concurrent"]["tokens_per_s"], out["concurrent"]["p99_ms"])
        if budget.left() >= 20:
            out["mixed"] = drive(pool, server.address, [[t] for t in inputs.mixed.texts],
                                 sum(inputs.mixed.lengths), plan.mixed_callers, plan.client_processes)
            log.info("phase=server config=%r mixed tokens_per_s=%.0f p50_ms=%.1f p99_ms=%.1f", config.name,
                     out["mixed"]["tokens_per_s"], out["mixed"]["p50_ms"], out["mixed"]["p99_ms"])
        if config.full and budget.left() >= 20:
            out["front_end_rps"] = front_end(pool, server.address, inputs.shapes[(1, 16)].texts[0], plan)
            log.info("phase=server config=%r front_end_rps=%s", config.name, out["front_end_rps"])
        scraped = server.scrape()
        out["unseen_shape_runs"] = sample(scraped, UNSEEN, graph="embeddings")
        out["batches"] = sample(scraped, "attnserve_batch_size_count")
    finally:
        out["exit_code"] = server.stop()
    return out
