"""`python -m bench overhead`: what a call costs beyond its model, this checkout's server beside another's."""

import random
from pathlib import Path

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import load
from bench.load import Callers, Grpc, Http
from bench.measure import latency_summary, median_of
from bench.plot import figure
from bench.report import table
from bench.runner import Result, benchmark, option
from bench.served import tiny_artifact
from bench.workloads import IDS_1X16, SHORT_MAX, SHORT_MIN
from tests.harness import ServerProcess

CALLERS = 64
CLIENT_PROCESSES = 4
SHORT_REQUESTS = 256
"""distinct short requests the 64 callers go round"""


def _short_ids(count: int) -> list[list[int]]:
    """Token ids of short texts (8-32 tokens, [CLS] … [SEP]), fixed by a seed."""
    rng = random.Random(0)
    return [[101, *(rng.randrange(2000, 29000) for _ in range(rng.randint(SHORT_MIN, SHORT_MAX) - 2)), 102]
            for _ in range(count)]


def _loads(server: ServerProcess, calls: int, seconds: float) -> dict[tuple[str, str], Callers]:
    """(door, load) -> its callers: one caller of 1×16, and 64 callers of short sequences,
    on attnserve.v1's Embed and on OpenAI's /v1/embeddings (token ids as input on both, so
    both doors run the same sequences)."""
    shorts = _short_ids(SHORT_REQUESTS)
    grpc, http = Grpc(server.address, channels=CLIENT_PROCESSES), Http(f"{server.http_url}/v1/embeddings")
    return {
        ("attnserve.v1 Embed", "1×16, one caller"): Callers(
            grpc, [pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS_1X16)])] * calls),
        ("OpenAI /v1/embeddings", "1×16, one caller"): Callers(http, [{"input": [IDS_1X16]}] * calls),
        ("attnserve.v1 Embed", f"{CALLERS} callers, short"): Callers(
            grpc, [pb.EmbedRequest(token_ids=[pb.TokenIds(ids=ids)]) for ids in shorts], CALLERS,
            seconds=seconds, processes=CLIENT_PROCESSES),
        ("OpenAI /v1/embeddings", f"{CALLERS} callers, short"): Callers(
            http, [{"input": [ids]} for ids in shorts], CALLERS, seconds=seconds,
            processes=CLIENT_PROCESSES),
    }


@benchmark(
    "overhead",
    option("--against", type=Path, default=None,
           help="another checkout (with its own .venv, as `make` sets it up) whose server is "
                "measured beside this one's"),
    option("--artifact", type=Path, default=None,
           help="served by both (default: the tests' tiny model, exported once, so the request "
                "path and not the model decides)"),
    option("--calls", type=int, default=400, help="1×16 calls each round"),
    option("--seconds", type=float, default=5.0, help="of 64 callers each round"),
    option("--rounds", type=int, default=5),
)
def overhead(args) -> Result:
    """What a call costs beyond its model, on attnserve.v1 and on OpenAI's door.

    One caller sending Embed of one 16-token sequence back to back (its p50 is the request
    path's latency), and 64 callers of short sequences (8-32 tokens) in 4 client processes
    (their rate is the request path's throughput), on attnserve.v1's Embed and on OpenAI's
    /v1/embeddings. With --against, the other checkout's server runs beside this one's on the
    same artifact and the two are measured in alternating rounds, so a change's cost is a
    ratio from one run."""
    calls, seconds, rounds = (40, 1.0, 1) if args.quick else (args.calls, args.seconds, args.rounds)
    artifact = args.artifact or tiny_artifact(args.out_dir / "tiny-artifact")
    sides = {"this checkout": None}
    if args.against:
        sides = {f"{args.against.name}": args.against / ".venv" / "bin" / "attnserve"} | sides
    samples: dict[tuple[str, str, str], list[dict]] = {}
    servers = {}
    try:
        for side, command in sides.items():
            kwargs = {"command": [str(command)]} if command else {}
            servers[side] = ServerProcess(artifact, *args.server_arg,
                                          log_path=args.out_dir / f"{side.replace(' ', '-')}.log", **kwargs)
        with load.client_pool(CLIENT_PROCESSES) as pool:
            for _ in range(rounds):
                for side, server in servers.items():
                    for (door, what), callers in _loads(server, calls, seconds).items():
                        (run,) = load.run(callers, pool=pool if callers.seconds else None)
                        samples.setdefault((door, what, side), []).append(
                            latency_summary(run.latencies) | {"calls_per_s": run.rate})
    finally:
        for server in servers.values():
            server.stop()
    names = list(sides)
    rows, data = [], []
    for door, what in {(d, w) for d, w, _ in samples}:
        by_side = {s: {k: median_of(samples[(door, what, s)], k) for k in ("p50_ms", "p99_ms", "calls_per_s")}
                   for s in names}
        data.append({"door": door, "load": what, **by_side})
        row = [door, what]
        for s in names:
            side = by_side[s]
            row += [f"{side['p50_ms']:.2f}", f"{side['p99_ms']:.2f}", f"{side['calls_per_s']:,.0f}"]
        if len(names) == 2:
            before, after = (by_side[s] for s in names)
            row += [f"{after['p50_ms'] / before['p50_ms']:.2f}",
                    f"{after['calls_per_s'] / before['calls_per_s']:.2f}"]
        rows.append(row)
    rows.sort()
    header = ["door", "load"] + [f"{s} {k}" for s in names for k in ("p50 ms", "p99 ms", "calls/s")]
    if len(names) == 2:
        header += ["p50 ratio", "calls/s ratio"]
    text = (f"Medians of {rounds} alternating rounds; artifact {artifact.name}; ratios are this "
            f"checkout's over {names[0]}'s.\n\n" if len(names) == 2 else
            f"Medians of {rounds} rounds; artifact {artifact.name}.\n\n")
    text += table(header, rows, "ll" + "r" * (len(header) - 2))

    def plot(path: Path) -> None:
        with figure(path, figsize=(9, 4)) as (fig, ax):
            labels = [f"{r['door']}\n{r['load']}" for r in data]
            width = 0.8 / len(names)
            for k, side in enumerate(names):
                ax.bar([i + k * width for i in range(len(data))], [r[side]["p50_ms"] for r in data],
                       width, label=side)
            ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(data))], labels, fontsize=7)
            ax.set_ylabel("p50 ms")
            ax.legend()

    return Result(text, {"rows": data, "rounds": rounds}, plot)
