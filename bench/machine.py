"""The machine and versions a run measured, and the one line every table and docs section is
headed by."""

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.harness import REPO


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


def command_name() -> str:
    """How this run was started: `python -m bench`, `python -m bench.gpu_bench`, ..."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return Path(sys.argv[0]).name


def environment(threads: int, device: str = "cpu") -> dict:
    """The CPU, the cores this process may use, the date, the versions measured and the
    commit; with `device` cuda, the GPU and its driver too."""
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
           "command": " ".join([command_name(), *sys.argv[1:]])}
    if device == "cuda":
        out |= _gpu()
    return out


def machine(environment: dict) -> str:
    """What a table is headed and a docs section keyed by: the GPU where the run used one,
    the CPU and the cores it used."""
    cpu = f"{environment['cpu']}, {environment['cores']} cores"
    if environment.get("device") == "cuda":
        return f"{environment['gpu']} (driver {environment['driver']}), {cpu}"
    return cpu
