"""The phases that run in their own process, one engine each:

    python -m bench.phases {peak,memory,torch} SPEC.json OUT.json
    python -m bench.phases worker SPEC.json      (the raw session, driven over stdin)

`peak` imports numpy and torch; `worker` and `memory` onnxruntime (the server's own
backend, or onnxruntime at its default options: bench/engines.py); `torch` our PyTorch
model and sentence-transformers. None imports another's engine, and the torch phase never
runs while the server or the raw worker is up.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.measure import (
    FULL,
    QUICK,
    Reps,
    latency_summary,
    shape_row,
    time_calls,
    time_each,
    workload_row,
)
from bench.workloads import Workload, padded_batch

log = logging.getLogger("bench.phases")


# --- FLOP peak --------------------------------------------------------------------------

def phase_peak(spec: dict) -> dict:
    """float32 matmul 2048 × 2048 at `threads` threads with numpy and with torch."""
    n, threads = 2048, spec["threads"]
    flop = 2 * n ** 3
    reps = 10 if spec["quick"] else 25
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out: dict = {"n": n, "threads": threads, "flop_per_matmul": flop}
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # the env variables set by the parent already cap BLAS threads
        threadpool_limits = None
    matmuls = Reps(reps, reps, 0.0, warmup=2)
    if threadpool_limits is not None:
        with threadpool_limits(threads):
            times = time_calls(lambda: a @ b, matmuls)
    else:
        times = time_calls(lambda: a @ b, matmuls)
    out["numpy_gflops"] = flop / float(np.median(times)) / 1e9
    import torch

    torch.set_num_threads(threads)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    times = time_calls(lambda: ta @ tb, matmuls)
    out["torch_gflops"] = flop / float(np.median(times)) / 1e9
    out["peak_gflops"] = max(out["numpy_gflops"], out["torch_gflops"])
    out["peak_source"] = "torch" if out["torch_gflops"] >= out["numpy_gflops"] else "numpy"
    return out


# --- raw onnxruntime ------------------------------------------------------------------------

def _rss_probe():
    from attnserve.server.memory.probe import MemoryProbe

    return MemoryProbe(cuda=False)


class RawEngine:
    """One engine of the raw side, in-process, by `spec["engine"]` (bench/engines.py):

    - `server`: the server's own backend (its graph, session options and process-wide
      malloc settings);
    - `plain`: that backend serving the unfused graph, in a process of its own (a second
      busy session beside the server's would share its cores' time);
    - `default`: what a user gets calling onnxruntime themselves, `InferenceSession(path)`
      at its default options, on the server's fp32 graph, in a process of its own; also
      with the artifact's tokenizer in front of it (`tokenize=True`: texts in, as the server
      gets them, padded to the longest as a user's script would);
    - `int8`: the server's backend serving the int8 graphs (`export --int8`)."""

    def __init__(self, spec: dict):
        from attnserve.artifact import load_artifact
        from attnserve.server.runtime.backend import create_backend
        from bench.engines import default_session, unfused

        self.workload = Workload.load(spec["workload"])
        self.artifact = load_artifact(spec["artifact"])
        engine = spec.get("engine", "server")
        manifest = self.artifact.manifest
        self.pad = manifest.pad_token_id
        precision = "int8" if engine == "int8" else "fp32"
        if engine == "default":
            from tokenizers import Tokenizer

            from attnserve.artifact import TOKENIZER

            graph = manifest.graph(attention=False, precision="fp32")
            session = default_session(self.artifact.path(graph.file), "cpu")
            self.backend = None
            self.tokenizer = Tokenizer.from_file(str(self.artifact.path(TOKENIZER)))
            self.tokenizer.enable_padding(pad_id=self.pad)
            self.tokenizer.enable_truncation(manifest.max_positions)
            self.run = lambda ids, mask: session.run(["last_hidden_state"],
                                                     {"input_ids": ids, "attention_mask": mask})
        else:
            artifact = unfused(self.artifact) if engine == "plain" else self.artifact
            self.backend = create_backend(artifact, "cpu", precision, spec["threads"])
            graph = artifact.manifest.graph(attention=False, precision=precision)
            self.run = lambda ids, mask: self.backend.run(ids, mask).hidden
        self.info = {"engine": engine, "threads": spec["threads"], "graph": graph.file}
        self.shapes = {s.name: padded_batch(s.inputs.ids, self.pad) for s in self.workload.shapes}
        self.texts = {s.name: s.inputs.texts for s in self.workload.shapes}
        self.batches = {
            "mixed": [padded_batch([self.workload.mixed.ids[i] for i in b], self.pad)
                      for b in self.workload.ideal_batches],
            "short": [padded_batch([self.workload.short.ids[i] for i in b], self.pad)
                      for b in self.workload.short_batches]}
        self.singles = [padded_batch([r], self.pad) for r in self.workload.mixed.ids]

    def shape(self, name: str, calls: int, warmup: int = 0, tokenize: bool = False) -> dict:
        if tokenize:
            texts = self.texts[name]

            def call():
                return self.run(*self._tokenized(texts))
        else:
            ids, mask = self.shapes[name]

            def call():
                return self.run(ids, mask)
        return {"seconds": time_calls(call, Reps(calls, calls, 0.0, warmup=warmup))}

    def _tokenized(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = self.tokenizer.encode_batch(texts)
        return (np.array([e.ids for e in encoded], dtype=np.int64),
                np.array([e.attention_mask for e in encoded], dtype=np.int64))

    def mixed(self, kind: str, texts: str = "mixed") -> dict:
        """One pass over the mixed (or short) texts: ideal batches, or one text at a time."""
        inputs = self.batches[texts] if kind == "ideal" else self.singles
        latencies = time_each(lambda batch: self.run(*batch), inputs)
        return {"run_seconds": sum(latencies), "latencies": latencies,
                "padded_tokens": int(sum(ids.size for ids, _ in inputs))}

    def attention(self, quick: bool) -> dict:
        reps = (QUICK if quick else FULL)["attention"]
        return _attention(self.backend, self.workload, self.pad, self.artifact.manifest.num_layers,
                          reps)


def phase_worker(spec: dict) -> None:
    """A raw session that stays up and measures on command, so that the benchmark can
    alternate it with the server in short blocks: both then see the same machine, on a
    shared one too. One JSON command a line on stdin, one JSON answer a line on stdout."""
    engine = RawEngine(spec)
    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the answer channel
    reply.write(json.dumps({"ready": engine.info}) + "\n")
    reply.flush()
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        answer = getattr(engine, op)(**command)
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


def _attention(backend, workload: Workload, pad: int, num_layers: int, reps) -> dict:
    """Time and output bytes per layer choice (memory: `phase_memory`, a fresh process)."""
    shape = workload.attention
    ids, mask = padded_batch(shape.inputs.ids, pad)
    layers_all = tuple(range(num_layers))
    out = {"shape": shape.name}
    for name, layers in (("none", ()), ("one", (0,)), ("all", layers_all)):
        result = backend.run(ids, mask, layers)
        nbytes = sum(m.nbytes for m in result.attentions.values())
        del result
        row = latency_summary(time_calls(lambda layers=layers: backend.run(ids, mask, layers),
                                         reps))
        row.update(layers=len(layers), output_bytes_fp32=nbytes, output_bytes_fp16=nbytes // 2)
        out[name] = row
        log.info("phase=raw attention=%s p50_ms=%.1f", name, row["p50_ms"])
    return out


def phase_memory(spec: dict) -> dict:
    """Peak memory of ONE call at the attention shape, in a fresh process: the rise of the
    resident high-water mark over the resident set before the call (the server's probe).
    A fresh process because memory a previous call freed stays resident (malloc keeps it)
    and would hide the next call's cost."""
    from attnserve.artifact import load_artifact
    from attnserve.server.runtime.backend import create_backend

    workload = Workload.load(spec["workload"])
    artifact = load_artifact(spec["artifact"])
    backend = create_backend(artifact, "cpu", "fp32", spec["threads"])
    backend.warm_up(backend.warm_up_shapes(0))  # as the server does before serving: both graphs at 1 × 8
    layers = tuple(spec["layers"])
    ids, mask = padded_batch(workload.attention.inputs.ids, artifact.manifest.pad_token_id)
    probe = _rss_probe()
    baseline = probe.start_batch()
    t0 = time.perf_counter()
    result = backend.run(ids, mask, layers)
    seconds = time.perf_counter() - t0
    peak = probe.batch_peak(baseline)
    return {"layers": len(layers), "shape": workload.attention.name, "rss_before": baseline,
            "peak_bytes": peak, "seconds": seconds,
            "output_bytes": int(sum(m.nbytes for m in result.attentions.values()))}


# --- PyTorch: our model, sentence-transformers ---------------------------------------------

def phase_torch(spec: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(spec["threads"])
    workload = Workload.load(spec["workload"])
    reps = QUICK if spec["quick"] else FULL
    runs = reps["workload"].min_reps
    out: dict = {"threads": spec["threads"], "torch": torch.__version__}

    from attnserve.model import load_checkpoint

    model = load_checkpoint(spec.get("checkpoint")).eval()

    def ours(ids: np.ndarray, mask: np.ndarray):
        with torch.inference_mode():
            return model(torch.from_numpy(ids), torch.from_numpy(mask)).last_hidden_state

    out["ours"] = _torch_engine(ours, workload, reps, runs)
    model = None  # free it before sentence-transformers loads

    from sentence_transformers import SentenceTransformer

    from attnserve.model.checkpoint import default_checkpoint_dir

    st = SentenceTransformer(str(spec.get("checkpoint") or default_checkpoint_dir()), device="cpu")
    out["st_max_seq_length_default"] = st.max_seq_length
    # Raised from 256 so the 512-token rows are not cut (DESIGN.md, traps).
    st.max_seq_length = 512
    out["st_token_mismatches"] = _st_mismatches(st, workload)

    def st_encode(texts: list[str]):
        return st.encode(texts, batch_size=max(1, len(texts)), convert_to_numpy=True,
                         show_progress_bar=False)

    rows = {"shapes": {}}
    for shape in workload.shapes:
        seconds = time_calls(lambda texts=shape.inputs.texts: st_encode(texts), reps["shape"])
        rows["shapes"][shape.name] = shape_row(seconds, shape.batch, shape.seq)
        log.info("phase=torch engine=st shape=%s tokens_per_s=%.0f", shape.name,
                 rows["shapes"][shape.name]["tokens_per_s"])
    texts, tokens = workload.mixed.texts, sum(workload.mixed.lengths)
    st_encode(texts[:1])
    passes = [time_each(lambda text: st_encode([text]), texts) for _ in range(runs)]
    rows["mixed_one"] = workload_row([sum(p) for p in passes], [t for p in passes for t in p], tokens)
    run_seconds = time_calls(lambda: st.encode(texts, batch_size=32, convert_to_numpy=True,
                                               show_progress_bar=False), runs)
    rows["mixed_ideal"] = workload_row(run_seconds, run_seconds, tokens)
    out["st"] = rows
    out["onnxruntime_imported"] = "onnxruntime" in sys.modules
    return out


def _torch_engine(run, workload: Workload, reps: dict, runs: int) -> dict:
    rows: dict = {"shapes": {}}
    for shape in workload.shapes:
        ids, mask = padded_batch(shape.inputs.ids)
        seconds = time_calls(lambda ids=ids, mask=mask: run(ids, mask), reps["shape"])
        rows["shapes"][shape.name] = shape_row(seconds, shape.batch, shape.seq)
        log.info("phase=torch engine=ours shape=%s tokens_per_s=%.0f", shape.name,
                 rows["shapes"][shape.name]["tokens_per_s"])
    tokens = sum(workload.mixed.lengths)
    singles = [padded_batch([r]) for r in workload.mixed.ids]
    run(*singles[0])
    batches = [padded_batch([workload.mixed.ids[i] for i in b]) for b in workload.ideal_batches]
    for name, inputs in (("mixed_one", singles), ("mixed_ideal", batches)):
        passes = [time_each(lambda batch: run(*batch), inputs) for _ in range(runs)]
        rows[name] = workload_row([sum(p) for p in passes], [t for p in passes for t in p], tokens)
    return rows


def _st_mismatches(st, workload: Workload) -> int:
    """Texts that sentence-transformers' tokenizer does not turn into the same ids."""
    texts = workload.mixed.texts + [t for s in workload.shapes for t in s.inputs.texts]
    ids = workload.mixed.ids + [i for s in workload.shapes for i in s.inputs.ids]
    bad = 0
    for start in range(0, len(texts), 256):
        features = st.tokenize(texts[start:start + 256])
        mask = features["attention_mask"].numpy().astype(bool)
        got = features["input_ids"].numpy()
        for row, expected in enumerate(ids[start:start + 256]):
            if got[row][mask[row]].tolist() != list(expected):
                bad += 1
    return bad


PHASES = {"peak": phase_peak, "memory": phase_memory, "torch": phase_torch}


def main(argv: list[str]) -> int:
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    if argv[0] == "worker":
        phase_worker(json.loads(Path(argv[1]).read_text()))
        return 0
    name, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    started = time.perf_counter()
    result = PHASES[name](spec)
    result["phase_seconds"] = time.perf_counter() - started
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
