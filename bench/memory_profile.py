"""`attnserve memory-profile`: the peak memory of one batch against its shape.

Each shape (batch × seq_len, with or without every layer's attention maps) runs in a
fresh subprocess, so one shape's heap or arena cannot hide the next. The subprocess
builds the server's own `Runtime` (same provider choice, session options and graphs)
and measures with the server's own `MemoryProbe`: on the CPU the rise of the resident
high-water mark (VmHWM, reset through /proc/self/clear_refs) over the resident set
before the batch, with the heap trimmed first (malloc_trim); on CUDA the rise of the
device memory NVML reports. A shape that fails (killed for memory, say) is reported and
left out.

The measurements are fitted by least squares to

    bytes ≈ a + b·batch·seq + c·batch·heads·seq² + d·batch·heads·seq²·returned_layers

first on all shapes but every third (reporting the relative error on those held out),
then on all of them; the final fit is saved beside the artifact as memory_model.json,
which the server loads to predict each batch's peak (admission, and the metric
attnserve_batch_predicted_memory_bytes beside the measured one).

It prints a table and writes memory_profile.csv, memory_profile.json and
memory_profile.png to --out. It asserts nothing.
"""

import argparse
import csv
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnserve.artifact import load_artifact
from attnserve.server.memory_model import MemoryModel, analytic_bound

REPO = Path(__file__).resolve().parents[1]
# Below this, a measurement is mostly allocator noise: relative errors are reported only
# over shapes whose peak reaches it, and the fit weighs smaller ones as if they were at it.
NOISE_FLOOR_BYTES = 1 << 20
MIB = 1 << 20
COEFFICIENTS = ("a", "b", "c", "d")


@dataclass
class Measurement:
    attention: bool
    batch: int
    seq: int
    returned_layers: int
    peak_bytes: int
    """the largest rise over the runs in the fresh process (the first, in practice)"""
    first_peak_bytes: int
    baseline_bytes: int
    """resident set (CPU) or device memory used (CUDA) just before the first run"""
    seconds: float
    """the fastest run"""
    provider: str
    precision: str
    method: str
    """what the probe measured: see server/memory.py"""


# --- the worker: one shape in a fresh process ---------------------------------------


def measure_shape(artifact_dir: Path, batch: int, seq: int, attention: bool, device: str,
                  precision: str, threads: int, repeats: int) -> Measurement:
    from attnserve.server.memory import MemoryProbe, trim_heap
    from attnserve.server.runtime import CUDA, Runtime

    artifact = load_artifact(artifact_dir)
    manifest = artifact.manifest
    runtime = Runtime(artifact, device, precision, threads)
    probe = MemoryProbe(cuda=runtime.provider == CUDA)
    # The server's warm-up on the CPU: both graphs, one short sequence. (Not its CUDA
    # warm-up at the largest shape, which would leave the arena at that shape's peak.)
    small = np.full((1, 8), manifest.pad_token_id, dtype=np.int64)
    runtime.run(small, np.ones_like(small))
    runtime.run(small, np.ones_like(small), (0,))
    rng = np.random.default_rng(seq * 1000 + batch)
    ids = rng.integers(1000, manifest.vocab_size, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    layers = tuple(range(manifest.num_layers)) if attention else ()
    peaks, times, first_baseline = [], [], None
    for _ in range(repeats):
        trim_heap()  # what set-up and earlier runs freed must not hide this run's need
        baseline = probe.start_batch()
        if first_baseline is None:
            first_baseline = baseline
        started = time.perf_counter()
        out = runtime.run(ids, mask, layers)
        times.append(time.perf_counter() - started)
        peaks.append(probe.batch_peak(baseline))
        del out
    method = ("NVML device memory used, rise" if probe.nvml is not None
              else "VmHWM rise over VmRSS, after malloc_trim" if probe.hwm_resettable
              else "VmRSS rise after the batch (VmHWM not resettable)")
    return Measurement(attention, batch, seq, len(layers), max(peaks), peaks[0],
                       int(first_baseline), min(times), runtime.provider, runtime.precision,
                       method)


def measure_isolated(artifact_dir: Path, batch: int, seq: int, attention: bool, device: str,
                     precision: str, threads: int, repeats: int,
                     timeout_s: float = 900) -> Measurement:
    command = [sys.executable, "-m", "attnserve.bench.memory_profile", "--worker",
               "--artifact", str(Path(artifact_dir).resolve()), "--batch", str(batch),
               "--seq", str(seq), "--device", device, "--precision", precision,
               "--threads", str(threads), "--repeats", str(repeats)]
    if attention:
        command.append("--attention")
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"shape batch={batch} seq={seq} attention={attention}: worker exited "
                           f"{done.returncode}:\n{done.stderr[-3000:]}")
    return Measurement(**json.loads(done.stdout.strip().splitlines()[-1]))


# --- the fit ----------------------------------------------------------------------------


def features(batch: int, seq: int, heads: int, returned_layers: int) -> list[float]:
    quadratic = float(batch) * heads * seq * seq
    return [1.0, float(batch) * seq, quadratic, quadratic * returned_layers]


def fit(rows: list[Measurement], heads: int, with_d: bool) -> np.ndarray:
    """Least squares on relative error (each row weighted by 1/measured, floored at the
    noise floor), with every coefficient kept ≥ 0: a negative term would predict less
    memory for a larger batch. Coefficients that come out negative are dropped and the
    rest refitted."""
    x = np.array([features(r.batch, r.seq, heads, r.returned_layers) for r in rows])
    y = np.array([float(r.peak_bytes) for r in rows])
    weight = 1.0 / np.maximum(y, NOISE_FLOOR_BYTES)
    active = list(range(4 if with_d else 3))
    coef = np.zeros(4)
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] * weight[:, None], y * weight, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        del active[int(np.argmin(solution))]
    return coef


def predict(coef: np.ndarray, row: Measurement, heads: int) -> float:
    return float(np.dot(coef, features(row.batch, row.seq, heads, row.returned_layers)))


def relative_errors(coef: np.ndarray, rows: list[Measurement], heads: int) -> dict:
    """|predicted - measured| / measured over the rows above the noise floor."""
    errors = [abs(predict(coef, r, heads) - r.peak_bytes) / r.peak_bytes
              for r in rows if r.peak_bytes >= NOISE_FLOOR_BYTES]
    return {"shapes": len(rows), "shapes_scored": len(errors),
            "mean_rel_error": float(np.mean(errors)) if errors else None,
            "max_rel_error": float(np.max(errors)) if errors else None}


def fit_with_holdout(rows: list[Measurement], heads: int, every: int) -> dict:
    with_d = any(r.returned_layers for r in rows)
    held = [r for i, r in enumerate(rows) if i % every == every - 1]
    train = [r for i, r in enumerate(rows) if i % every != every - 1]
    holdout = None
    if held and len(train) >= (4 if with_d else 3):
        holdout = relative_errors(fit(train, heads, with_d), held, heads) | {
            "every": every, "train_shapes": len(train)}
    coef = fit(rows, heads, with_d)
    return {"coef": coef, "with_d": with_d, "holdout": holdout,
            "in_sample": relative_errors(coef, rows, heads)}


# --- output -----------------------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(rows: list[Measurement], coef: np.ndarray, heads: int, held: set[int]) -> str:
    header = (f"{'attention':>9} {'batch':>5} {'seq':>5} {'tokens':>7} {'peak MiB':>10} "
              f"{'fit MiB':>10} {'error':>7} {'run s':>8}  held out")
    lines = [header, "-" * len(header)]
    for i, r in enumerate(rows):
        fitted = predict(coef, r, heads)
        error = (fitted - r.peak_bytes) / r.peak_bytes if r.peak_bytes else None
        lines.append(f"{'all' if r.attention else 'none':>9} {r.batch:>5} {r.seq:>5} "
                     f"{r.batch * r.seq:>7} {_mib(r.peak_bytes):>10} {_mib(fitted):>10} "
                     f"{'n/a' if error is None else f'{100 * error:+.0f}%':>7} "
                     f"{r.seconds:>8.3f}  {'yes' if i in held else ''}")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[Measurement], coef: np.ndarray, heads: int) -> None:
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        names = list(asdict(rows[0]))
        writer.writerow(names + ["predicted_bytes"])
        for r in rows:
            writer.writerow([getattr(r, n) for n in names] + [round(predict(coef, r, heads))])


def plot(path: Path, rows: list[Measurement], coef: np.ndarray, heads: int, layers: int,
         held: set[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r.attention for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False,
                             sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, attention in zip(axes[0], modes, strict=True):
        mine = [(i, r) for i, r in enumerate(rows) if r.attention == attention]
        for k, batch in enumerate(sorted({r.batch for _, r in mine})):
            points = sorted((r.seq, r.peak_bytes / MIB, i in held) for i, r in mine
                            if r.batch == batch)
            seqs = [s for s, _, _ in points]
            color = colors[k % len(colors)]
            ax.plot(seqs, [m for _, m, _ in points], "o", color=color, label=f"batch {batch}")
            out = [(s, m) for s, m, h in points if h]
            if out:  # held-out shapes: a white centre
                ax.plot([s for s, _ in out], [m for _, m in out], "o", color="white",
                        markersize=3)
            dense = np.geomspace(min(seqs), max(seqs), 64)
            fitted = [float(np.dot(coef, features(batch, s, heads, layers if attention else 0)))
                      / MIB for s in dense]
            ax.plot(dense, fitted, "-", color=color, alpha=0.6, linewidth=1)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.seq for _, r in mine})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title("all attention maps returned" if attention else "embeddings only")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="measured (dots; hollow: held out), fit (lines)", fontsize=8,
                  title_fontsize=8)
    axes[0][0].set_ylabel("peak memory of one batch (MiB)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command ------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def run_memory_profile(args: argparse.Namespace) -> int:
    artifact = load_artifact(args.artifact)
    manifest = artifact.manifest
    seq_lens = sorted(set(_ints(args.seq_lens)))
    skipped = [s for s in seq_lens if s > manifest.max_positions or s < 1]
    seq_lens = [s for s in seq_lens if s not in skipped]
    batches = sorted(set(_ints(args.batch_sizes)))
    if not seq_lens or not batches or min(batches) < 1:
        print("memory-profile: no shapes to measure (check --seq-lens and --batch-sizes)",
              file=sys.stderr)
        return 2
    if skipped:
        print(f"skipping seq lens {skipped}: over the model's {manifest.max_positions} "
              "positions", file=sys.stderr)
    modes = [False, True] if args.attention else [False]
    shapes = [(a, b, s) for a in modes for b in batches for s in seq_lens]
    rows: list[Measurement] = []
    started = time.monotonic()
    for n, (attention, batch, seq) in enumerate(shapes, 1):
        try:
            row = measure_isolated(artifact.directory, batch, seq, attention, args.device,
                                   args.precision, args.threads, args.repeats)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"[{n}/{len(shapes)}] left out: {err}", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(f"[{n}/{len(shapes)}] attention={'all' if attention else 'none'} batch={batch} "
              f"seq={seq}: {_mib(row.peak_bytes)} MiB, {row.seconds:.3f} s", file=sys.stderr,
              flush=True)
    if not rows:
        print("memory-profile: every shape failed (see above)", file=sys.stderr)
        return 1
    heads, layers = manifest.num_heads, manifest.num_layers
    provider = rows[0].provider
    result = fit_with_holdout(rows, heads, args.holdout_every)
    coef = result["coef"]
    d_source = "fitted"
    if not result["with_d"]:
        # No attention rows measured: the returned maps' term stays the analytic bound's.
        coef[3], d_source = analytic_bound(manifest).d, "analytic bound"
    held = {i for i in range(len(rows)) if i % args.holdout_every == args.holdout_every - 1}
    memory_model = MemoryModel(*(float(c) for c in coef), source=f"fitted on {provider}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{manifest.model_name} on {provider} ({rows[0].precision}): peak memory of one "
             f"batch, each shape in a fresh process")
    write_csv(out / "memory_profile.csv", rows, coef, heads)
    plot(out / "memory_profile.png", rows, coef, heads, layers, held, title)
    model_path = None if args.no_save_model else memory_model.save(artifact.directory)
    report = {
        "model": manifest.model_name, "provider": provider, "precision": rows[0].precision,
        "artifact": str(artifact.directory), "artifact_sha256": artifact.manifest_sha256,
        "heads": heads, "layers": layers, "repeats": args.repeats,
        "measure": rows[0].method,
        "seconds": round(time.monotonic() - started, 1),
        "rows": [asdict(r) | {"predicted_bytes": round(predict(coef, r, heads))} for r in rows],
        "fit": {"formula": "a + b*batch*seq + c*batch*heads*seq^2 "
                           "+ d*batch*heads*seq^2*returned_layers",
                "coefficients": dict(zip(COEFFICIENTS, map(float, coef), strict=True)), "d_source": d_source,
                "weighting": "relative (1/measured, floored at 1 MiB); coefficients >= 0",
                "holdout": result["holdout"], "in_sample": result["in_sample"],
                "noise_floor_bytes": NOISE_FLOOR_BYTES},
        "memory_model": str(model_path) if model_path else None,
    }
    (out / "memory_profile.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"memory profile: {manifest.model_name}, {provider} ({rows[0].precision}), "
          f"{heads} heads, {layers} layers; peak = {rows[0].method}, each shape in a fresh "
          "process")
    print(table(rows, coef, heads, held))
    a, b, c, d = coef
    print(f"fit: bytes ≈ {a:.4g} + {b:.4g}·batch·seq + {c:.4g}·batch·heads·seq² + "
          f"{d:.4g}·batch·heads·seq²·returned_layers  (d: {d_source})")
    holdout = result["holdout"]
    if holdout:
        print(f"held-out error (1 shape in {args.holdout_every} held out, fit on the other "
              f"{holdout['train_shapes']}; {holdout['shapes_scored']} of {holdout['shapes']} "
              f"above {NOISE_FLOOR_BYTES // MIB} MiB scored): mean "
              f"{_pct(holdout['mean_rel_error'])}, max {_pct(holdout['max_rel_error'])}")
    else:
        print("held-out error: n/a (too few shapes to hold any out)")
    print(f"in-sample error (final fit on all {len(rows)} shapes): mean "
          f"{_pct(result['in_sample']['mean_rel_error'])}, max "
          f"{_pct(result['in_sample']['max_rel_error'])}")
    print(f"wrote {out / 'memory_profile.csv'}, {out / 'memory_profile.json'}, "
          f"{out / 'memory_profile.png'}")
    if model_path:
        print(f"memory model saved to {model_path} (the server loads it at start)")
    return 0


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.memory_profile --worker")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    row = measure_shape(args.artifact, args.batch, args.seq, args.attention, args.device,
                        args.precision, args.threads, max(1, args.repeats))
    print(json.dumps(asdict(row)), flush=True)
    return 0


if __name__ == "__main__":
    # Only the per-shape worker runs as a module; people run `attnserve memory-profile`.
    sys.exit(_worker(sys.argv[1:]))
