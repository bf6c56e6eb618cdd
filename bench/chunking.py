"""`python -m bench.chunking`: late chunking against isolated chunks, on one
`attnserve serve` (a subprocess on loopback, the client here).

  1. Reference: the hand-written documents of bench/coreference.py, whose later sentences
     refer back to what the first names ("it", "the city"), chunked a sentence a chunk,
     LATE and ISOLATED; for each document, the cosine of each chunk's vector to a query
     naming the referent, and, as a control, its mean cosine to the other documents'
     queries. The later chunks never name the referent: what LATE adds is the context.
  2. Throughput: --documents documents of about --tokens tokens each (sentences of the
     reference documents, shuffled), chunked into --chunk-tokens chunks by --callers
     concurrent callers, one document a request, LATE and ISOLATED alternating over
     --rounds rounds: the documents' tokens per second, and the tokens the model ran
     per second (LATE's windows overlap; ISOLATED adds special tokens to each chunk).

Prints both tables (markdown) and writes chunking.json and chunking.png under --out-dir.
It asserts nothing.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from attnserve.client import EncoderClient
from bench.coreference import CHUNK_TOKENS, DOCUMENTS
from bench.machine import environment, machine
from bench.measure import OtherLoad, wait_quiet
from bench.run import DEFAULT_ARTIFACT, RESULTS
from bench.serving import Measured, bench_server

log = logging.getLogger("bench.chunking")
MODES = {"LATE": False, "ISOLATED": True}
"""mode -> the client's `isolated`"""
QUIET_CORES = 0.15
"""a round during which other processes used less than this is a quiet one"""


def quiet(rounds: list[dict]) -> list[dict]:
    """The rounds other processes left alone; all of them when none was."""
    return [r for r in rounds if r["other_load_cores"] < QUIET_CORES] or rounds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chunking", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    p.add_argument("--out-dir", type=Path, default=RESULTS / "chunking")
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--tokens", type=int, default=2000, help="tokens per document, about")
    p.add_argument("--chunk-tokens", type=int, default=128, help="chunk size in the throughput run")
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads; 0: all cores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each round, wait up to this long for the machine to be idle "
                        "(other processes under 0.15 cores): for shared machines")
    return p.parse_args(argv)


def reference(client: EncoderClient) -> list[dict]:
    """Per document and mode, each chunk's cosine to the document's query, and its mean
    cosine to the other documents' queries (`<mode> others`)."""
    queries = np.stack([r.pooled for r in client.embed([d.query for d in DOCUMENTS],
                                                       normalize=True)])
    rows = []
    for i, document in enumerate(DOCUMENTS):
        text = " ".join(document.sentences)
        row: dict = {"query": document.query, "refers_by": document.refers_by}
        for mode, isolated in MODES.items():
            (found,) = client.embed([text], chunk_tokens=CHUNK_TOKENS, isolated=isolated,
                                    normalize=True)
            cosines = np.stack([c.pooled for c in found.chunks]) @ queries.T
            row["chunks"] = [text[c.start:c.end] for c in found.chunks]
            row[mode] = cosines[:, i].tolist()
            row[f"{mode} others"] = np.delete(cosines, i, axis=1).mean(axis=1).tolist()
        rows.append(row)
    return rows


def documents(client: EncoderClient, count: int, tokens: int, seed: int) -> list[str]:
    """`count` texts of at least `tokens` tokens: the reference sentences, shuffled."""
    sentences = [s for document in DOCUMENTS for s in document.sentences]
    lengths = [len(t.ids) - 2 for t in client.tokenize(sentences)]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        picked, total = [], 0
        while total < tokens:
            i = int(rng.integers(len(sentences)))
            picked.append(sentences[i])
            total += lengths[i]
        out.append(" ".join(picked))
    return out


def throughput(server, client: EncoderClient, texts: list[str], chunk_tokens: int,
               callers: int, isolated: bool) -> dict:
    with Measured(server) as measured, ThreadPoolExecutor(callers) as pool:
        other = OtherLoad().start()
        results = list(pool.map(lambda text: client.embed(
            [text], chunk_tokens=chunk_tokens, isolated=isolated, timeout=600)[0], texts))
        busy = other.stop()
    summary = measured.summary()
    # The server is a child still running: its CPU is in `busy`, not in this process's own.
    other_load = max(0.0, busy - summary["server_cpu_s"] / measured.wall)
    document_tokens = sum(r.num_tokens for r in results)
    return {"wall_s": measured.wall, "document_tokens": document_tokens,
            "model_tokens": summary["real_tokens"], "chunks": sum(len(r.chunks) for r in results),
            "tokens_per_s": document_tokens / measured.wall,
            "model_tokens_per_s": summary["real_tokens"] / measured.wall,
            "other_load_cores": other_load, "server": summary}


def reference_table(rows: list[dict]) -> str:
    """One row per document: its later chunks' (those that refer back) mean cosine to its
    query and to the other queries; then the means over every first and later chunk."""
    lines = ["| query (the referent) | later chunks refer back by | ISOLATED | LATE | "
             "LATE − ISOLATED | other queries: ISOLATED | LATE |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        later = {key: np.mean(row[key][1:]) for key in ("ISOLATED", "LATE", "ISOLATED others",
                                                        "LATE others")}
        lines.append(f"| {row['query']} | {', '.join(row['refers_by'])} | {later['ISOLATED']:.3f} | "
                     f"{later['LATE']:.3f} | {later['LATE'] - later['ISOLATED']:+.3f} | "
                     f"{later['ISOLATED others']:.3f} | {later['LATE others']:.3f} |")
    for label, picked in (("first chunks (name the referent)", slice(0, 1)),
                          ("later chunks (refer back)", slice(1, None))):
        mean = {key: [c for row in rows for c in row[key][picked]]
                for key in ("ISOLATED", "LATE", "ISOLATED others", "LATE others")}
        higher = sum(a > b for a, b in zip(mean["LATE"], mean["ISOLATED"], strict=True))
        lines.append(f"| mean of {len(mean['LATE'])} {label} | LATE higher in {higher} | "
                     f"{np.mean(mean['ISOLATED']):.3f} | {np.mean(mean['LATE']):.3f} | "
                     f"{np.mean(mean['LATE']) - np.mean(mean['ISOLATED']):+.3f} | "
                     f"{np.mean(mean['ISOLATED others']):.3f} | {np.mean(mean['LATE others']):.3f} |")
    return "\n".join(lines)


def throughput_table(runs: dict[str, list[dict]]) -> str:
    lines = ["| mode | document tokens/s (median of quiet rounds) | every round | other "
             "processes meanwhile (cores) | tokens run per document token | model tokens/s "
             "(quiet) | chunks |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for mode, rounds in runs.items():
        calm = quiet(rounds)
        lines.append(f"| {mode} | {statistics.median(r['tokens_per_s'] for r in calm):,.0f} "
                     f"({len(calm)} of {len(rounds)}) | "
                     f"{', '.join(format(r['tokens_per_s'], ',.0f') for r in rounds)} | "
                     f"{', '.join(format(r['other_load_cores'], '.2f') for r in rounds)} | "
                     f"{rounds[0]['model_tokens'] / rounds[0]['document_tokens']:.2f} | "
                     f"{statistics.median(r['model_tokens_per_s'] for r in calm):,.0f} | "
                     f"{rounds[0]['chunks']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = result["environment"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    rows = result["reference"]
    x = np.arange(len(rows))
    for k, (mode, color) in enumerate((("ISOLATED", "tab:gray"), ("LATE", "tab:blue"))):
        left.bar(x + (k - 0.5) * 0.4, [np.mean(r[mode][1:]) for r in rows], 0.4,
                 label=f"{mode}: own query", color=color)
        left.scatter(x + (k - 0.5) * 0.4, [np.mean(r[f"{mode} others"][1:]) for r in rows],
                     marker="_", s=200, color="k", zorder=3,
                     label="mean over the other queries" if k else None)
    left.set_xticks(x, [r["query"] for r in rows], rotation=25, ha="right", fontsize=8)
    left.set_ylabel("cosine to the query, later chunks (mean)")
    left.set_ylim(0, 0.85)
    left.set_title("Chunks that refer back by pronoun or description")
    left.legend(ncol=3, fontsize=8, loc="upper left")
    left.grid(axis="y", alpha=0.3)
    modes = list(result["throughput"])
    rates = [statistics.median(r["tokens_per_s"] for r in quiet(result["throughput"][m]))
             for m in modes]
    right.bar(modes, rates, color=["tab:blue", "tab:gray"])
    for k, mode in enumerate(modes):
        rounds = result["throughput"][mode]
        right.scatter([k] * len(rounds), [r["tokens_per_s"] for r in rounds], color="k",
                      marker="_", s=200, zorder=3, label="every round" if k == 0 else None)
    right.legend(fontsize=8)
    right.set_ylabel(f"document tokens/s (median of rounds with other load < {QUIET_CORES} cores)",
                     fontsize=8)
    t = result["settings"]
    right.set_title(f"{t['documents']} documents × ~{t['tokens']} tokens,\n"
                    f"{t['chunk_tokens']}-token chunks, {t['callers']} callers", fontsize=9)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"all-MiniLM-L6-v2, late vs isolated chunking: {env['cpu']}, {env['cores']} "
                 f"cores, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", stream=sys.stderr,
                            format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or len(os.sched_getaffinity(0))
    result: dict = {"environment": environment(threads), "date": time.strftime("%Y-%m-%d"),
                    "settings": {k: getattr(args, k) for k in ("documents", "tokens",
                                                               "chunk_tokens", "callers",
                                                               "rounds", "seed")}}
    with bench_server(args.artifact, args.out_dir / "serve.log", [], threads) as server, \
            EncoderClient(server.address) as client:
        result["reference"] = reference(client)
        texts = documents(client, args.documents, args.tokens, args.seed)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode, isolated in MODES.items():
                quiet = wait_quiet(args.wait_quiet) if args.wait_quiet else None
                log.info("event=round round=%d mode=%s load_before_cores=%s", round_, mode, quiet)
                runs[mode].append(throughput(server, client, texts, args.chunk_tokens,
                                             args.callers, isolated))
        result["throughput"] = runs
    tables = (f"Late vs isolated chunking, {machine(result['environment'])}, {result['date']}, "
              f"commit {result['environment']['commit']}\n\n"
              f"{reference_table(result['reference'])}\n\n{throughput_table(runs)}")
    print(tables)
    (args.out_dir / "chunking.md").write_text(tables + "\n")
    (args.out_dir / "chunking.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out_dir / "chunking.png")
    print(f"\nwrote {args.out_dir}/chunking.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
