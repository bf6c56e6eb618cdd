"""`python -m bench.memory_load`: the memory model under a served mixed load, the
dashboard's measured ÷ predicted panel in one table.

A real `attnserve serve` on loopback gets mixed requests from several callers (three in
four of 1-8 sequences of 8 tokens to the model's positions, one in four with every
layer's attention maps), then its /metrics give, per seq_len bucket and maps or not, the
batches' measured peak memory over the memory model's prediction for the same batches.
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

from attnserve.artifact import load_artifact
from attnserve.client import EncoderClient
from bench.harness import ServerProcess
from bench.run import RESULTS

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


def mixed_load(artifact_dir: Path, calls: int) -> dict:
    """A real `attnserve serve` on loopback, MIXED_CALLERS callers sending `calls` mixed
    requests at once; then, from its /metrics, measured over predicted peak memory per
    seq_len bucket and maps or not (the dashboard's ratio panel)."""
    manifest = load_artifact(artifact_dir).manifest
    requests = mixed_requests(calls, manifest.max_positions)
    with ServerProcess(Path(artifact_dir)) as server:
        def caller(mine: list) -> list[str]:
            codes = []
            with EncoderClient(server.address) as client:
                for token_ids, layers in mine:
                    try:
                        client.embed(token_ids=token_ids, attention_layers=layers, timeout=600)
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
    buckets: dict[tuple[str, str], dict] = {}
    for (name, labels), value in samples.items():
        kind = {"attnserve_batch_peak_memory_bytes_sum": "measured_bytes",
                "attnserve_batch_predicted_memory_bytes_sum": "predicted_bytes",
                "attnserve_batch_peak_memory_bytes_count": "batches"}.get(name)
        if kind:
            key = (dict(labels)["seq_len_bucket"], dict(labels)["attention"])
            buckets.setdefault(key, {})[kind] = value
    rows = [{"seq_len_bucket": b, "attention": a, **v,
             "ratio": v["measured_bytes"] / v["predicted_bytes"] if v.get("predicted_bytes") else None}
            for (b, a), v in sorted(buckets.items(), key=lambda kv: (kv[0][1], int(kv[0][0].split("-")[0])))]
    return {"calls": calls, "answered": answered, "refused": refused, "callers": MIXED_CALLERS,
            "buckets": rows}


def mixed_table(result: dict) -> str:
    lines = [f"under a mixed load ({result['answered']} of {result['calls']} requests answered, "
             f"refused: {result['refused'] or 'none'}; {result['callers']} callers): measured / "
             "predicted peak memory per batch",
             f"{'bucket':>9} {'maps':>5} {'batches':>7} {'measured MiB':>13} {'predicted MiB':>14} "
             f"{'ratio':>6}"]
    for r in result["buckets"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['seq_len_bucket']:>9} {r['attention']:>5} {r['batches']:>7.0f} "
                     f"{r['measured_bytes'] / MIB:>13.1f} {r['predicted_bytes'] / MIB:>14.1f} {ratio:>6}")
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
    labels = [f"{r['seq_len_bucket']}{' maps' if r['attention'] == 'true' else ''}" for r in rows]
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
    p.add_argument("--artifact", type=Path, required=True, help="artifact directory")
    p.add_argument("--calls", type=int, default=160, help="requests in all")
    p.add_argument("--out", type=Path, default=RESULTS / "memory-load")
    args = p.parse_args(argv)
    result = mixed_load(args.artifact, args.calls)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_load.json").write_text(json.dumps(result, indent=2) + "\n")
    print(mixed_table(result))
    name = load_artifact(args.artifact).manifest.model_name
    if plot(args.out / "mixed_load.png", result, f"{name}: measured / predicted peak memory "
            f"per batch under a mixed load ({result['calls']} requests)"):
        print(f"wrote {args.out / 'mixed_load.json'}, {args.out / 'mixed_load.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
