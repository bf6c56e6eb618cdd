"""The GPU benchmark's plan (what it measures, and how much of it: the full run or the CPU
dry run), and its phases that run in this process (`python -m bench gpu`, whose help lists
them), one after another, each freeing its sessions before the next; the torch phase runs
after every onnxruntime phase, so torch is never busy beside onnxruntime.
"""

import copy
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, Artifact, pooled_output
from attnserve.server.runtime.backend import Strategy, create_backend, place
from bench.measure import Budget, Reps, shape_row, time_calls
from bench.raw import default_session
from bench.workloads import SHAPES, TextMaker, Texts, mixed_lengths, padded_batch, shape_name

log = logging.getLogger("bench.gpu")

ONE_CALLER_SHAPES = ((1, 16), (32, 128), (128, 128), (32, 512))
CONCURRENT_SHAPE, CONCURRENT_CALLERS = (32, 128), 16
MIXED_CALLERS = 256
CLIENT_PROCESSES = 6
PARITY_ROWS = 8
"""the mixed texts a parity batch holds: rows of different lengths, padded"""
PRECISIONS = ("fp32", "fp16")
MEMORY_SEQS = (16, 64, 128, 256, 384, 512)
MEMORY_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class Plan:
    """How much of everything: the full run, or the CPU dry run."""

    one_caller_shapes: tuple[tuple[int, int], ...]
    reps: Reps
    concurrent_requests: int
    """requests of 32x128 the 16 callers send in all"""
    concurrent_callers: int
    mixed_texts: int
    mixed_callers: int
    client_processes: int
    server_args: tuple[str, ...]
    raw_sessions: tuple[int, ...]
    backend_shapes: tuple[tuple[int, int], ...]
    """the shapes of the backend's (and the PyTorch model's) tokens/s, per precision"""
    backend_reps: Reps
    memory_seqs: tuple[int, ...]
    memory_batches: tuple[int, ...]
    load_seconds: float
    """how long each load that counts what it gets done runs (lanes in threads, the front
    end's requests/s)"""


FULL = Plan(ONE_CALLER_SHAPES, Reps(10, 400, 1.5, warmup=2, max_seconds=3.0), 640, CONCURRENT_CALLERS,
            8000, MIXED_CALLERS, CLIENT_PROCESSES, (), (1, 2, 4), SHAPES,
            Reps(5, 200, 2.0, max_seconds=float("inf")), MEMORY_SEQS, MEMORY_BATCHES, 2.0)
QUICK = Plan(((1, 16), (32, 128)), Reps(2, 4, 0.0, warmup=1), 4, 2, 48, 8, 2,
             ("--max-batch-size", "4", "--max-batch-tokens", "512"), (1, 2), ((1, 16), (32, 128)),
             Reps(2, 200, 0.2, max_seconds=float("inf")), (16, 64), (1, 4), 0.3)


@dataclass
class Inputs:
    shapes: dict[tuple[int, int], Texts]
    """(batch, seq) -> batch texts of seq tokens each"""
    mixed: Texts
    """lognormal lengths (median 48, 8-256), one text a request"""


def make_inputs(tokenizer: Path, plan: Plan, max_positions: int) -> Inputs:
    maker = TextMaker(tokenizer, seed=0)
    shapes = sorted({*plan.one_caller_shapes, CONCURRENT_SHAPE, *plan.backend_shapes})
    made = {(batch, seq): maker.make([seq] * batch) for batch, seq in shapes}
    lengths = [min(n, max_positions) for n in mixed_lengths(plan.mixed_texts, seed=0)]
    return Inputs(made, maker.make(lengths))


MEAN = pooled_output("mean", False)
POOLED = frozenset({MEAN})
ONE_LANE = Strategy(sessions=1)
FIXED_BUFFERS = Strategy(sessions=1, shape_buckets="on", cuda_graphs=True)
"""IO-bound buffers per shape; on CUDA a graph captured per shape over them"""


def _feed(batch: tuple[np.ndarray, np.ndarray]) -> dict:
    return {"input_ids": batch[0], "attention_mask": batch[1]}


def parity(reference: np.ndarray, other: np.ndarray, mask: np.ndarray) -> dict:
    """Max abs difference over real tokens, and the worst cosine of mean-pooled vectors."""
    real = mask.astype(bool)
    ref, oth = reference.astype(np.float32), other.astype(np.float32)
    weights = mask[..., None].astype(np.float32)
    pooled_ref = (ref * weights).sum(1) / weights.sum(1)
    pooled_oth = (oth * weights).sum(1) / weights.sum(1)
    cos = (pooled_ref * pooled_oth).sum(1) / (np.linalg.norm(pooled_ref, axis=1)
                                             * np.linalg.norm(pooled_oth, axis=1))
    return {"max_abs_error": float(np.abs(ref[real] - oth[real]).max()),
            "min_pooled_cosine": float(cos.min())}


def parity_batch(inputs: Inputs, pad: int) -> tuple[np.ndarray, np.ndarray]:
    return padded_batch(inputs.mixed.ids[:PARITY_ROWS], pad)


# --- backend -----------------------------------------------------------------------------------

def backend_phase(artifact: Artifact, device: str, plan: Plan, inputs: Inputs, budget: Budget) -> dict:
    manifest = artifact.manifest
    ids, mask = parity_batch(inputs, manifest.pad_token_id)
    batches = {shape: padded_batch(inputs.shapes[shape].ids, manifest.pad_token_id)
               for shape in plan.backend_shapes}
    reference = create_backend(artifact, "cpu", "fp32", 0, ONE_LANE)
    want = reference.run(ids, mask).hidden, reference.run(ids, mask, (0,)).attentions[0]
    del reference
    out: dict = {"parity": {}, "throughput": {}}
    for precision in PRECISIONS:
        if manifest.graph(attention=False, precision=precision) is None:
            out["parity"][precision] = f"no {precision} graphs (export --{precision})"
            continue
        out["parity"][precision], out["throughput"][precision] = _backend_rows(
            create_backend(artifact, device, precision), want, (ids, mask), batches, plan, budget)
    return out


def _backend_rows(backend, want: tuple[np.ndarray, np.ndarray], batch: tuple[np.ndarray, np.ndarray],
                  batches: dict, plan: Plan, budget: Budget) -> tuple[dict, dict]:
    """(parity, tokens/s per shape) of one backend, freed on return."""
    ids, mask = batch
    check = parity(want[0], backend.run(ids, mask).hidden, mask)
    check["attention_layer0_max_abs_error"] = float(
        np.abs(want[1] - backend.run(ids, mask, (0,)).attentions[0]).max())
    log.info("phase=backend precision=%s parity %s", backend.precision, check)
    rows: dict = {}
    for shape in plan.backend_shapes:
        name = shape_name(*shape)
        if not budget.enough(60):
            rows[name] = "skipped: time budget"
            continue
        seconds = time_calls(lambda feed=batches[shape]: backend.run(*feed), plan.backend_reps,
                             keep_going=lambda: budget.enough(30))
        rows[name] = shape_row(seconds, *shape)
        log.info("phase=backend precision=%s shape=%s p50_ms=%.3f", backend.precision, name,
                 rows[name]["p50_ms"])
    return check, rows


# --- raw ---------------------------------------------------------------------------------------

def raw_phase(artifact: Artifact, device: str, plan: Plan, inputs: Inputs, budget: Budget) -> dict:
    """onnxruntime at its default options on the served graph, then the backend's sessions
    and fixed buffers; every session freed on return, before any server starts."""
    precision = place(artifact, device).precision
    graph = artifact.manifest.graph(attention=False, precision=precision)
    pad = artifact.manifest.pad_token_id
    batches = {shape: padded_batch(texts.ids, pad) for shape, texts in inputs.shapes.items()}
    out: dict = {"graph": graph.file, "sessions": {}, "bound": {},
                 **_default_rows(default_session(artifact.path(graph.file), device), plan, batches)}
    ids, mask = batches[CONCURRENT_SHAPE]
    for count in plan.raw_sessions:
        if budget.left() < 150:
            break
        row = lanes_in_threads(create_backend(artifact, device, precision, 0, Strategy(sessions=count)),
                               ids, mask, plan.load_seconds)
        out["sessions"][str(count)] = row
        log.info("phase=raw sessions=%d tokens_per_s=%.0f", count, row["tokens_per_s"])
    if budget.left() >= 140:
        out["bound"] = bound(artifact, device, precision, plan, batches)
    return out


def _default_rows(session, plan: Plan, batches: dict) -> dict:
    """One caller's p50 at each shape, the hidden state out and the pooled vector alone,
    and the pooled vectors of the concurrent batch (what the servers are compared to)."""
    out: dict = {"shapes": {}, "pooled_only": {}}
    for shape in plan.one_caller_shapes:
        feed = _feed(batches[shape])
        for key, names in (("shapes", [HIDDEN_OUTPUT]), ("pooled_only", [MEAN])):
            seconds = time_calls(lambda feed=feed, names=names: session.run(names, feed), plan.reps)
            out[key][shape_name(*shape)] = shape_row(seconds, *shape)
        log.info("phase=raw shape=%s hidden_p50_ms=%.3f pooled_p50_ms=%.3f", shape_name(*shape),
                 out["shapes"][shape_name(*shape)]["p50_ms"],
                 out["pooled_only"][shape_name(*shape)]["p50_ms"])
    out["reference_pooled"] = session.run([MEAN], _feed(batches[CONCURRENT_SHAPE]))[0].tolist()
    return out


def lanes_in_threads(backend, ids: np.ndarray, mask: np.ndarray, seconds: float) -> dict:
    """Each of the backend's lanes in a thread of its own, back to back on one batch (the
    pooled vector out) for `seconds`, started together once every lane has run it once."""
    counts = [0] * backend.concurrency
    clock: dict[str, float] = {}

    def start() -> None:
        clock["start"] = time.perf_counter()
        clock["stop"] = clock["start"] + seconds

    ready = threading.Barrier(backend.concurrency, action=start)

    def loop(k: int) -> None:
        backend.bind_thread()
        backend.run(ids, mask, outputs=POOLED)
        ready.wait()
        while time.perf_counter() < clock["stop"]:
            backend.run(ids, mask, outputs=POOLED)
            counts[k] += 1

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(backend.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - clock["start"]
    return {"batches": sum(counts), "seconds": elapsed, "tokens_per_s": sum(counts) * ids.size / elapsed}


def bound(artifact: Artifact, device: str, precision: str, plan: Plan, batches: dict) -> dict:
    """The pooled vector through fixed IO-bound buffers, against the backend without them
    (one lane each): `io_binding` alone (CUDA), then the backend's --cuda-graphs strategy
    (a graph per shape on CUDA; on the CPU the buffers alone)."""
    from attnserve.server.runtime.onnx import BoundRunner

    plain = create_backend(artifact, device, precision, 0, ONE_LANE)
    shapes = plan.one_caller_shapes[:2]
    want = {shape: plain.run(*batches[shape], outputs=POOLED).pooled[MEAN] for shape in shapes}

    def io_binding():
        # No strategy binds buffers without capturing a graph on CUDA: the server's runner
        # over the backend's own session.
        runner = BoundRunner(plain.lanes[0].embed.session, device, artifact.manifest, False)
        return runner.warm, lambda ids, mask: runner.run(ids, mask, [MEAN])[MEAN]

    def fixed_buffers():
        backend = create_backend(artifact, device, precision, 0, FIXED_BUFFERS)
        return (lambda ids, mask: backend.warm_up([ids.shape]),
                lambda ids, mask: backend.run(ids, mask, outputs=POOLED).pooled[MEAN])

    kinds = {"io_binding": io_binding, "cuda_graph": fixed_buffers} if device == "cuda" else {
        "fixed_buffers_cpu": fixed_buffers}
    out: dict = {}
    for kind, make in kinds.items():
        rows: dict = {}
        try:
            warm, run = make()
            for shape in shapes:
                warm(*batches[shape])
                got = run(*batches[shape])
                seconds = time_calls(lambda batch=batches[shape], run=run: run(*batch), plan.reps)
                rows[shape_name(*shape)] = shape_row(seconds, *shape) | {
                    "max_abs_diff_vs_plain": float(np.abs(got - want[shape]).max())}
        except Exception as err:  # e.g. a node onnxruntime keeps on the CPU: no CUDA graph
            log.exception("event=raw_bound_failed kind=%s", kind)
            rows = {"error": f"{err.__class__.__name__}: {err}"}
        out[kind] = rows
        log.info("phase=raw bound kind=%s %s", kind, rows)
    return out


# --- memory ------------------------------------------------------------------------------------

def memory_phase(artifact: Artifact, device: str, plan: Plan, budget: Budget) -> dict:
    """Per precision: the peak of each shape on its own, as `attnserve memory-profile`
    measures it (on CUDA a fresh backend per shape: its arena's growth over one run; on the
    CPU memray's count of one run's allocations), never the growth of one arena across a
    sequence of shapes, which hides every shape that fits in what an earlier one left."""
    from attnserve import memory_profile
    from attnserve.server.memory.fit import fit_with_holdout, predict

    manifest = artifact.manifest
    heads = manifest.num_heads
    out: dict = {}
    for precision in ("fp16", "fp32"):
        if manifest.graph(attention=False, precision=precision) is None:
            out[precision] = {"skipped": f"no {precision} graphs"}
            continue
        if not budget.enough(60):
            out[precision] = {"skipped": "time budget"}
            continue
        shapes = memory_profile.shapes_for(True, list(plan.memory_seqs), list(plan.memory_batches),
                                           manifest.num_layers)
        rows, left_out = memory_profile.measure_shapes(
            artifact.directory, shapes, device, precision, threads=0, repeats=1, time_runs=1,
            timeout_s=max(30.0, budget.left() - 45), progress=lambda m: log.info("event=memory %s", m))
        if not rows:
            out[precision] = {"error": "every shape failed", "left_out": left_out}
            continue
        fitted = fit_with_holdout(rows, heads, 3)
        fits = fitted["fits"]
        log.info("event=memory_fit precision=%s holdout=%s", precision, fitted["holdout"])
        out[precision] = {
            "method": rows[0].method, "provider": rows[0].provider,
            "rows": [{"graph": r.graph, "maps": r.returned_layers, "batch": r.batch, "seq": r.seq,
                      "peak_bytes": r.peak_bytes, "predicted_bytes": round(predict(fits[r.graph], r, heads)),
                      "held_out": i in fitted["held"]} for i, r in enumerate(rows)],
            "fit": {kind: [list(map(float, phase)) for phase in phases] for kind, phases in fits.items()},
            "holdout": fitted["holdout"], "in_sample": fitted["in_sample"], "left_out": left_out}
    return out


# --- torch ---------------------------------------------------------------------------------------

MEMORY_BATCH = max(MEMORY_BATCHES)


def torch_phase(checkpoint: str | None, device: str, plan: Plan, inputs: Inputs, budget: Budget) -> dict:
    """Our PyTorch model on the device, weights from the checkpoint the artifact was exported
    from: fp32 on the device against the CPU and fp16 against fp32 on one ragged batch,
    tokens/s at the fixed shapes, and torch.cuda.max_memory_allocated against seq_len."""
    import torch

    from attnserve.model import load_checkpoint

    if device == "cuda" and not torch.cuda.is_available():
        return {"error": "torch.cuda.is_available() is False"}
    dev = torch.device(device)
    model = load_checkpoint(checkpoint).eval().to(dev)
    config = model.config
    out: dict = {"torch": torch.__version__, "device": str(dev),
                 "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "parity": {}, "throughput": {}, "memory": {}}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward(m, ids: np.ndarray, mask: np.ndarray, attentions: bool = False):
        with torch.inference_mode():
            return m(torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev),
                     output_attentions=attentions)

    def hidden(m, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return forward(m, ids, mask).last_hidden_state.float().cpu().numpy()

    ids, mask = parity_batch(inputs, config.pad_token_id)
    reference = hidden(model, ids, mask)
    half = model  # fp16 matmuls are CUDA's; on the CPU the dry run stays fp32
    if device == "cuda":
        out["parity"]["fp32_cuda_vs_cpu"] = parity(hidden(load_checkpoint(checkpoint).eval(), ids, mask),
                                                   reference, mask)
        half = copy.deepcopy(model).half()
    out["parity"]["fp16_vs_fp32"] = parity(reference, hidden(half, ids, mask), mask)
    log.info("phase=torch parity %s", out["parity"])
    for precision, m in (("fp32", model), ("fp16", half)):
        rows: dict = {}
        for shape in plan.backend_shapes:
            if not budget.enough(60):
                rows[shape_name(*shape)] = "skipped: time budget"
                continue
            batch = padded_batch(inputs.shapes[shape].ids, config.pad_token_id)
            seconds = time_calls(lambda b=batch, m=m: forward(m, *b), plan.backend_reps, sync=sync,
                                 keep_going=lambda: budget.enough(30))
            rows[shape_name(*shape)] = shape_row(seconds, *shape)
            log.info("phase=torch precision=%s shape=%s p50_ms=%.3f", precision, shape_name(*shape),
                     rows[shape_name(*shape)]["p50_ms"])
        out["throughput"][precision] = rows
    if device == "cuda":
        for precision, m in (("fp32", model), ("fp16", half)):
            for attentions in (False, True):
                name = f"{precision}_{'attentions' if attentions else 'embeddings'}"
                out["memory"][name] = rows = {}
                for seq in plan.memory_seqs:
                    if not budget.enough(30):
                        rows[str(seq)] = "skipped: time budget"
                        continue
                    # Random ids: the memory a batch takes depends on its shape alone.
                    ids = np.random.default_rng(seq).integers(1000, config.vocab_size, (MEMORY_BATCH, seq))
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    result = forward(m, ids, np.ones_like(ids), attentions)
                    torch.cuda.synchronize()
                    rows[str(seq)] = {"batch": MEMORY_BATCH,
                                      "peak_above_weights_bytes": torch.cuda.max_memory_allocated() - base}
                    del result
                log.info("phase=torch memory %s %s", name, rows)
    return out
