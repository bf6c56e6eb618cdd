"""`python -m bench.fairness`: two models in one server, one of them flooded. Does a
caller of the other keep its latency?

One `attnserve serve` holds model A (MiniLM by default) and model B (the tests' tiny
model, exported once, by default). A caller of B sends Embed of one 16-token sequence
back to back, first alone, then while 32 callers of A (h2load when it is installed, else
grpc.aio callers in 4 processes) keep A saturated with the same request, in alternating
rounds. It prints B's p50 and p99 each way and their ratio, A's rate under the flood, and
how long A's batches took (the wait a batch of B would have behind one of A's were the two
models to share one inference thread), writes fairness.json and fairness.png under
bench/results/fairness/, and asserts nothing.
"""

import argparse
import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench.machine import environment, machine
from bench.measure import latency_summary, time_calls
from bench.workers import PYTHON_CALLERS, tiny_artifact
from tests.harness import REPO, ServerProcess, sample

RESULTS = REPO / "bench" / "results" / "fairness"
DEFAULT_A = REPO / "artifacts" / "all-MiniLM-L6-v2"
IDS = [101, *range(2000, 2014), 102]
FLOOD_CALLERS = 32
PYTHON_PROCESSES = 4
B = "b"


def flood(server: ServerProcess, seconds: float, body: Path, client: str) -> subprocess.Popen | list:
    """32 callers of the default model (A) for `seconds`, started in the background."""
    if client == "h2load":
        return subprocess.Popen(
            ["h2load", "-D", str(round(seconds)), "-c", str(FLOOD_CALLERS), "-m", "1", "-t", "1",
             "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
             f"http://{server.address}/attnserve.v1.EncoderService/Embed"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    per = FLOOD_CALLERS // PYTHON_PROCESSES
    return [subprocess.Popen([sys.executable, "-c", PYTHON_CALLERS, server.address, str(per),
                              str(seconds), repr(IDS)], stdout=subprocess.PIPE, text=True)
            for _ in range(PYTHON_PROCESSES)]


def wait(load) -> None:
    for process in load if isinstance(load, list) else [load]:
        process.communicate(timeout=600)


def a_calls(server: ServerProcess, model: str) -> float:
    return sample(server.scrape(), "attnserve_requests_total", rpc="Embed", code="OK", model=model)


def round_(server: ServerProcess, a: str, calls: int, seconds: float, body: Path,
           client: str) -> dict:
    with EncoderClient(server.address) as caller:
        def call():
            caller.embed(token_ids=[IDS], model=B)
        alone = time_calls(call, calls)
        before, calls_before = server.scrape(), a_calls(server, a)
        load = flood(server, seconds, body, client)
        time.sleep(1.0)  # every flooding caller connected and calling
        flooded = time_calls(call, calls)
        wait(load)
        after = server.scrape()
    batches = (sample(after, "attnserve_inference_duration_seconds_count", model=a)
               - sample(before, "attnserve_inference_duration_seconds_count", model=a))
    spent = (sample(after, "attnserve_inference_duration_seconds_sum", model=a)
             - sample(before, "attnserve_inference_duration_seconds_sum", model=a))
    return {"alone": latency_summary(alone), "flooded": latency_summary(flooded),
            "a_requests_per_s": (a_calls(server, a) - calls_before) / seconds,
            "a_batch_ms": 1e3 * spent / max(batches, 1),
            "a_sequences_per_batch": (sample(after, "attnserve_batch_size_sum", model=a)
                                      - sample(before, "attnserve_batch_size_sum", model=a))
            / max(batches, 1)}


def table(rows: list[dict], a: str, client: str) -> str:
    def median(path: tuple[str, ...]) -> float:
        values = []
        for row in rows:
            value = row
            for key in path:
                value = value[key]
            values.append(value)
        return float(np.median(values))

    alone, flooded = median(("alone", "p50_ms")), median(("flooded", "p50_ms"))
    return "\n".join([
        f"B ({B}): Embed 1×16 from one caller; A ({a}): {FLOOD_CALLERS} callers ({client}) of "
        f"Embed 1×16; medians of {len(rows)} rounds", "",
        "| B's caller | p50 ms | p99 ms |", "| --- | ---: | ---: |",
        f"| alone | {alone:.2f} | {median(('alone', 'p99_ms')):.2f} |",
        f"| A flooded | {flooded:.2f} | {median(('flooded', 'p99_ms')):.2f} |",
        f"| ratio | {flooded / alone:.2f} | "
        f"{median(('flooded', 'p99_ms')) / median(('alone', 'p99_ms')):.2f} |", "",
        f"A under the flood: {median(('a_requests_per_s',)):.0f} requests/s, batches of "
        f"{median(('a_sequences_per_batch',)):.1f} sequences taking {median(('a_batch_ms',)):.1f} ms "
        "each"])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, kind in enumerate(("alone", "flooded")):
        for key, marker in (("p50_ms", "o"), ("p99_ms", "^")):
            ax.scatter([i] * len(rows), [r[kind][key] for r in rows], marker=marker,
                       color="tab:blue" if key == "p50_ms" else "tab:orange",
                       label=key.replace("_ms", "") if i == 0 else None)
    ax.set_xticks([0, 1], ["B alone", "B while A is flooded"])
    ax.set_ylabel("B's Embed latency, ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact-a", type=Path, default=DEFAULT_A, help="the flooded model")
    p.add_argument("--artifact-b", type=Path, default=None,
                   help="the other (default: the tests' tiny model, exported once)")
    p.add_argument("--calls", type=int, default=300, help="B's calls each way, each round")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="of flood each round (B's flooded calls must end within it)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--client", choices=("auto", "h2load", "python"), default="auto")
    p.add_argument("--server-arg", action="append", default=[],
                   help="a flag for attnserve serve (repeatable), e.g. --server-arg=--workers=2")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    b = args.artifact_b or tiny_artifact(args.out_dir / "tiny-artifact")
    client = args.client if args.client != "auto" else (
        "h2load" if shutil.which("h2load") else "python")
    message = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS)]).SerializeToString()
    body = args.out_dir / "embed.grpc"
    body.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    rows = []
    with ServerProcess(args.artifact_a, "--artifact", f"{B}={b}", *args.server_arg) as server:
        with EncoderClient(server.address) as probe:
            a = probe.list_models()[0].model
        for n in range(args.rounds):
            rows.append(round_(server, a, args.calls, args.seconds, body, client))
            print(f"round {n + 1}: B p50 {rows[-1]['alone']['p50_ms']:.2f} ms alone, "
                  f"{rows[-1]['flooded']['p50_ms']:.2f} ms flooded", file=sys.stderr)
    env = environment(threads=0)
    heading = f"{machine(env)}, {env['date']}"
    text = table(rows, a, client)
    (args.out_dir / "fairness.json").write_text(json.dumps(
        {"machine": heading, "client": client, "server_args": args.server_arg, "rows": rows},
        indent=1))
    plot(rows, args.out_dir / "fairness.png")
    print(f"{heading}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
