"""`python -m bench workers`: what front-end processes buy, and what the hop to the engine costs."""

from pathlib import Path

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import load
from bench.load import Callers, Grpc
from bench.measure import latency_summary, median_of, time_calls
from bench.plot import figure
from bench.report import table
from bench.runner import Result, benchmark, option
from bench.served import answered, tiny_artifact
from bench.workloads import IDS_1X16
from tests.harness import ServerProcess

CALLERS = 64
CLIENT_PROCESSES = 4
REQUEST = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS_1X16)])


@benchmark(
    "workers",
    option("--artifact", type=Path, default=None,
           help="artifact to serve (default: the tests' tiny model, exported once)"),
    option("--workers", default="1,2", help="comma-separated --workers to compare"),
    option("--seconds", type=float, default=10.0, help="of load per measurement"),
    option("--rounds", type=int, default=3),
    option("--client", choices=("auto", "h2load", "python"), default="auto",
           help="the 64 callers: h2load, or ours in client processes (auto: h2load where installed)"),
)
def workers(args) -> Result:
    """What front-end processes (--workers) buy, and what the hop to the engine costs.

    A front-end-bound load: Embed of one 16-token sequence from 64 callers, each on a
    connection of its own (SO_REUSEPORT spreads connections, not calls, over the front
    ends), against `attnserve serve --workers N` for each N asked, in alternating rounds.
    The callers are h2load where it is installed (a few microseconds of client CPU a call,
    so the clients leave the cores to the server), else ours in 4 client processes. Beside
    it: one caller's latency (the hop's cost in time) and the server's CPU per call (its
    cost in work, every process of the group counted)."""
    seconds, rounds = (2.0, 1) if args.quick else (args.seconds, args.rounds)
    artifact = args.artifact or tiny_artifact(args.out_dir / "tiny-artifact")
    client = load.flood_client(args.client)
    counts = [int(n) for n in args.workers.split(",")]
    rows: dict[int, list[dict]] = {n: [] for n in counts}
    with load.client_pool(CLIENT_PROCESSES) as pool:
        for round_ in range(rounds):
            for n in counts if round_ % 2 == 0 else counts[::-1]:
                rows[n].append(measure(args, artifact, n, seconds, client, pool))
    base = median_of(rows[counts[0]], "requests_per_s")
    text = (f"Embed 1×16 (token ids), {CALLERS} callers ({client}), each on its own connection; medians "
            "of the rounds\n\n" + table(
                ["--workers", "requests/s", f"× --workers {counts[0]}", "one caller p50 ms",
                 "one caller p99 ms", "server CPU ms/call"],
                [[n, f"{median_of(runs, 'requests_per_s'):.0f}",
                  f"{median_of(runs, 'requests_per_s') / base:.2f}",
                  *(f"{median_of(runs, 'one_caller', key):.2f}" for key in ("p50_ms", "p99_ms")),
                  f"{median_of(runs, 'server_cpu_ms_per_call'):.2f}"] for n, runs in rows.items()], "r" * 6))

    def draw(path: Path) -> None:
        with figure(path, figsize=(6, 4)) as (_, ax):
            for n, runs in rows.items():
                ax.scatter([n] * len(runs), [r["requests_per_s"] for r in runs], color="tab:blue")
            ax.plot(counts, [median_of(rows[n], "requests_per_s") for n in counts], color="tab:blue",
                    label="median of the rounds")
            ax.set(xlabel="--workers", ylabel="Embed 1×16 requests/s", xticks=counts)
            ax.legend()

    return Result(text, {"client": client, "rows": rows}, draw)


def measure(args, artifact: Path, workers: int, seconds: float, client: str, pool) -> dict:
    with ServerProcess(artifact, "--workers", str(workers), *args.server_arg) as server:
        with EncoderClient(server.address) as one:
            latencies = time_calls(lambda: one.embed(token_ids=[IDS_1X16]), 30 if args.quick else 300)
        calls, cpu = answered(server), server.status()["cpu_s"]
        if client == "h2load":
            flood = load.h2load(server.address, REQUEST, CALLERS, seconds, args.out_dir / "embed.grpc")
            rate = load.h2load_calls(flood, seconds + 60) / seconds
        else:
            (run,) = load.run(Callers(Grpc(server.address, channels=CALLERS), [REQUEST], CALLERS,
                                      seconds=seconds, processes=CLIENT_PROCESSES), pool=pool)
            rate = run.rate
        cpu, calls = server.status()["cpu_s"] - cpu, answered(server) - calls
    return {"workers": workers, "requests_per_s": rate, "one_caller": latency_summary(latencies),
            "server_cpu_ms_per_call": 1e3 * cpu / max(calls, 1)}
