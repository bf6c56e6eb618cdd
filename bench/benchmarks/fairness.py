"""`python -m bench fairness`: two models in one server, one of them flooded."""

import time
from pathlib import Path

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import load
from bench.load import Callers, Grpc
from bench.measure import latency_summary, median_of
from bench.plot import figure
from bench.report import table
from bench.runner import DEFAULT_ARTIFACT, Result, benchmark, option
from bench.served import answered, tiny_artifact
from bench.workloads import IDS_1X16
from tests.harness import ServerProcess, delta

FLOOD_CALLERS = 32
FLOOD_PROCESSES = 4
B = "b"


@benchmark(
    "fairness",
    option("--artifact-a", type=Path, default=DEFAULT_ARTIFACT, help="the flooded model"),
    option("--artifact-b", type=Path, default=None,
           help="the other (default: the tests' tiny model, exported once)"),
    option("--calls", type=int, default=300, help="B's calls each way, each round"),
    option("--seconds", type=float, default=10.0,
           help="of flood each round (B's flooded calls must end within it)"),
    option("--rounds", type=int, default=3),
    option("--client", choices=("auto", "h2load", "python"), default="auto",
           help="A's 32 callers: h2load, or ours in client processes (auto: h2load where installed)"),
)
def fairness(args) -> Result:
    """Two models in one server, one of them flooded: does a caller of the other keep its latency?

    One `attnserve serve` holds model A (MiniLM by default) and model B (the tests' tiny
    model by default). A caller of B sends Embed of one 16-token sequence back to back, first
    alone, then while 32 callers of A (h2load where it is installed, else ours in 4 client
    processes) keep A saturated with the same request, in rounds. It prints B's p50 and p99
    each way and their ratio, A's rate under the flood, and how long A's batches took (the
    wait a batch of B would have behind one of A's were the two models to share one
    inference thread)."""
    calls, seconds, rounds = (50, 3.0, 1) if args.quick else (args.calls, args.seconds, args.rounds)
    b = args.artifact_b or tiny_artifact(args.out_dir / "tiny-artifact")
    client = load.flood_client(args.client)
    request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS_1X16)])
    rows = []
    with ServerProcess(args.artifact_a, "--artifact", f"{B}={b}", *args.server_arg) as server, \
            load.client_pool(FLOOD_PROCESSES + 1) as pool:
        with EncoderClient(server.address) as probe:
            a = probe.list_models()[0].model
        b_caller = Callers(Grpc(server.address),
                           [pb.EmbedRequest(token_ids=request.token_ids, model=B)] * calls)
        flood = Callers(Grpc(server.address, channels=FLOOD_CALLERS), [request], FLOOD_CALLERS,
                        seconds=seconds, processes=FLOOD_PROCESSES)
        for _ in range(rounds):
            (alone,) = load.run(b_caller, pool=pool)
            before, a_before = server.scrape(), answered(server, model=a)
            if client == "h2load":
                flooding = load.h2load(server.address, request, FLOOD_CALLERS, seconds,
                                       args.out_dir / "embed.grpc")
                time.sleep(1.0)  # every flooding caller connected and calling
                (flooded,) = load.run(b_caller, pool=pool)
                load.h2load_calls(flooding, seconds + 60)
            else:
                _, flooded = load.run(flood, b_caller, pool=pool)
            after = server.scrape()
            batches = max(delta(before, after, "attnserve_inference_duration_seconds_count", model=a), 1)
            rows.append({
                "alone": latency_summary(alone.latencies), "flooded": latency_summary(flooded.latencies),
                "a_requests_per_s": (answered(server, model=a) - a_before) / seconds,
                "a_batch_ms": 1e3 * delta(before, after, "attnserve_inference_duration_seconds_sum", model=a)
                / batches,
                "a_sequences_per_batch": delta(before, after, "attnserve_batch_size_sum", model=a) / batches})
    p50, p99 = (median_of(rows, "alone", k) for k in ("p50_ms", "p99_ms"))
    f50, f99 = (median_of(rows, "flooded", k) for k in ("p50_ms", "p99_ms"))
    text = "\n".join([
        f"B ({B}): Embed 1×16 from one caller; A ({a}): {FLOOD_CALLERS} callers ({client}) of "
        f"Embed 1×16; medians of {len(rows)} rounds", "",
        table(["B's caller", "p50 ms", "p99 ms"], [["alone", f"{p50:.2f}", f"{p99:.2f}"],
                                                   ["while A is flooded", f"{f50:.2f}", f"{f99:.2f}"],
                                                   ["ratio", f"{f50 / p50:.2f}", f"{f99 / p99:.2f}"]]), "",
        f"A under the flood: {median_of(rows, 'a_requests_per_s'):.0f} requests/s, batches of "
        f"{median_of(rows, 'a_sequences_per_batch'):.1f} sequences taking "
        f"{median_of(rows, 'a_batch_ms'):.1f} ms each"])

    def draw(path: Path) -> None:
        with figure(path, figsize=(6, 4)) as (_, ax):
            for i, kind in enumerate(("alone", "flooded")):
                for key, marker, color in (("p50_ms", "o", "tab:blue"), ("p99_ms", "^", "tab:orange")):
                    ax.scatter([i] * len(rows), [r[kind][key] for r in rows], marker=marker,
                               color=color, label=key.removesuffix("_ms") if i == 0 else None)
            ax.set_xticks([0, 1], ["B alone", "B while A is flooded"])
            ax.set_ylabel("B's Embed latency, ms")
            ax.legend()

    return Result(text, {"client": client, "server_args": args.server_arg, "rows": rows}, draw)
