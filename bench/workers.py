"""`python -m bench.workers`: what front-end processes buy, and what the hop
between a front end and the engine costs.

A front-end-bound load: Embed of one 16-token sequence from 64 callers, each on a
connection of its own (SO_REUSEPORT spreads connections, not calls, over the front ends),
against `attnserve serve --workers N` for each N asked, in alternating rounds on one
machine. The callers are h2load (nghttp2's load generator, sending gRPC's framing as
plain HTTP/2: a few microseconds of client CPU a call, so the clients leave the cores to
the server) when it is installed, else grpc.aio callers in 4 processes. Beside it: one
caller's latency (the hop's cost in time), and the server's CPU per call (its cost in
work, every process of the group counted).

Prints a table, writes JSON and a plot under bench/results/workers/. Asserts nothing.
"""

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench.machine import environment, machine
from bench.measure import latency_summary, time_calls
from tests.harness import ServerProcess, make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "workers"
IDS = [101, *range(2000, 2014), 102]
CALLERS = 64
PYTHON_CLIENT_PROCESSES = 4

PYTHON_CALLERS = """
import asyncio, sys, time
import grpc
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb, encoder_pb2_grpc as pbg

address, callers, seconds, ids = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), eval(sys.argv[4])
request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=ids)])

async def main():
    channels = [grpc.aio.insecure_channel(address) for _ in range(callers)]
    stubs = [pbg.EncoderServiceStub(c) for c in channels]
    await asyncio.gather(*(s.Embed(request) for s in stubs))
    stop = time.monotonic() + seconds

    async def caller(stub):
        n = 0
        while time.monotonic() < stop:
            await stub.Embed(request)
            n += 1
        return n
    done = sum(await asyncio.gather(*(caller(s) for s in stubs)))
    for c in channels:
        await c.close()
    print(done)

asyncio.run(main())
"""


def tiny_artifact(directory: Path) -> Path:
    """The tests' tiny model (harness.make_tiny_checkpoint), exported: so cheap to run
    that the front end, not the model, decides the rate."""
    if (directory / "manifest.json").is_file():
        return directory
    checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tiny-checkpoint-")))
    subprocess.run([sys.executable, "-m", "attnserve", "export", "--out", str(directory),
                    "--from", str(checkpoint)], check=True, cwd=REPO, capture_output=True)
    shutil.rmtree(checkpoint)
    return directory


def h2load_rate(server: ServerProcess, seconds: float, body: Path) -> float:
    out = subprocess.run(
        ["h2load", "-D", str(round(seconds)), "-c", str(CALLERS), "-m", "1", "-t", "1", "-d", str(body),
         "-H", "content-type: application/grpc", "-H", "te: trailers",
         f"http://{server.address}/attnserve.v1.EncoderService/Embed"],
        capture_output=True, text=True, timeout=seconds + 60)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", out.stdout)
    if not done:
        raise RuntimeError(f"h2load said:\n{out.stdout}\n{out.stderr}")
    return int(done.group(2)) / seconds


def python_rate(server: ServerProcess, seconds: float) -> float:
    per = CALLERS // PYTHON_CLIENT_PROCESSES
    runs = [subprocess.Popen([sys.executable, "-c", PYTHON_CALLERS, server.address, str(per),
                              str(seconds), repr(IDS)], stdout=subprocess.PIPE, text=True)
            for _ in range(PYTHON_CLIENT_PROCESSES)]
    return sum(int(run.communicate(timeout=seconds + 60)[0]) for run in runs) / seconds


def measure(artifact: Path, workers: int, seconds: float, client: str, body: Path) -> dict:
    with ServerProcess(artifact, "--workers", str(workers)) as server:
        with EncoderClient(server.address) as one:
            latencies = time_calls(lambda: one.embed(token_ids=[IDS]), 300)
        calls_before = sample_calls(server)
        cpu_before = server.status()["cpu_s"]
        rate = h2load_rate(server, seconds, body) if client == "h2load" else python_rate(server, seconds)
        cpu = server.status()["cpu_s"] - cpu_before
        calls = sample_calls(server) - calls_before
    return {"workers": workers, "requests_per_s": rate,
            "server_cpu_ms_per_call": 1e3 * cpu / max(calls, 1),
            "one_caller": latency_summary(latencies)}


def sample_calls(server: ServerProcess) -> float:
    from tests.harness import sample

    return sample(server.scrape(), "attnserve_requests_total", rpc="Embed", code="OK")


def table(rows: dict[int, list[dict]], client: str, base: int) -> str:
    lines = [f"Embed 1×16 (token ids), {CALLERS} callers ({client}), each on its own "
             "connection; medians of the rounds", "",
             "| --workers | requests/s | × --workers " + str(base) + " | one caller p50 ms | "
             "one caller p99 ms | server CPU ms/call |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    base_rate = float(np.median([r["requests_per_s"] for r in rows[base]]))
    for workers, runs in rows.items():
        rate = float(np.median([r["requests_per_s"] for r in runs]))
        lines.append(
            f"| {workers} | {rate:.0f} | {rate / base_rate:.2f} | "
            f"{np.median([r['one_caller']['p50_ms'] for r in runs]):.2f} | "
            f"{np.median([r['one_caller']['p99_ms'] for r in runs]):.2f} | "
            f"{np.median([r['server_cpu_ms_per_call'] for r in runs]):.2f} |")
    return "\n".join(lines)


def plot(rows: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for workers, runs in rows.items():
        ax.scatter([workers] * len(runs), [r["requests_per_s"] for r in runs], color="tab:blue")
    ax.plot(list(rows), [np.median([r["requests_per_s"] for r in runs]) for runs in rows.values()],
            color="tab:blue", label="median of the rounds")
    ax.set_xlabel("--workers")
    ax.set_ylabel("Embed 1×16 requests/s")
    ax.set_xticks(list(rows))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, default=None,
                   help="artifact to serve (default: the tests' tiny model, exported once)")
    p.add_argument("--workers", default="1,2", help="comma-separated --workers to compare")
    p.add_argument("--seconds", type=float, default=10.0, help="of load per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--client", choices=("auto", "h2load", "python"), default="auto")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact or tiny_artifact(args.out_dir / "tiny-artifact")
    client = args.client if args.client != "auto" else (
        "h2load" if shutil.which("h2load") else "python")
    message = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS)]).SerializeToString()
    body = args.out_dir / "embed.grpc"
    body.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    counts = [int(n) for n in args.workers.split(",")]
    rows: dict[int, list[dict]] = {n: [] for n in counts}
    for round_ in range(args.rounds):
        for workers in counts if round_ % 2 == 0 else counts[::-1]:
            row = measure(artifact, workers, args.seconds, client, body)
            rows[workers].append(row)
            print(f"round {round_ + 1}: --workers {workers}: {row['requests_per_s']:.0f} "
                  f"requests/s", file=sys.stderr)
    text = table(rows, client, counts[0])
    env = environment(threads=0)  # the servers' default: every core
    heading = f"{machine(env)}, {env['date']}"
    (args.out_dir / "workers.json").write_text(json.dumps(
        {"machine": heading, "client": client, "rows": rows}, indent=1))
    try:
        plot(rows, args.out_dir / "workers.png")
    except ImportError:
        pass
    print(f"{heading}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
