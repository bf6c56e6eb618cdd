"""The engines measured without a server, each in a process of its own (spawned), so that
torch and onnxruntime are never busy in one process:

- the server's own backend (`create_backend`: its graph, session options and process-wide
  malloc settings), on the served graph, on the unfused one (`unfused`), or on the int8
  graphs: what `attnserve serve` runs;
- `default_session`, onnxruntime's `InferenceSession(path)` at its default options: what a
  user calling onnxruntime gets, the one session bench/ opens itself;
- our PyTorch model and sentence-transformers (`torch_baselines`);
- the machine's fp32 matmul peak (`peak`).

`Worker` keeps one onnxruntime engine up and measures on command, so that a benchmark can
alternate it with a server in short blocks; `isolated` runs one function in a fresh process.
"""

import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from attnserve.artifact import TOKENIZER, Artifact, load_artifact
from bench.measure import Reps, latency_summary, shape_row, time_calls, time_each, workload_row
from bench.workloads import Workload, padded_batch

log = logging.getLogger("bench.raw")
SPAWN = multiprocessing.get_context("spawn")

REPS = {"full": {"shape": Reps(5, 30, 3.0), "workload": Reps(3, 3, 0.0, warmup=0),
                 "attention": Reps(3, 10, 2.0)},
        "quick": {"shape": Reps(3, 10, 1.0), "workload": Reps(2, 2, 0.0, warmup=0),
                  "attention": Reps(2, 4, 0.5)}}


def reps(quick: bool) -> dict[str, Reps]:
    return REPS["quick" if quick else "full"]


def default_session(path: Path, device: str):
    """`InferenceSession(path)` with nothing set, as a user calling onnxruntime writes it:
    on `device` cuda with the CUDA provider first (and the CUDA libraries loaded, as
    onnxruntime's install notes say), refused when onnxruntime places the graph elsewhere,
    so the reference never runs on the CPU unnoticed."""
    import onnxruntime as ort

    from attnserve.server.runtime.onnx import CPU, CUDA, preload_cuda_libraries

    if device != "cuda":
        return ort.InferenceSession(str(path), providers=[CPU])
    preload_cuda_libraries()
    session = ort.InferenceSession(str(path), providers=[CUDA, CPU])
    if CUDA not in session.get_providers():
        raise RuntimeError(f"{path.name}: onnxruntime did not place it on {CUDA}")
    return session


def unfused(artifact: Artifact) -> Artifact:
    """`artifact` as if export had kept no optimised graph: the backend built on it serves
    the plain `encoder.onnx`, everything else as the server has it."""
    graphs = [g for g in artifact.manifest.graphs if not g.optimized]
    return replace(artifact, manifest=replace(artifact.manifest, graphs=graphs))


def _logging() -> None:
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")


def isolated(function, *args, env: dict[str, str] | None = None):
    """`function(*args)` in a fresh process, started with `env` added to this one's."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with ProcessPoolExecutor(1, mp_context=SPAWN, initializer=_logging) as pool:
            return pool.submit(function, *args).result()  # the process starts here, with env
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass(frozen=True)
class Engine:
    artifact: Path
    workload: Workload
    threads: int
    kind: str = "server"
    """server: the server's backend; plain: on the unfused graph; int8: on the int8 graphs;
    default: onnxruntime at its default options on the server's fp32 graph"""


class RawEngine:
    """One engine, in this process. `default` also runs with the artifact's tokenizer in
    front of it (`tokenize=True`: texts in, as the server gets them, padded to the longest
    as a user's script would)."""

    def __init__(self, spec: Engine):
        from attnserve.server.runtime.backend import create_backend

        self.workload, self.artifact = spec.workload, load_artifact(spec.artifact)
        manifest = self.artifact.manifest
        self.pad = manifest.pad_token_id
        precision = "int8" if spec.kind == "int8" else "fp32"
        if spec.kind == "default":
            from tokenizers import Tokenizer

            graph = manifest.graph(attention=False, precision="fp32")
            session = default_session(self.artifact.path(graph.file), "cpu")
            self.backend = None
            self.tokenizer = Tokenizer.from_file(str(self.artifact.path(TOKENIZER)))
            self.tokenizer.enable_padding(pad_id=self.pad)
            self.tokenizer.enable_truncation(manifest.max_positions)
            self.run = lambda ids, mask: session.run(["last_hidden_state"],
                                                     {"input_ids": ids, "attention_mask": mask})
        else:
            artifact = unfused(self.artifact) if spec.kind == "plain" else self.artifact
            self.backend = create_backend(artifact, "cpu", precision, spec.threads)
            graph = artifact.manifest.graph(attention=False, precision=precision)
            self.run = lambda ids, mask: self.backend.run(ids, mask).hidden
        self.info = {"engine": spec.kind, "threads": spec.threads, "graph": graph.file}
        w = self.workload
        self.shapes = {s.name: padded_batch(s.inputs.ids, self.pad) for s in w.shapes}
        self.texts = {s.name: s.inputs.texts for s in w.shapes}
        self.batches = {
            "mixed": [padded_batch([w.mixed.ids[i] for i in b], self.pad) for b in w.ideal_batches],
            "short": [padded_batch([w.short.ids[i] for i in b], self.pad) for b in w.short_batches]}
        self.singles = [padded_batch([r], self.pad) for r in w.mixed.ids]

    def shape(self, name: str, calls: int, warmup: int = 0, tokenize: bool = False) -> list[float]:
        """Seconds of each of `calls` runs of the shape `name`."""
        texts, (ids, mask) = self.texts[name], self.shapes[name]
        if tokenize:
            def call():
                encoded = self.tokenizer.encode_batch(texts)
                return self.run(np.array([e.ids for e in encoded], dtype=np.int64),
                                np.array([e.attention_mask for e in encoded], dtype=np.int64))
        else:
            def call():
                return self.run(ids, mask)
        return time_calls(call, Reps(calls, calls, 0.0, warmup=warmup))

    def mixed(self, kind: str, texts: str = "mixed") -> dict:
        """One pass over the mixed (or short) texts: ideal batches, or one text at a time."""
        inputs = self.batches[texts] if kind == "ideal" else self.singles
        latencies = time_each(lambda batch: self.run(*batch), inputs)
        return {"run_seconds": sum(latencies), "latencies": latencies,
                "padded_tokens": int(sum(ids.size for ids, _ in inputs))}

    def attention(self, quick: bool) -> dict:
        """Time and output bytes per choice of layers at the attention shape (its memory:
        `attention_memory`, a fresh process each)."""
        shape = self.workload.attention
        ids, mask = padded_batch(shape.inputs.ids, self.pad)
        out = {"shape": shape.name}
        for name, layers in (("none", ()), ("one", (0,)),
                             ("all", tuple(range(self.artifact.manifest.num_layers)))):
            result = self.backend.run(ids, mask, layers)
            nbytes = sum(m.nbytes for m in result.attentions.values())
            del result
            seconds = time_calls(lambda layers=layers: self.backend.run(ids, mask, layers),
                                 reps(quick)["attention"])
            out[name] = latency_summary(seconds) | {"layers": len(layers), "output_bytes_fp32": nbytes,
                                                    "output_bytes_fp16": nbytes // 2}
            log.info("phase=raw attention=%s p50_ms=%.1f", name, out[name]["p50_ms"])
        return out


_engine: RawEngine | None = None


def _start(spec: Engine) -> None:
    global _engine
    _logging()
    _engine = RawEngine(spec)


def _command(op: str, kwargs: dict):
    return _engine.info if op == "info" else getattr(_engine, op)(**kwargs)


class Worker:
    """A RawEngine in a process of its own that stays up and measures on command."""

    def __init__(self, spec: Engine):
        self.pool = ProcessPoolExecutor(1, mp_context=SPAWN, initializer=_start, initargs=(spec,))
        self.info = self.call("info")

    def call(self, op: str, **kwargs):
        return self.pool.submit(_command, op, kwargs).result()

    def close(self) -> None:
        self.pool.shutdown()


def attention_memory(artifact: Path, workload: Workload, threads: int, layers: list[int]) -> dict:
    """Peak memory of ONE call at the attention shape (run it `isolated`: memory a previous
    call freed stays resident, malloc keeps it, and would hide the next call's cost): the
    rise of the resident high-water mark over the resident set before it (the server's
    probe)."""
    from attnserve.server.memory.probe import MemoryProbe
    from attnserve.server.runtime.backend import create_backend

    loaded = load_artifact(artifact)
    backend = create_backend(loaded, "cpu", "fp32", threads)
    backend.warm_up(backend.warm_up_shapes(0))  # as the server does before serving: both graphs at 1 × 8
    ids, mask = padded_batch(workload.attention.inputs.ids, loaded.manifest.pad_token_id)
    probe = MemoryProbe(cuda=False)
    baseline = probe.start_batch()
    t0 = time.perf_counter()
    result = backend.run(ids, mask, tuple(layers))
    return {"layers": len(layers), "shape": workload.attention.name, "rss_before": baseline,
            "peak_bytes": probe.batch_peak(baseline), "seconds": time.perf_counter() - t0,
            "output_bytes": int(sum(m.nbytes for m in result.attentions.values()))}


def peak(threads: int, quick: bool) -> dict:
    """float32 matmul 2048 × 2048 at `threads` threads with numpy and with torch (run it
    `isolated` with the BLAS thread variables set)."""
    from threadpoolctl import threadpool_limits

    n = 2048
    flop = 2 * n ** 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    matmuls = Reps(10 if quick else 25, 10 if quick else 25, 0.0, warmup=2)
    with threadpool_limits(threads):
        numpy_gflops = flop / float(np.median(time_calls(lambda: a @ b, matmuls))) / 1e9
    import torch

    torch.set_num_threads(threads)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    torch_gflops = flop / float(np.median(time_calls(lambda: ta @ tb, matmuls))) / 1e9
    return {"n": n, "threads": threads, "flop_per_matmul": flop, "numpy_gflops": numpy_gflops,
            "torch_gflops": torch_gflops, "peak_gflops": max(numpy_gflops, torch_gflops),
            "peak_source": "torch" if torch_gflops >= numpy_gflops else "numpy"}


def torch_baselines(workload: Workload, threads: int, quick: bool, checkpoint: str | None) -> dict:
    """Our PyTorch model (eager) and sentence-transformers at its defaults, on the shapes,
    the mixed texts one at a time and ideally batched (run it `isolated`, with no server or
    onnxruntime worker up)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    from attnserve.model import load_checkpoint
    from attnserve.model.checkpoint import default_checkpoint_dir

    torch.set_num_threads(threads)
    shape_reps, runs = reps(quick)["shape"], reps(quick)["workload"].min_reps
    texts, tokens = workload.mixed.texts, sum(workload.mixed.lengths)
    out: dict = {"threads": threads, "torch": torch.__version__}
    model = load_checkpoint(checkpoint).eval()

    def ours(ids: np.ndarray, mask: np.ndarray):
        with torch.inference_mode():
            return model(torch.from_numpy(ids), torch.from_numpy(mask)).last_hidden_state

    rows: dict = {"shapes": {}}
    for shape in workload.shapes:
        ids, mask = padded_batch(shape.inputs.ids)
        rows["shapes"][shape.name] = shape_row(time_calls(lambda ids=ids, mask=mask: ours(ids, mask),
                                                          shape_reps), shape.batch, shape.seq)
    singles = [padded_batch([r]) for r in workload.mixed.ids]
    ours(*singles[0])
    batches = [padded_batch([workload.mixed.ids[i] for i in b]) for b in workload.ideal_batches]
    for name, inputs in (("mixed_one", singles), ("mixed_ideal", batches)):
        passes = [time_each(lambda batch: ours(*batch), inputs) for _ in range(runs)]
        rows[name] = workload_row([sum(p) for p in passes], [t for p in passes for t in p], tokens)
    out["ours"], model = rows, None  # freed before sentence-transformers loads

    st = SentenceTransformer(str(checkpoint or default_checkpoint_dir()), device="cpu")
    out["st_max_seq_length_default"] = st.max_seq_length
    st.max_seq_length = 512  # from 256, so that the 512-token rows are not cut
    out["st_token_mismatches"] = _st_mismatches(st, workload)

    def encode(batch: list[str], size: int | None = None):
        return st.encode(batch, batch_size=size or max(1, len(batch)), convert_to_numpy=True,
                         show_progress_bar=False)

    rows = {"shapes": {s.name: shape_row(time_calls(lambda s=s: encode(s.inputs.texts), shape_reps),
                                         s.batch, s.seq) for s in workload.shapes}}
    encode(texts[:1])
    passes = [time_each(lambda text: encode([text]), texts) for _ in range(runs)]
    rows["mixed_one"] = workload_row([sum(p) for p in passes], [t for p in passes for t in p], tokens)
    run_seconds = time_calls(lambda: encode(texts, 32), runs)
    rows["mixed_ideal"] = workload_row(run_seconds, run_seconds, tokens)
    out["st"] = rows
    out["onnxruntime_imported"] = "onnxruntime" in sys.modules
    return out


def _st_mismatches(st, workload: Workload) -> int:
    """Texts that sentence-transformers' tokenizer does not turn into the same ids."""
    texts = workload.mixed.texts + [t for s in workload.shapes for t in s.inputs.texts]
    ids = workload.mixed.ids + [i for s in workload.shapes for i in s.inputs.ids]
    bad = 0
    for start in range(0, len(texts), 256):
        features = st.tokenize(texts[start:start + 256])
        mask = features["attention_mask"].numpy().astype(bool)
        got = features["input_ids"].numpy()
        bad += sum(got[row][mask[row]].tolist() != list(expected)
                   for row, expected in enumerate(ids[start:start + 256]))
    return bad
