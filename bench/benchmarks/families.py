"""`python -m bench families`: attnserve on a BERT-base-shaped and a Qwen3-0.6B-shaped model
against SentenceTransformer.encode."""

import logging
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from bench import checkpoints
from bench.benchmarks.rerank import texts_of
from bench.measure import latency_summary
from bench.plot import figure
from bench.raw import isolated
from bench.report import docs_section, slug, table, update_page
from bench.runner import Result, benchmark, environment, machine, option
from tests.harness import ATTNSERVE, REPO, ServerProcess

log = logging.getLogger("bench.families")
SHAPES = ((32, 128), (32, 512), (1, 16))
"""(texts, tokens a sequence, special tokens included) of each request"""
ENGINES = {"attnserve fp32": (), "attnserve int8": ("--precision", "int8")}
"""each attnserve engine: its `attnserve serve` flags beside --server-arg's"""
REFERENCE = "sentence-transformers"
INT8_GRAPH = "encoder_int8.onnx"
RUNS_MARKER = ("<!-- python -m bench: runs written by `python -m bench families --docs` follow, "
               "newest first -->")


@benchmark(
    "families",
    option("--shapes", default="bert-base,qwen3-0.6b",
           help=f"the checkpoints' shapes, comma-separated, of {', '.join(checkpoints.SHAPES)}"),
    option("--reps", type=int, default=20, help="calls of each request shape an engine times"),
    option("--docs", type=Path, default=None, metavar="PAGE",
           help="write this run's table, dated and headed by the machine and the shapes, into "
                "PAGE (docs/benchmarks.md) in place of the same machine's earlier run of those "
                "shapes, and its plot beside PAGE; a full run only"))
def families(args) -> Result:
    """attnserve's gRPC Embed against SentenceTransformer.encode on models of real sizes.

    Each shape's random checkpoint (bench/checkpoints.py: BERT-base's, Qwen3-0.6B's; random
    weights cost what real ones do) is made once under --out-dir and exported by `attnserve
    export --int8` (the Qwen3 one: 20 minutes or more on 2 cores, about 15 GiB at its
    peak, while quantizing). One caller sends the same request back to back, --reps times
    after one warm-up call: 32 texts of 128 tokens, 32 of 512, 1 of 16 (special tokens
    included). attnserve runs at its defaults (fp32) and with `--precision int8`;
    sentence-transformers runs in a process of its own at its defaults (encode, batch_size
    32; no progress bar), its max_seq_length raised where it would cut the 512-token texts.
    It prints p50 per call, each engine's speed as a ratio to sentence-transformers', and
    the cosine of each engine's vectors against sentence-transformers' and of int8's
    against fp32's, the worst text of the 32x128 request. --quick: both shapes at a tiny
    size (bench/checkpoints.QUICK), 2 reps."""
    if args.docs and args.quick:
        raise SystemExit("python -m bench families: --docs records a full run's figures; drop --quick")
    started = time.perf_counter()
    reps = 2 if args.quick else args.reps
    rows, failed, st_lengths = [], [], {}
    for shape in args.shapes.split(","):
        checkpoint, artifact = model(args.out_dir / f"{'quick-' if args.quick else ''}{shape}",
                                     shape, args.quick)
        workloads = {size: texts(artifact, *size) for size in SHAPES}
        vectors = {}
        for engine, flags in ENGINES.items():
            if engine == "attnserve int8" and not (artifact / INT8_GRAPH).is_file():
                failed.append(f"{shape} int8 (the export's int8 gate refused the graph)")
                continue
            with ServerProcess(artifact, *flags, *args.server_arg,
                               log_path=args.out_dir / f"{shape}-{slug(engine)}.log") as server:
                for size, batch in workloads.items():
                    seconds, pooled = served(server.address, batch, reps)
                    rows.append(row(shape, engine, size, seconds))
                    if size == SHAPES[0]:
                        vectors[engine] = pooled
        reference = isolated(sentence_transformers, checkpoint, workloads, reps)
        for size in SHAPES:
            rows.append(row(shape, REFERENCE, size, reference["seconds"][size]))
        vectors[REFERENCE] = np.asarray(reference["vectors"])
        for engine in ENGINES:
            if engine in vectors:
                cosine = worst_cosine(vectors[engine], vectors[REFERENCE])
                versus_fp32 = (worst_cosine(vectors[engine], vectors["attnserve fp32"])
                               if engine != "attnserve fp32" else None)
                for r in rows:
                    if r["model"] == shape and r["engine"] == engine:
                        r |= {"cosine_vs_st": cosine, "cosine_vs_fp32": versus_fp32}
        st_lengths[shape] = reference["max_seq_length"]
    data = {"server_args": args.server_arg, "reps": reps, "rows": rows,
            "st_max_seq_length": st_lengths, "shapes": args.shapes}
    text = markdown(rows)
    if args.docs:
        data["environment"] = environment(len(os.sched_getaffinity(0)))
        data["seconds"] = time.perf_counter() - started
        write_docs(args.docs, data, text)
    return Result(text, data, lambda path: plot(rows, path), failed)


def model(directory: Path, shape: str, quick: bool) -> tuple[Path, Path]:
    """(the checkpoint, its artifact with int8 graphs), made once."""
    checkpoint, artifact = directory / "checkpoint", directory / "artifact"
    if (artifact / "manifest.json").is_file():
        return checkpoint, artifact
    log.info("event=making shape=%s quick=%s", shape, quick)
    checkpoints.make(shape, checkpoint, quick)
    started = time.perf_counter()
    subprocess.run([*ATTNSERVE, "export", "--out", str(artifact), "--from", str(checkpoint),
                    "--name", shape, "--int8"], check=True, cwd=REPO)
    log.info("event=exported shape=%s seconds=%.0f", shape, time.perf_counter() - started)
    return checkpoint, artifact


def texts(artifact: Path, count: int, tokens: int) -> list[str]:
    """`count` texts of `tokens` tokens each with the model's special tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    tokenizer.no_padding()
    specials = len(tokenizer.encode("").ids)
    return texts_of(tokens - specials, count, artifact / "tokenizer.json")


def served(address: str, batch: list[str], reps: int) -> tuple[list[float], np.ndarray]:
    """Seconds of each of `reps` Embed calls of `batch` (after one to warm up), and the
    normalised vectors of the last."""
    from attnserve.client import EncoderClient

    seconds = []
    with EncoderClient(address) as client:
        results = client.embed(batch, normalize=True)
        for _ in range(reps):
            started = time.perf_counter()
            results = client.embed(batch, normalize=True)
            seconds.append(time.perf_counter() - started)
    return seconds, np.stack([r.pooled for r in results])


def sentence_transformers(checkpoint: Path, workloads: dict, reps: int) -> dict:
    """SentenceTransformer.encode at its defaults (run it `isolated`): each workload `reps`
    times after one warm-up call; the normalised vectors of the first."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(checkpoint), device="cpu")
    longest = max(tokens for _, tokens in workloads)
    st.max_seq_length = max(st.max_seq_length or 0, longest)
    seconds = {}
    for size, batch in workloads.items():
        st.encode(batch, show_progress_bar=False)
        seconds[size] = []
        for _ in range(reps):
            started = time.perf_counter()
            st.encode(batch, show_progress_bar=False)
            seconds[size].append(time.perf_counter() - started)
    vectors = st.encode(workloads[SHAPES[0]], normalize_embeddings=True, show_progress_bar=False)
    return {"seconds": seconds, "vectors": vectors.tolist(), "max_seq_length": st.max_seq_length}


def worst_cosine(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(((got * want).sum(1) / np.linalg.norm(got, axis=1)
                  / np.linalg.norm(want, axis=1)).min())


def row(shape: str, engine: str, size: tuple[int, int], seconds: list[float]) -> dict:
    return {"model": shape, "engine": engine, "texts": size[0], "tokens": size[1],
            **latency_summary(seconds)}


def _p50(rows: list[dict], shape: str, engine: str, size: tuple[int, int]) -> float | None:
    return next((r["p50_ms"] for r in rows if (r["model"], r["engine"], r["texts"], r["tokens"])
                 == (shape, engine, *size)), None)


def markdown(rows: list[dict]) -> str:
    lines = []
    for shape in dict.fromkeys(r["model"] for r in rows):
        for engine in dict.fromkeys(r["engine"] for r in rows if r["model"] == shape):
            cells = [shape, engine]
            for size in SHAPES:
                mine, theirs = (_p50(rows, shape, e, size) for e in (engine, REFERENCE))
                ratio = "" if engine == REFERENCE or not mine else f" ({theirs / mine:.2f}×)"
                cells.append("–" if mine is None else f"{mine:.1f}{ratio}")
            first = next(r for r in rows if r["model"] == shape and r["engine"] == engine)
            cells += [f"{first['cosine_vs_st']:.5f}" if "cosine_vs_st" in first else "",
                      f"{first['cosine_vs_fp32']:.4f}" if first.get("cosine_vs_fp32") else ""]
            lines.append(cells)
    header = ["model", "engine", *(f"{n}×{t} p50 ms (÷ ST)" for n, t in SHAPES),
              "cosine vs ST", "cosine vs fp32"]
    return table(header, lines)


def plot(rows: list[dict], path: Path) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    engines = [*ENGINES, REFERENCE]
    with figure(path, 1, len(models), figsize=(5 * len(models), 4)) as (_, axes):
        for ax, shape in zip(np.atleast_1d(axes), models, strict=True):
            width = 0.8 / len(engines)
            for k, engine in enumerate(engines):
                ax.bar(np.arange(len(SHAPES)) + width * k,
                       [_p50(rows, shape, engine, size) or 0 for size in SHAPES], width=width,
                       label=engine)
            ax.set_xticks(np.arange(len(SHAPES)) + 0.4 - width / 2, [f"{n}×{t}" for n, t in SHAPES])
            ax.set_yscale("log")
            ax.set_ylabel("p50 ms a call (lower is faster)")
            ax.set_title(f"{shape}: gRPC Embed vs SentenceTransformer.encode", fontsize=8)
            ax.legend(fontsize=7)


def write_docs(page: Path, data: dict, tables: str) -> None:
    """The run's section of `page` (docs/benchmarks.md), and its plot beside the page: one
    section a machine and set of shapes (a shape run alone keeps the other's section)."""
    import importlib.util

    key = f"families {data['shapes']}, {machine(data['environment'])}"
    plot_file = None
    if importlib.util.find_spec("matplotlib"):
        plot_file = f"bench-{slug(key)}.png"
        plot(data["rows"], page.parent / plot_file)
    key, section = docs_section(data, tables, plot_file, key)
    page.write_text(update_page(page.read_text(), key, section, RUNS_MARKER))
