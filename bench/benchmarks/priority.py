"""`python -m bench priority`: an interactive caller beside bulk callers, with priority
classes and without."""

import importlib.util
import logging
import os
import time
from pathlib import Path

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import load
from bench.load import Callers, Grpc
from bench.measure import latency_summary, median_of
from bench.plot import figure
from bench.report import docs_section, slug, table, update_page
from bench.runner import DEFAULT_ARTIFACT, Result, benchmark, environment, machine, option
from bench.workloads import IDS_1X16
from tests.harness import ServerProcess

log = logging.getLogger("bench.priority")

BULK_CALLERS, BULK_BATCH, BULK_SEQ = 4, 32, 256
PACE_S = 0.05
"""the interactive caller starts a call every 50 ms"""
# The goals: interactive p99 with priority within 3× its p99 alone; bulk tokens/s
# with priority at least 85 % of its tokens/s with priority off.
P99_GOAL, THROUGHPUT_GOAL = 3.0, 0.85
RUNS = {"alone": "interactive alone", "priority": "with priority (bulk callers send bulk)",
        "off": "priority off (one class: the bulk callers name none)"}
# Where this benchmark's runs go in docs/benchmarks.md: below this line, newest first.
DOCS_MARKER = ("<!-- python -m bench: runs written by `python -m bench priority --docs` follow, "
               "newest first -->")


@benchmark(
    "priority",
    option("--artifact", type=Path, default=DEFAULT_ARTIFACT,
           help="artifact directory (attnserve export --out DIR)"),
    option("--seconds", type=float, default=20.0, help="of each run (quick: 3)"),
    option("--rounds", type=int, default=3,
           help="of the three runs, one after another (quick: 1); medians are reported"),
    option("--docs", type=Path, default=None, metavar="PAGE",
           help="write this run's table, dated and headed by the machine, into PAGE "
                "(docs/benchmarks.md) in place of the same machine's earlier run, and its plot "
                "beside PAGE; a full run only"),
)
def priority(args) -> Result:
    """An interactive caller beside bulk callers: its latency and their throughput, with
    priority classes and without.

    One `attnserve serve` on the CPU. An interactive caller starts an Embed of one 16-token
    sequence every 50 ms, naming no class (interactive, the default); 4 bulk callers send
    Embed of 32×256 token ids back to back. Three runs, in rounds: the interactive caller
    alone; beside the bulk callers sending `x-priority: bulk`; beside the same callers
    naming no class, so every call is of one class, served in arrival order (priority off).
    It prints the interactive p50 and p99 and the bulk tokens/s of each, the medians of
    the rounds, and the issue's goals: interactive p99 with priority within 3× alone, bulk
    tokens/s with priority at least 85 % of priority off."""
    if args.docs and args.quick:
        raise SystemExit("python -m bench priority: --docs records a full run's figures; drop --quick")
    seconds, rounds = (3.0, 1) if args.quick else (args.seconds, args.rounds)
    started = time.perf_counter()
    interactive_request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS_1X16)])
    bulk_ids = [101, *range(2000, 2000 + BULK_SEQ - 2), 102]
    bulk_request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=bulk_ids)] * BULK_BATCH)
    rows = []
    with ServerProcess(args.artifact, *args.server_arg,
                       log_path=args.out_dir / "serve.log") as server, \
            load.client_pool(2) as pool:
        interactive = Callers(Grpc(server.address), [interactive_request], seconds=seconds,
                              pace_s=PACE_S)

        def bulk(*metadata: tuple[str, str]) -> Callers:
            return Callers(Grpc(server.address, channels=BULK_CALLERS, metadata=metadata),
                           [bulk_request], BULK_CALLERS, seconds=seconds)

        # Untimed: each shape runs once. The runs then start their callers together,
        # connections and all (a warm-up call of 32×256 each would run as uncut batches
        # just before the interactive caller starts, and count as the wait of its first
        # calls).
        load.run(Callers(Grpc(server.address), [interactive_request, bulk_request]), pool=pool)
        for round_ in range(rounds):
            row = {}
            (alone,) = load.run(interactive, warm=False, pool=pool)
            row["alone"] = {"interactive": latency_summary(alone.latencies)}
            for name, metadata in (("priority", (("x-priority", "bulk"),)), ("off", ())):
                bulk_run, beside = load.run(bulk(*metadata), interactive, warm=False, pool=pool)
                row[name] = {"interactive": latency_summary(beside.latencies),
                             "bulk_calls": len(bulk_run.latencies),
                             "bulk_tokens_per_s": len(bulk_run.latencies) * BULK_BATCH * BULK_SEQ
                             / bulk_run.seconds}
            log.info("event=round_done round=%d", round_)
            rows.append(row)
    result = summarize(rows)
    # The server's onnxruntime runs on every core this process may use (its default).
    result.update(environment=environment(len(os.sched_getaffinity(0))), seconds_each=seconds,
                  rounds=rows, seconds=time.perf_counter() - started)
    text = markdown(result)

    def draw(path: Path) -> None:
        plot(result, path)

    if args.docs:
        write_docs(args.docs, result)
    return Result(text, result, draw)


def summarize(rows: list[dict]) -> dict:
    """The medians over the rounds, and the goals met."""
    out = {name: {"p50_ms": median_of(rows, name, "interactive", "p50_ms"),
                  "p99_ms": median_of(rows, name, "interactive", "p99_ms")} for name in RUNS}
    for name in ("priority", "off"):
        out[name]["bulk_tokens_per_s"] = median_of(rows, name, "bulk_tokens_per_s")
    p99_ratio = out["priority"]["p99_ms"] / out["alone"]["p99_ms"]
    off = out["off"]["bulk_tokens_per_s"]
    throughput_ratio = out["priority"]["bulk_tokens_per_s"] / off if off else 0.0
    out["goals"] = {"p99_ratio": p99_ratio, "p99_met": p99_ratio <= P99_GOAL,
                    "throughput_ratio": throughput_ratio,
                    "throughput_met": throughput_ratio >= THROUGHPUT_GOAL}
    return out


def markdown(result: dict) -> str:
    rows = []
    for name, label in RUNS.items():
        run = result[name]
        tokens = run.get("bulk_tokens_per_s")
        rows.append([label, f"{run['p50_ms']:.1f}", f"{run['p99_ms']:.1f}",
                     "-" if tokens is None else f"{tokens:,.0f}"])
    goals = result["goals"]
    return "\n".join([
        f"Interactive: Embed 1×16 every {PACE_S * 1e3:.0f} ms from one caller; bulk: "
        f"{BULK_CALLERS} callers of Embed {BULK_BATCH}×{BULK_SEQ} back to back; "
        f"{result['seconds_each']:g} s a run, medians of {len(result['rounds'])} rounds", "",
        table(["run", "interactive p50 ms", "interactive p99 ms", "bulk tokens/s"], rows), "",
        table(["goal", "measured", "met"], [
            [f"interactive p99 with priority ≤ {P99_GOAL:g}× alone",
             f"{goals['p99_ratio']:.2f}×", "yes" if goals["p99_met"] else "no"],
            [f"bulk tokens/s with priority ≥ {THROUGHPUT_GOAL:.0%} of priority off",
             f"{goals['throughput_ratio']:.0%}", "yes" if goals["throughput_met"] else "no"]])])


def plot(result: dict, path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 4)) as (_, (latency, throughput)):
        names = list(RUNS)
        for offset, key, color in ((-0.2, "p50_ms", "tab:blue"), (0.2, "p99_ms", "tab:orange")):
            latency.bar([i + offset for i in range(len(names))], [result[n][key] for n in names],
                        width=0.4, color=color, label=key.removesuffix("_ms"))
        latency.set_xticks(range(len(names)), names)
        latency.set_yscale("log")
        latency.set_ylabel("interactive Embed 1×16 latency, ms")
        latency.legend()
        beside = ["priority", "off"]
        throughput.bar(beside, [result[n]["bulk_tokens_per_s"] for n in beside], color="tab:green")
        throughput.set_ylabel(f"bulk tokens/s ({BULK_CALLERS} callers, {BULK_BATCH}×{BULK_SEQ})")


def write_docs(page: Path, result: dict) -> None:
    """The run's section of `page` (docs/benchmarks.md), below DOCS_MARKER, and its plot
    beside the page."""
    key = f"priority, {machine(result['environment'])}"
    plot_file = None
    if importlib.util.find_spec("matplotlib"):
        plot_file = f"bench-{slug(key)}.png"
        plot(result, page.parent / plot_file)
    key, section = docs_section(result, markdown(result), plot_file, key)
    page.write_text(update_page(page.read_text(), key, section, DOCS_MARKER))
    log.info("event=docs_written page=%s machine=%r", page, key)
