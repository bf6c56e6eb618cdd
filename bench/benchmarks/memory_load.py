"""`python -m bench memory-load`: the memory model under a served mixed load."""

from pathlib import Path

import numpy as np

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import load
from bench.load import Callers, Grpc
from bench.plot import figure
from bench.report import table
from bench.runner import DEFAULT_ARTIFACT, Result, benchmark, option
from tests.harness import ServerProcess

MIB = 1 << 20
SEED = 12
CALLERS = 8


def mixed_requests(calls: int, max_len: int, model: str) -> list[pb.EmbedRequest]:
    """`calls` requests: three in four of 1-8 sequences of 8 to `max_len` tokens, one in
    four asking for every layer's attention maps of 1-2 sequences of up to 192 tokens
    (their responses grow with the square: these stay under the default 64 MiB message
    limit); seeded, so every run sends the same."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(calls):
        maps = rng.random() < 0.25
        longest, most = (min(max_len, 192), 2) if maps else (max_len, 8)
        lengths = rng.integers(8, longest + 1, size=int(rng.integers(1, most + 1)))
        request = pb.EmbedRequest(model=model, token_ids=[
            pb.TokenIds(ids=[1000 + int(t) for t in rng.integers(0, 20000, size=n)]) for n in lengths])
        if maps:
            request.attention.CopyFrom(pb.AttentionOptions(layers=[]))  # []: every layer
        out.append(request)
    return out


@benchmark(
    "memory-load",
    option("--artifact", action="append", metavar="[NAME=]DIR",
           help="an artifact to serve, as attnserve serve takes it (repeatable: the requests go to "
                "every model in turn; default: artifacts/all-MiniLM-L6-v2)"),
    option("--calls", type=int, default=160, help="requests in all"),
)
def memory_load(args) -> Result:
    """The memory model under a served mixed load: measured ÷ predicted peak per batch.

    A real `attnserve serve` of one model or several gets mixed requests from 8 callers
    (three in four of 1-8 sequences of 8 tokens to the model's positions, one in four with
    every layer's attention maps), each to the models in turn; then its /metrics give, per
    model, seq_len bucket and maps or not, the batches' measured peak memory over that
    model's memory model's prediction for the same batches (the dashboard's ratio panel):
    the models share one memory budget, and each batch is admitted on its own model's
    prediction. Fit each model first (`attnserve memory-profile --artifact DIR --attention`),
    or the prediction is the analytic bound."""
    first, *others = args.artifact or [str(DEFAULT_ARTIFACT)]
    flags = [flag for source in others for flag in ("--artifact", source)]
    with ServerProcess(Path(first), *flags, *args.server_arg) as server:
        with EncoderClient(server.address) as probe:
            models = [(m.model, m.max_positions) for m in probe.list_models()]
        calls = 16 if args.quick else args.calls
        requests = [request for k, (model, positions) in enumerate(models)
                    for request in mixed_requests(calls, positions, model)[k::len(models)]]
        (run,) = load.run(Callers(Grpc(server.address, channels=CALLERS), requests, CALLERS,
                                  errors_ok=True), warm=False)
        samples = server.scrape()
    buckets: dict[tuple[str, str, str], dict] = {}
    for (name, labels), value in samples.items():
        kind = {"attnserve_batch_peak_memory_bytes_sum": "measured_bytes",
                "attnserve_batch_predicted_memory_bytes_sum": "predicted_bytes",
                "attnserve_batch_peak_memory_bytes_count": "batches"}.get(name)
        if kind:
            labels = dict(labels)
            key = (labels["model"], labels["seq_len_bucket"], labels["attention"])
            buckets.setdefault(key, {})[kind] = value
    rows = [{"model": m, "seq_len_bucket": b, "attention": a, **v,
             "ratio": v["measured_bytes"] / v["predicted_bytes"] if v.get("predicted_bytes") else None}
            for (m, b, a), v in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][2],
                                                                          int(kv[0][1].split("-")[0])))]
    result = {"calls": len(requests), "answered": len(run.latencies), "refused": run.errors,
              "callers": CALLERS, "models": [m for m, _ in models], "buckets": rows}
    text = (f"under a mixed load of {', '.join(result['models'])} ({result['answered']} of "
            f"{result['calls']} requests answered, refused: {run.errors or 'none'}; {CALLERS} callers): "
            "measured / predicted peak memory per batch\n\n" + table(
                ["model", "bucket", "maps", "batches", "measured MiB", "predicted MiB", "ratio"],
                [[r["model"], r["seq_len_bucket"], r["attention"], f"{r['batches']:.0f}",
                  f"{r['measured_bytes'] / MIB:.1f}", f"{r['predicted_bytes'] / MIB:.1f}",
                  "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"] for r in rows], "lllrrrr"))

    def draw(path: Path) -> None:
        shown = [r for r in rows if r["ratio"] is not None]
        with figure(path, figsize=(8, 4)) as (_, ax):
            ax.bar(range(len(shown)), [r["ratio"] for r in shown], color="tab:blue")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(shown)), [
                f"{r['model']} {r['seq_len_bucket']}{' maps' if r['attention'] == 'true' else ''}"
                for r in shown], rotation=45, ha="right")
            ax.set_ylabel("measured / predicted peak per batch")
            ax.set_title(f"{', '.join(result['models'])}: measured / predicted peak memory per batch "
                         f"under a mixed load ({result['calls']} requests)", fontsize=9)

    return Result(text, result, draw)
