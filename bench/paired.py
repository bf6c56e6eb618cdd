"""The raw sessions and attnserve, measured in alternating blocks.

Raw workers (`python -m bench.phases worker`, onnxruntime only, one process each: the
server's own backend, onnxruntime at its default options, and the int8 backend when the
artifact has int8 graphs) and the servers (`attnserve serve`, fp32 and int8) are all up;
this process drives one at a time, never two at once: for each shape, a block of calls to
each raw session, a block to each served API (gRPC, HTTP /v1/embeddings, gRPC int8), and
again, for a few rounds (the order flips every round). Whatever else the machine is doing
then weighs on every side alike, which a raw phase followed by a server phase cannot
promise on a shared machine.
"""

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from attnserve.client import EncoderClient
from bench.measure import shape_row, time_calls, workload_row
from bench.serving import (
    HttpEmbedder,
    Measured,
    bench_server,
    measure_attention,
    run_callers,
)
from bench.workloads import Workload
from tests.harness import REPO, ServerProcess

log = logging.getLogger("bench.paired")

CONCURRENCY = (1, 8, 64)
WORKERS = 2
"""the front ends of the server measured beside the one-process server"""
IDLE_S = 1.0


class RawWorker:
    def __init__(self, spec_path: Path, log_path: Path):
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.phases", "worker", str(spec_path)], cwd=REPO,
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


def _worker(spec_path: Path, work: Path, engine: str) -> RawWorker:
    path = work / f"worker-{engine}.spec.json"
    path.write_text(json.dumps({**json.loads(spec_path.read_text()), "engine": engine}))
    return RawWorker(path, work / f"raw-worker-{engine}.log")


def run_paired(artifact: Path, workload: Workload, spec_path: Path, work: Path,
               server_extra: list[str], threads: int, num_layers: int, quick: bool,
               reps: dict, model_name: str, int8: bool) -> tuple[dict, dict]:
    rounds, block_s = (2, 0.5) if quick else (3, 1.5)
    workers: dict[str, RawWorker] = {}
    servers: dict[str, ServerProcess] = {}
    try:
        plain = json.loads(spec_path.read_text()).get("plain_graph")
        for engine in ("server", "default", *(("plain",) if plain else ()),
                       *(("int8",) if int8 else ())):
            workers[engine] = _worker(spec_path, work, engine)
        worker = workers["server"]
        raw: dict = {**worker.info, "default_graph": workers["default"].info["graph"],
                     "shapes": {}, "plain_shapes": {}, "default_shapes": {},
                     "default_texts_shapes": {}, "int8_shapes": {},
                     "rounds": rounds}
        # The server's backend on each fp32 graph: the one it serves, and the unfused one
        # where that is another file.
        graphs = {"opt": worker}
        if "plain" in workers and workers["plain"].info["graph"] != worker.info["graph"]:
            graphs["plain"] = workers["plain"]
            raw["plain_graph"] = workers["plain"].info["graph"]
        servers["fp32"] = server = bench_server(artifact, work / "server.log", server_extra,
                                                threads)
        if int8:
            servers["int8"] = bench_server(artifact, work / "server-int8.log",
                                           [*server_extra, "--precision", "int8"], threads)
        servers["workers"] = bench_server(artifact, work / "server-workers.log",
                                          [*server_extra, "--workers", str(WORKERS)], threads)
        grpc_out: dict = {"args": server.args[2:], "idle_rss_bytes": server.status()["rss"],
                          "shapes": {}, "http_shapes": {}, "int8_shapes": {},
                          "workers_shapes": {}, "concurrency": {}, "rounds": rounds,
                          "workers": WORKERS}
        clients = {name: EncoderClient(s.address) for name, s in servers.items()}
        http = HttpEmbedder(server, model_name)
        try:
            for shape in workload.shapes:
                _shape(shape, workers, graphs, clients, http, server, rounds, block_s, raw,
                       grpc_out)
        finally:
            http.close()
            for client in clients.values():
                client.close()
        _mixed(workers, server, workload, graphs, rounds, raw, grpc_out)
        _short(workers, server, servers["workers"], workload, rounds, raw, grpc_out)
        raw["attention"] = worker.call("attention", quick=quick)
        grpc_out["attention"] = measure_attention(server, workload, reps["attention"], num_layers)
        grpc_out["final_rss_bytes"] = server.status()["rss"]
    finally:
        for s in servers.values():
            s.stop()
        for w in workers.values():
            w.close()
    return raw, grpc_out


def _shape(shape, workers: dict[str, RawWorker], graphs: dict, clients: dict,
           http: HttpEmbedder, server: ServerProcess, rounds: int, block_s: float, raw: dict,
           grpc_out: dict) -> None:
    """One fixed shape: every raw session and every served API, in alternating blocks."""
    texts = shape.inputs.texts
    worker = workers["server"]
    first = worker.call("shape", name=shape.name, calls=1, warmup=1)["seconds"][0]
    # key: (worker, tokenize)
    raw_sides = {key: (w, False) for key, w in graphs.items()}
    raw_sides |= {engine: (workers[engine], False) for engine in ("default", "int8")
                  if engine in workers}
    raw_sides["default_texts"] = (workers["default"], True)
    for key, (w, tokenize) in raw_sides.items():
        if key != "opt":
            w.call("shape", name=shape.name, calls=0, warmup=1, tokenize=tokenize)
    served_sides = {"grpc": lambda: clients["fp32"].embed(texts), "http": lambda: http.embed(texts),
                    "grpc_workers": lambda: clients["workers"].embed(texts)}
    if "int8" in clients:
        served_sides["grpc_int8"] = lambda: clients["int8"].embed(texts)
    rss_before = server.status()["rss"]
    for call in served_sides.values():
        call()
    calls = _block(first, block_s)
    samples: dict[str, list[float]] = {key: [] for key in [*raw_sides, *served_sides]}
    breakdowns = []
    for round_ in range(rounds):
        for side in _order(round_):
            if side == "raw":
                for key, (w, tokenize) in raw_sides.items():
                    samples[key] += w.call("shape", name=shape.name, calls=calls,
                                           tokenize=tokenize)["seconds"]
                continue
            for key, call in served_sides.items():
                if key == "grpc":  # the server's own breakdown, for the gRPC rows
                    with Measured(server) as m:
                        samples[key].extend(time_calls(call, calls))
                    breakdowns.append(m.summary())
                else:
                    samples[key].extend(time_calls(call, calls))
    rows = {key: shape_row(seconds, shape.batch, shape.seq) for key, seconds in samples.items()}
    for key, out in (("opt", raw["shapes"]), ("plain", raw["plain_shapes"]),
                     ("default", raw["default_shapes"]),
                     ("default_texts", raw["default_texts_shapes"]), ("int8", raw["int8_shapes"]),
                     ("grpc", grpc_out["shapes"]), ("http", grpc_out["http_shapes"]),
                     ("grpc_int8", grpc_out["int8_shapes"]),
                     ("grpc_workers", grpc_out["workers_shapes"])):
        if key in rows:
            out[shape.name] = rows[key]
    grpc_out["shapes"][shape.name]["server"] = Measured.merge(breakdowns)
    # What the fp32 server gives back once idle (its batch loop trims the heap then).
    time.sleep(IDLE_S)
    grpc_out["shapes"][shape.name].update(rss_before=rss_before,
                                          rss_after_idle=server.status()["rss"])
    log.info("phase=paired shape=%s %s", shape.name, " ".join(
        f"{key}_tokens_per_s={row['tokens_per_s']:.0f}" for key, row in rows.items()))


def _mixed(workers: dict[str, RawWorker], server: ServerProcess, workload: Workload,
           graphs: dict, rounds: int, raw: dict, grpc_out: dict) -> None:
    """Rounds of: the raw sessions on ideal batches (each graph, and onnxruntime at its
    defaults) and one text at a time, then the server with 1, 8 and 64 concurrent callers
    (order flipped every round)."""
    worker, default = workers["server"], workers["default"]
    texts, tokens = workload.mixed.texts, sum(workload.mixed.lengths)
    runs: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    breakdowns: dict[int, list[dict]] = {c: [] for c in CONCURRENCY}
    padded = 0
    for w in [*graphs.values(), default]:  # warm-up
        w.call("mixed", kind="ideal")
    asyncio.run(run_callers(server.address, texts[:64], 8))
    paired_ratios = []
    for round_ in range(rounds):
        for side in _order(round_):
            if side == "raw":
                ideal = [(f"ideal_{key}", w) for key, w in graphs.items()]
                for key, w in [*ideal, ("ideal_default", default)]:
                    r = w.call("mixed", kind="ideal")
                    runs.setdefault(key, []).append(r["run_seconds"])
                    latencies.setdefault(key, []).extend(r["latencies"])
                    padded = r["padded_tokens"]
                r = worker.call("mixed", kind="one")
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
    raw["default_mixed_ideal"] = workload_row(runs["ideal_default"], latencies["ideal_default"],
                                              tokens)
    raw["mixed_one"] = workload_row(runs["one"], latencies["one"], tokens)
    for count in CONCURRENCY:
        row = _callers_row(runs[f"callers_{count}"], latencies[f"callers_{count}"], tokens,
                           count, breakdowns[count])
        grpc_out["concurrency"][str(count)] = row
        log.info("phase=paired callers=%d tokens_per_s=%.0f padded_over_real=%.3f "
                 "mean_batch=%.1f", count, row["tokens_per_s"], row["padded_over_real"] or 0,
                 row["mean_batch_size"] or 0)
    grpc_out["concurrency"]["64"]["paired_ratios_to_raw_ideal"] = paired_ratios


def _short(workers: dict[str, RawWorker], server: ServerProcess, group: ServerProcess,
           workload: Workload, rounds: int, raw: dict, grpc_out: dict) -> None:
    """Short texts: the raw sessions on their ideal batches against 64 callers of one
    text each, on one connection; and 64 callers on a connection each, against the server
    and against the server of WORKERS front ends (order flipped every round)."""
    texts, tokens = workload.short.texts, sum(workload.short.lengths)
    sides = {"ideal": workers["server"], "ideal_default": workers["default"]}
    for w in sides.values():  # warm-up
        w.call("mixed", kind="ideal", texts="short")
    runs: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    breakdowns = []
    for round_ in range(rounds):
        for side in _order(round_):
            if side == "raw":
                for key, w in sides.items():
                    r = w.call("mixed", kind="ideal", texts="short")
                    runs.setdefault(key, []).append(r["run_seconds"])
                    latencies.setdefault(key, []).extend(r["latencies"])
                continue
            with Measured(server) as m:
                seconds, lat = asyncio.run(run_callers(server.address, texts, 64))
            breakdowns.append(m.summary())
            runs.setdefault("callers", []).append(seconds)
            latencies.setdefault("callers", []).extend(lat)
            for key, target in (("connections", server), ("workers", group)):
                seconds, lat = asyncio.run(run_callers(target.address, texts, 64, 64))
                runs.setdefault(key, []).append(seconds)
                latencies.setdefault(key, []).extend(lat)
    raw["short_ideal"] = workload_row(runs["ideal"], latencies["ideal"], tokens)
    raw["default_short_ideal"] = workload_row(runs["ideal_default"], latencies["ideal_default"],
                                              tokens)
    grpc_out["short_callers"] = row = _callers_row(runs["callers"], latencies["callers"], tokens,
                                                   64, breakdowns)
    for key in ("connections", "workers"):
        grpc_out[f"short_{key}"] = workload_row(runs[key], latencies[key], tokens)
    log.info("phase=paired short callers=64 tokens_per_s=%.0f raw_ideal=%.0f "
             "connections_tokens_per_s=%.0f workers_tokens_per_s=%.0f", row["tokens_per_s"],
             raw["short_ideal"]["tokens_per_s"], grpc_out["short_connections"]["tokens_per_s"],
             grpc_out["short_workers"]["tokens_per_s"])


def _callers_row(runs: list[float], latencies: list[float], tokens: int, callers: int,
                 breakdowns: list[dict]) -> dict:
    row = workload_row(runs, latencies, tokens)
    row["callers"] = callers
    row["server"] = s = Measured.merge(breakdowns)
    row["padded_over_real"] = s["padded_tokens"] / s["real_tokens"] if s["real_tokens"] else None
    row["mean_batch_size"] = s["sequences"] / s["batches"] if s["batches"] else None
    return row
