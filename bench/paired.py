"""The raw session and attnserve over gRPC, measured in alternating blocks.

A raw worker (`python -m bench.phases worker`, onnxruntime only) and the server
(`attnserve serve`) are both up; this process drives one at a time, never both at once:
for each shape, a block of calls to the raw session, a block to the server, and again, for
a few rounds (the order flips every round). Whatever else the machine is doing then
weighs on both sides alike, which a raw phase followed by a server phase cannot promise
on a shared machine.
"""

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

from attnserve.bench.harness import REPO, ServerProcess
from attnserve.bench.measure import shape_row, time_calls, workload_row
from attnserve.bench.serving import Measured, bench_server, measure_attention, run_callers
from attnserve.bench.workloads import Workload
from attnserve.server.client import EncoderClient

log = logging.getLogger("bench.paired")

CONCURRENCY = (1, 8, 64)


class RawWorker:
    def __init__(self, spec_path: Path, log_path: Path):
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve.bench.phases", "worker", str(spec_path)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"raw worker did not start; its log:\n{log_path.read_text()[-3000:]}")
        self.info = json.loads(line)["ready"]

    def call(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("raw worker died (see raw-worker.log)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _order(round_: int) -> tuple[str, str]:
    return ("raw", "served") if round_ % 2 == 0 else ("served", "raw")


def _block(first_call_s: float, block_s: float) -> int:
    return max(1, min(50, round(block_s / max(first_call_s, 1e-4))))


def run_paired(artifact: Path, workload: Workload, spec_path: Path, work: Path,
               server_extra: list[str], threads: int, num_layers: int, quick: bool,
               reps: dict) -> tuple[dict, dict]:
    rounds, block_s = (2, 0.5) if quick else (3, 1.5)
    worker = RawWorker(spec_path, work / "raw-worker.log")
    raw: dict = {**worker.info, "shapes": {}, "plain_shapes": {}, "rounds": rounds}
    graphs = ["opt"] + (["plain"] if "plain_graph" in worker.info else [])
    server = None
    try:
        server = bench_server(artifact, work / "server.log", server_extra, threads)
        grpc_out: dict = {"args": server.args[2:], "idle_rss_bytes": server.status()["rss"],
                          "shapes": {}, "concurrency": {}, "rounds": rounds}
        with EncoderClient(server.address) as client:
            for shape in workload.shapes:
                texts = shape.inputs.texts
                first = worker.call("shape", name=shape.name, graph="opt", calls=1,
                                    warmup=1)["seconds"][0]
                for graph in graphs[1:]:
                    worker.call("shape", name=shape.name, graph=graph, calls=0, warmup=1)
                client.embed(texts)
                calls = _block(first, block_s)
                samples: dict[str, list[float]] = {g: [] for g in graphs}
                served: list[float] = []
                breakdowns = []
                for round_ in range(rounds):
                    for side in _order(round_):
                        if side == "raw":
                            for graph in graphs:
                                samples[graph] += worker.call("shape", name=shape.name,
                                                              graph=graph, calls=calls)["seconds"]
                        else:
                            with Measured(server) as m:
                                served.extend(time_calls(
                                    lambda texts=texts: client.embed(texts), calls))
                            breakdowns.append(m.summary())
                raw["shapes"][shape.name] = shape_row(samples["opt"], shape.batch, shape.seq)
                if "plain" in samples:
                    raw["plain_shapes"][shape.name] = shape_row(samples["plain"], shape.batch,
                                                                shape.seq)
                row = shape_row(served, shape.batch, shape.seq)
                row["server"] = Measured.merge(breakdowns)
                grpc_out["shapes"][shape.name] = row
                log.info("phase=paired shape=%s raw_tokens_per_s=%.0f grpc_tokens_per_s=%.0f "
                         "ratio=%.2f", shape.name, raw["shapes"][shape.name]["tokens_per_s"],
                         row["tokens_per_s"],
                         row["tokens_per_s"] / raw["shapes"][shape.name]["tokens_per_s"])
        _mixed(worker, server, workload, graphs, rounds, raw, grpc_out)
        raw["attention"] = worker.call("attention", quick=quick)
        grpc_out["attention"] = measure_attention(server, workload, reps["attention"], num_layers)
        grpc_out["final_rss_bytes"] = server.status()["rss"]
    finally:
        if server is not None:
            server.stop()
        worker.close()
    return raw, grpc_out


def _mixed(worker: RawWorker, server: ServerProcess, workload: Workload, graphs: list[str],
           rounds: int, raw: dict, grpc_out: dict) -> None:
    """Rounds of: the raw session on ideal batches (each graph) and one text at a time,
    then the server with 1, 8 and 64 concurrent callers (order flipped every round)."""
    texts, tokens = workload.mixed.texts, sum(workload.mixed.lengths)
    runs: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    breakdowns: dict[int, list[dict]] = {c: [] for c in CONCURRENCY}
    padded = 0
    worker.call("mixed", kind="ideal", graph="opt")  # warm-up
    asyncio.run(run_callers(server.address, texts[:64], 8))
    paired_ratios = []
    for round_ in range(rounds):
        for side in _order(round_):
            if side == "raw":
                for graph in graphs:
                    r = worker.call("mixed", kind="ideal", graph=graph)
                    runs.setdefault(f"ideal_{graph}", []).append(r["run_seconds"])
                    latencies.setdefault(f"ideal_{graph}", []).extend(r["latencies"])
                    padded = r["padded_tokens"]
                r = worker.call("mixed", kind="one", graph="opt")
                runs.setdefault("one", []).append(r["run_seconds"])
                latencies.setdefault("one", []).extend(r["latencies"])
                continue
            for count in CONCURRENCY:
                with Measured(server) as m:
                    seconds, lat = asyncio.run(run_callers(server.address, texts, count))
                breakdowns[count].append(m.summary())
                runs.setdefault(f"callers_{count}", []).append(seconds)
                latencies.setdefault(f"callers_{count}", []).extend(lat)
        paired_ratios.append(runs["ideal_opt"][-1] / runs["callers_64"][-1])
    raw["mixed_ideal"] = workload_row(runs["ideal_opt"], latencies["ideal_opt"], tokens)
    raw["mixed_ideal"]["padded_tokens"] = padded
    if "ideal_plain" in runs:
        raw["plain_mixed_ideal"] = workload_row(runs["ideal_plain"], latencies["ideal_plain"],
                                                tokens)
    raw["mixed_one"] = workload_row(runs["one"], latencies["one"], tokens)
    for count in CONCURRENCY:
        row = workload_row(runs[f"callers_{count}"], latencies[f"callers_{count}"], tokens)
        row["callers"] = count
        row["server"] = s = Measured.merge(breakdowns[count])
        row["padded_over_real"] = s["padded_tokens"] / s["real_tokens"] if s["real_tokens"] else None
        row["mean_batch_size"] = s["sequences"] / s["batches"] if s["batches"] else None
        grpc_out["concurrency"][str(count)] = row
        log.info("phase=paired callers=%d tokens_per_s=%.0f padded_over_real=%.3f "
                 "mean_batch=%.1f", count, row["tokens_per_s"], row["padded_over_real"] or 0,
                 row["mean_batch_size"] or 0)
    grpc_out["concurrency"]["64"]["paired_ratios_to_raw_ideal"] = paired_ratios
