"""`python -m bench chunking`: late chunking against isolated chunks."""

import logging
import os
import statistics
from pathlib import Path

import numpy as np

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from bench import load
from bench.coreference import CHUNK_TOKENS, DOCUMENTS
from bench.load import Callers, Grpc
from bench.measure import OtherLoad, wait_quiet
from bench.plot import figure
from bench.report import table
from bench.runner import DEFAULT_ARTIFACT, Result, benchmark, option
from bench.served import Measured, bench_server

log = logging.getLogger("bench.chunking")
MODES = {"LATE": False, "ISOLATED": True}
"""mode -> the client's `isolated`"""
QUIET_CORES = 0.15
"""a round during which other processes used less than this is a quiet one"""


def quiet(rounds: list[dict]) -> list[dict]:
    """The rounds other processes left alone; all of them when none was."""
    return [r for r in rounds if r["other_load_cores"] < QUIET_CORES] or rounds


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


def throughput(server, texts: list[str], chunk_tokens: int, callers: int, isolated: bool) -> dict:
    chunking = pb.Chunking(max_tokens=chunk_tokens,
                           mode=pb.CHUNKING_MODE_ISOLATED if isolated else pb.CHUNKING_MODE_LATE)
    requests = [pb.EmbedRequest(texts=[text], chunking=chunking) for text in texts]
    with Measured(server) as measured:
        other = OtherLoad().start()
        (run,) = load.run(Callers(Grpc(server.address), requests, callers, keep=True),
                          warm=False)
        busy = other.stop()
    summary = measured.summary()
    # The server is a child still running: its CPU is in `busy`, not in this process's own.
    other_load = max(0.0, busy - summary["server_cpu_s"] / measured.wall)
    results = [answer.embeddings[0] for answer in run.answers]
    document_tokens = sum(r.num_tokens for r in results)
    return {"wall_s": measured.wall, "document_tokens": document_tokens,
            "model_tokens": summary["real_tokens"], "chunks": sum(len(r.chunks) for r in results),
            "tokens_per_s": document_tokens / measured.wall,
            "model_tokens_per_s": summary["real_tokens"] / measured.wall,
            "other_load_cores": other_load, "server": summary}


def reference_table(rows: list[dict]) -> str:
    """One row per document: its later chunks' (those that refer back) mean cosine to its
    query and to the other queries; then the means over every first and later chunk."""
    keys = ("ISOLATED", "LATE", "ISOLATED others", "LATE others")
    lines = []
    for row in rows:
        later = {key: np.mean(row[key][1:]) for key in keys}
        lines.append([row["query"], ", ".join(row["refers_by"]), f"{later['ISOLATED']:.3f}",
                      f"{later['LATE']:.3f}", f"{later['LATE'] - later['ISOLATED']:+.3f}",
                      f"{later['ISOLATED others']:.3f}", f"{later['LATE others']:.3f}"])
    for label, picked in (("first chunks (name the referent)", slice(0, 1)),
                          ("later chunks (refer back)", slice(1, None))):
        mean = {key: [c for row in rows for c in row[key][picked]] for key in keys}
        higher = sum(a > b for a, b in zip(mean["LATE"], mean["ISOLATED"], strict=True))
        lines.append([f"mean of {len(mean['LATE'])} {label}", f"LATE higher in {higher}",
                      *(f"{np.mean(mean[key]):.3f}" for key in keys[:2]),
                      f"{np.mean(mean['LATE']) - np.mean(mean['ISOLATED']):+.3f}",
                      *(f"{np.mean(mean[key]):.3f}" for key in keys[2:])])
    return table(["query (the referent)", "later chunks refer back by", "ISOLATED", "LATE",
                  "LATE − ISOLATED", "other queries: ISOLATED", "LATE"], lines, "llrrrrr")


def throughput_table(runs: dict[str, list[dict]]) -> str:
    return table(["mode", "document tokens/s (median of quiet rounds)", "every round",
                  "other processes meanwhile (cores)", "tokens run per document token",
                  "model tokens/s (quiet)", "chunks"],
                 [[mode, f"{statistics.median(r['tokens_per_s'] for r in quiet(rounds)):,.0f} "
                         f"({len(quiet(rounds))} of {len(rounds)})",
                   ", ".join(format(r["tokens_per_s"], ",.0f") for r in rounds),
                   ", ".join(format(r["other_load_cores"], ".2f") for r in rounds),
                   f"{rounds[0]['model_tokens'] / rounds[0]['document_tokens']:.2f}",
                   f"{statistics.median(r['model_tokens_per_s'] for r in quiet(rounds)):,.0f}",
                   rounds[0]["chunks"]] for mode, rounds in runs.items()], "lrllrrr")


def plot(result: dict, path: Path) -> None:
    env, rows, t = result["environment"], result["reference"], result["settings"]
    with figure(path, 1, 2, figsize=(14, 5.5), dpi=110, gridspec_kw={"width_ratios": [3, 1]}) as (
            fig, (left, right)):
        x = np.arange(len(rows))
        for k, (mode, color) in enumerate((("ISOLATED", "tab:gray"), ("LATE", "tab:blue"))):
            left.bar(x + (k - 0.5) * 0.4, [np.mean(r[mode][1:]) for r in rows], 0.4,
                     label=f"{mode}: own query", color=color)
            left.scatter(x + (k - 0.5) * 0.4, [np.mean(r[f"{mode} others"][1:]) for r in rows],
                         marker="_", s=200, color="k", zorder=3,
                         label="mean over the other queries" if k else None)
        left.set_xticks(x, [r["query"] for r in rows], rotation=25, ha="right", fontsize=8)
        left.set(ylabel="cosine to the query, later chunks (mean)", ylim=(0, 0.85),
                 title="Chunks that refer back by pronoun or description")
        left.legend(ncol=3, fontsize=8, loc="upper left")
        left.grid(axis="y", alpha=0.3)
        modes = list(result["throughput"])
        right.bar(modes, [statistics.median(r["tokens_per_s"] for r in quiet(result["throughput"][m]))
                          for m in modes], color=["tab:blue", "tab:gray"])
        for k, mode in enumerate(modes):
            rounds = result["throughput"][mode]
            right.scatter([k] * len(rounds), [r["tokens_per_s"] for r in rounds], color="k",
                          marker="_", s=200, zorder=3, label="every round" if k == 0 else None)
        right.legend(fontsize=8)
        right.set_ylabel(f"document tokens/s (median of rounds with other load < {QUIET_CORES} cores)",
                         fontsize=8)
        right.set_title(f"{t['documents']} documents × ~{t['tokens']} tokens,\n"
                        f"{t['chunk_tokens']}-token chunks, {t['callers']} callers", fontsize=9)
        right.grid(axis="y", alpha=0.3)
        fig.suptitle(f"all-MiniLM-L6-v2, late vs isolated chunking: {env['cpu']}, {env['cores']} "
                     f"cores, {env['date']}", fontsize=10)


@benchmark(
    "chunking",
    option("--artifact", type=Path, default=DEFAULT_ARTIFACT),
    option("--documents", type=int, default=100),
    option("--tokens", type=int, default=2000, help="tokens per document, about"),
    option("--chunk-tokens", type=int, default=128, help="chunk size in the throughput run"),
    option("--callers", type=int, default=4),
    option("--rounds", type=int, default=2),
    option("--threads", type=int, default=0, help="onnxruntime threads; 0: all cores"),
    option("--seed", type=int, default=0),
    option("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
           help="before each round, wait up to this long for the machine to be idle (other "
                "processes under 0.15 cores): for shared machines"),
)
def chunking(args) -> Result:
    """Late chunking against isolated chunks, on one `attnserve serve`.

      1. Reference: the hand-written documents of bench/coreference.py, whose later sentences
         refer back to what the first names ("it", "the city"), chunked a sentence a chunk,
         LATE and ISOLATED; for each document, the cosine of each chunk's vector to a query
         naming the referent, and, as a control, its mean cosine to the other documents'
         queries. The later chunks never name the referent: what LATE adds is the context.
      2. Throughput: --documents documents of about --tokens tokens each (sentences of the
         reference documents, shuffled), chunked into --chunk-tokens chunks by --callers
         concurrent callers, one document a request, LATE and ISOLATED alternating over
         --rounds rounds: the documents' tokens per second, and the tokens the model ran
         per second (LATE's windows overlap; ISOLATED adds special tokens to each chunk)."""
    if args.quick:
        args.documents, args.tokens, args.rounds = 4, 300, 1
    threads = args.threads or len(os.sched_getaffinity(0))
    result: dict = {"settings": {k: getattr(args, k) for k in ("documents", "tokens", "chunk_tokens",
                                                               "callers", "rounds", "seed")}}
    with bench_server(args.artifact, args.out_dir / "serve.log", args.server_arg, threads) as server, \
            EncoderClient(server.address) as client:
        result["reference"] = reference(client)
        texts = documents(client, args.documents, args.tokens, args.seed)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode, isolated in MODES.items():
                quiet_before = wait_quiet(args.wait_quiet) if args.wait_quiet else None
                log.info("event=round round=%d mode=%s load_before_cores=%s", round_, mode, quiet_before)
                runs[mode].append(throughput(server, texts, args.chunk_tokens, args.callers, isolated))
        result["throughput"] = runs
    return Result(f"Late vs isolated chunking\n\n{reference_table(result['reference'])}\n\n"
                  f"{throughput_table(runs)}", result, lambda path: plot(result, path))
