"""`python -m bench BENCHMARK [options]`: the one runner of the repository's benchmarks.

A benchmark is a function in a module of bench/benchmarks/, registered with `@benchmark`:
it takes the parsed options and returns a `Result` (a markdown table, its data, a plot).
The runner heads the table with the machine and the date, prints it, and writes
NAME.md, NAME.json and NAME.png under --out-dir (bench/results/NAME/). Every benchmark
takes --quick (the smallest run that proves the command works: its figures mean nothing),
--out-dir and --server-arg (a flag for every `attnserve serve` it starts).
"""

import argparse
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import pkgutil
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import REPO

RESULTS = REPO / "bench" / "results"
DEFAULT_ARTIFACT = REPO / "artifacts" / "all-MiniLM-L6-v2"


@dataclass
class Result:
    table: str
    """markdown, printed under the machine and the date"""
    data: dict
    """kept as JSON, with the environment measured"""
    plot: Callable[[Path], None] | None = None
    """draws the result into the PNG it is given (bench/plot.py)"""
    failed: list[str] = field(default_factory=list)
    """parts that failed: the run still reports the others, and exits 1"""


@dataclass(frozen=True)
class Benchmark:
    run: Callable[[argparse.Namespace], Result]
    options: tuple[tuple[tuple, dict], ...]


BENCHMARKS: dict[str, Benchmark] = {}


def option(*flags: str, **kwargs) -> tuple[tuple, dict]:
    """One option of a benchmark, as argparse's add_argument takes it."""
    return flags, kwargs


def benchmark(name: str, *options: tuple[tuple, dict]):
    """Registers `run(args) -> Result` as `python -m bench NAME`; its docstring is the help."""
    def register(run: Callable[[argparse.Namespace], Result]):
        BENCHMARKS[name] = Benchmark(run, options)
        return run
    return register


# --- the machine -------------------------------------------------------------------------------

def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    # A checkout copied without its history (a GPU machine's, say) still runs the benchmarks.
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _gpu() -> dict:
    """The first GPU as nvidia-smi names it."""
    if not shutil.which("nvidia-smi"):
        return {"gpu": "unknown (no nvidia-smi)", "driver": "?", "gpu_memory": "?"}
    query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader", "-i", "0"], capture_output=True, text=True)
    name, driver, memory = ([x.strip() for x in query.stdout.split(",")] + ["?"] * 3)[:3]
    return {"gpu": name, "driver": driver, "gpu_memory": memory}


def environment(threads: int, device: str = "cpu") -> dict:
    """The CPU, the cores this process may use, the date, the versions measured, the commit
    and the command; with `device` cuda, the GPU and its driver too."""
    import grpc
    import numpy

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    out = {"cores": len(os.sched_getaffinity(0)), "threads": threads, "cpu": cpu, "device": device,
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "attnserve": _version("attnserve"),
           "onnxruntime": _version("onnxruntime-gpu") or _version("onnxruntime"),
           "python": platform.python_version(), "numpy": numpy.__version__,
           "grpcio": grpc.__version__, "commit": _git("rev-parse", "--short", "HEAD"),
           "server_dirty": bool(_git("status", "--porcelain", "--", "server")),
           "command": " ".join(["python -m bench", *sys.argv[1:]])}
    return out | (_gpu() if device == "cuda" else {})


def machine(environment: dict) -> str:
    """What a table is headed and a docs section keyed by: the GPU where the run used one,
    the CPU and the cores it used."""
    cpu = f"{environment['cpu']}, {environment['cores']} cores"
    if environment.get("device") == "cuda":
        return f"{environment['gpu']} (driver {environment['driver']}), {cpu}"
    return cpu


# --- running -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    from bench import benchmarks

    for module in pkgutil.iter_modules(benchmarks.__path__):
        importlib.import_module(f"{benchmarks.__name__}.{module.name}")
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, registered in sorted(BENCHMARKS.items()):
        doc = inspect.getdoc(registered.run) or name
        sub = commands.add_parser(name, help=doc.splitlines()[0], description=doc,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--quick", action="store_true",
                         help="the smallest run that proves the command works (its figures mean nothing)")
        sub.add_argument("--out-dir", type=Path, default=RESULTS / name,
                         help="where its table, JSON, plot and server logs go")
        sub.add_argument("--server-arg", action="append", default=[],
                         help="a flag for every `attnserve serve` it starts (repeatable), e.g. "
                              "--server-arg=--max-wait-ms=2")
        for flags, kwargs in registered.options:
            sub.add_argument(*flags, **kwargs)
    return p


def save(args: argparse.Namespace, result: Result) -> str:
    """The result's table and JSON under --out-dir, as they stand (a benchmark may save as
    it goes, so that a run stopped midway keeps what it had); the table with its heading."""
    env = result.data.setdefault("environment", environment(getattr(args, "threads", 0) or 0))
    text = f"{machine(env)}, {env['date']}\n\n{result.table}"
    (args.out_dir / f"{args.benchmark}.md").write_text(text + "\n")
    (args.out_dir / f"{args.benchmark}.json").write_text(json.dumps(result.data, indent=1, default=str))
    return text


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    args = parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = BENCHMARKS[args.benchmark].run(args)
    result.data.setdefault("seconds", time.perf_counter() - started)
    print(save(args, result))
    written = [f"{args.benchmark}.md", f"{args.benchmark}.json"]
    if result.plot and importlib.util.find_spec("matplotlib"):
        result.plot(args.out_dir / f"{args.benchmark}.png")
        written.append(f"{args.benchmark}.png")
    elif result.plot:
        print("no plot: matplotlib is missing (pip install 'attnserve[plot]')", file=sys.stderr)
    print(f"\nwritten under {args.out_dir}: {', '.join(written)}"
          + (f"; failed: {', '.join(result.failed)}" if result.failed else ""))
    return 1 if result.failed else 0
