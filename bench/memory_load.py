"""`python -m bench.memory_load`: the memory model under a served mixed load, the
dashboard's measured ÷ predicted panel in one table.

A real `attnserve serve` of one model or several on loopback gets mixed requests from
several callers (three in four of 1-8 sequences of 8 tokens to the model's positions, one
in four with every layer's attention maps), each to the models in turn, then its /metrics
give, per model, seq_len bucket and maps or not, the batches' measured peak memory over
that model's memory model's prediction for the same batches: the models share one memory
budget, and each batch is admitted on its own model's prediction.
It prints the table, writes mixed_load.json and mixed_load.png to --out, and asserts
nothing. Fit the model first (`attnserve memory-profile --artifact DIR --attention`), or
the prediction is the analytic bound.
"""

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from attnserve.client import EncoderClient
from bench.run import RESULTS
from tests.harness import ServerProcess

MIB = 1 << 20

MIXED_SEED = 12
MIXED_CALLERS = 8


def mixed_requests(calls: int, max_len: int) -> list[tuple[list[list[int]], list[int] | None]]:
    """`calls` requests: three in four of 1-8 sequences of 8 to `max_len` tokens, one in
    four asking for every layer's attention maps of 1-2 sequences of up to 192 tokens
    (their responses grow with the square: these stay under the default 64 MiB message
    limit); seeded, so every run sends the same."""
    rng = np.random.default_rng(MIXED_SEED)
    out = []
    for _ in range(calls):
        maps = rng.random() < 0.25
        longest, most = (min(max_len, 192), 2) if maps else (max_len, 8)
        lengths = rng.integers(8, longest + 1, size=int(rng.integers(1, most + 1)))
        out.append(([[1000 + int(t) for t in rng.integers(0, 20000, size=n)] for n in lengths],
                    [] if maps else None))
    return out


def mixed_load(sources: list[str], calls: int) -> dict:
    """A real `attnserve serve` of every artifact in `sources` (each `[NAME=]DIR`, as
    --artifact takes it) on loopback, MIXED_CALLERS callers sending `calls` mixed requests
    at once, each to the models in turn; then, from its /metrics, measured over predicted
    peak memory per model, seq_len bucket and maps or not (the dashboard's ratio panel)."""
    first, *others = sources
    flags = [flag for source in others for flag in ("--artifact", source)]
    with ServerProcess(Path(first), *flags) as server:
        with EncoderClient(server.address) as probe:
            models = [(m.model, m.max_positions) for m in probe.list_models()]
        requests = [(model, *request)
                    for k, (model, positions) in enumerate(models)
                    for request in mixed_requests(calls, positions)[k::len(models)]]

        def caller(mine: list) -> list[str]:
            codes = []
            with EncoderClient(server.address) as client:
                for model, token_ids, layers in mine:
                    try:
                        client.embed(token_ids=token_ids, attention_layers=layers, model=model,
                                     timeout=600)
                        codes.append("OK")
                    except grpc.RpcError as err:  # refused (memory, size): counted, not fatal
                        codes.append(err.code().name)
            return codes

        with ThreadPoolExecutor(MIXED_CALLERS) as pool:
            codes = [c for mine in pool.map(caller, [requests[i::MIXED_CALLERS]
                                                    for i in range(MIXED_CALLERS)]) for c in mine]
        samples = server.scrape()
    answered = codes.count("OK")
    refused = {code: codes.count(code) for code in sorted(set(codes) - {"OK"})}
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
            for (m, b, a), v in sorted(buckets.items(), key=lambda kv: (
                kv[0][0], kv[0][2], int(kv[0][1].split("-")[0])))]
    return {"calls": len(requests), "answered": answered, "refused": refused,
            "callers": MIXED_CALLERS, "models": [m for m, _ in models], "buckets": rows}


def mixed_table(result: dict) -> str:
    lines = [f"under a mixed load of {', '.join(result['models'])} ({result['answered']} of "
             f"{result['calls']} requests answered, refused: {result['refused'] or 'none'}; "
             f"{result['callers']} callers): measured / predicted peak memory per batch", "",
             "| model | bucket | maps | batches | measured MiB | predicted MiB | ratio |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in result["buckets"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['model']} | {r['seq_len_bucket']} | {r['attention']} | "
                     f"{r['batches']:.0f} | {r['measured_bytes'] / MIB:.1f} | "
                     f"{r['predicted_bytes'] / MIB:.1f} | {ratio} |")
    return "\n".join(lines)


def plot(path: Path, result: dict, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["buckets"] if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']} {r['seq_len_bucket']}{' maps' if r['attention'] == 'true' else ''}"
              for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right")
    ax.set_ylabel("measured / predicted peak per batch")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", action="append", required=True, metavar="[NAME=]DIR",
                   help="an artifact to serve, as attnserve serve takes it (repeatable: the "
                        "requests go to every model in turn)")
    p.add_argument("--calls", type=int, default=160, help="requests in all")
    p.add_argument("--out", type=Path, default=RESULTS / "memory-load")
    args = p.parse_args(argv)
    result = mixed_load(args.artifact, args.calls)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_load.json").write_text(json.dumps(result, indent=2) + "\n")
    print(mixed_table(result))
    title = (f"{', '.join(result['models'])}: measured / predicted peak memory per batch under "
             f"a mixed load ({result['calls']} requests)")
    if plot(args.out / "mixed_load.png", result, title):
        print(f"wrote {args.out / 'mixed_load.json'}, {args.out / 'mixed_load.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
