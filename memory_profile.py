"""`attnserve memory-profile`: the peak memory of one batch against its shape, and the
memory model fitted to it.

Shapes: every batch size × sequence length up to --max-tokens (batch × seq) through the
embeddings graph (a reranker's: its scores graph, on pairs of its two segments) and,
with --attention, through the attention graph, returning every
layer's maps or only the first layer's, alternately along the diagonals of the grid (so
the fit can tell maps held for the request, d, from the scores every layer makes, c).
The peak is linear in the batch, so the grid leaves out its large-batch, long-length
corner, which would take most of the time and add nothing the fit needs.

What one shape's peak is (`PeakMeter`, in a worker process that measures every shape):

* CPU: the high-water mark of the bytes the run has allocated and not yet freed, counted
  allocation by allocation by memray's native tracking (malloc, calloc, realloc,
  posix_memalign, aligned_alloc, mmap … of every thread, without Python stacks) from the
  moment the run starts: onnxruntime's intermediate tensors, its outputs and the numpy
  arrays they come back in. Memory the allocator hands out again counts again, so the
  figure does not depend on what ran before, and a rerun gives the same bytes.
  The shapes run through the server's own backend (server/runtime/backend.py), with its
  session options: onnxruntime's CPU arena and memory patterns off, so each tensor is an
  allocation of its own (with an arena, its growth would be counted, which depends on what
  ran before and on its rounding).
* CUDA: a fresh backend per shape (its sessions' arena grown by what is asked:
  kSameAsRequested), run once at a tiny shape so cuBLAS/cuDNN workspaces exist, then the
  shape; the rise of the device memory NVML reports in use over the run is the arena's
  growth to the shape's peak. NVML counts the whole GPU: run it on an idle one.

The measurements are fitted per graph by least squares on relative error, every
coefficient ≥ 0, as one phase or the larger of two (server/memory/fit.py; model.py gives
the form and what each term stands for): first on the shapes off one diagonal in three of
the batch × seq grid, to report the error on those held out, then on all of them. The
final fits are saved beside the artifact in memory_model.json under
`provider/precision/graph` (other providers' entries are kept), which the server loads
to admit batches and to predict each one's peak.

It prints a table (and, when --out already holds a run of the same shapes, how far this
run is from it) and writes memory_profile.csv, memory_profile.json and memory_profile.png
to --out. It asserts nothing. (How the fit holds up under a served mixed load, measured ÷
predicted per bucket, is `python -m bench memory-load` in a checkout.)
"""

import argparse
import csv
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnserve.artifact import LOGITS_OUTPUT, MEMORY_MODEL, RERANKER, load_artifact
from attnserve.server.memory.fit import NOISE_FLOOR_BYTES, features, fit_with_holdout, formula, predict
from attnserve.server.memory.model import (
    ATTENTION,
    EMBEDDINGS,
    SCORES,
    MemoryModel,
    graph_kinds,
    model_key,
    save_entries,
)

log = logging.getLogger("attnserve.memory_profile")

MIB = 1 << 20
CPU_METHOD = ("memray native tracking: high-water mark of the bytes allocated and not yet "
              "freed during the run (every thread; onnxruntime's CPU arena off)")
CUDA_METHOD = ("fresh backend per shape (arena kSameAsRequested), warmed at 1x8: rise of the "
               "device memory in use (NVML) over the run")


@dataclass(frozen=True)
class Shape:
    graph: str
    """embeddings, attention or scores"""
    batch: int
    seq: int
    returned_layers: int


@dataclass
class Measurement:
    graph: str
    batch: int
    seq: int
    returned_layers: int
    peak_bytes: int
    """the largest over the runs"""
    run_peaks: list[int]
    seconds: float
    """the fastest run (under memray's tracking on the CPU: slower than serving)"""
    provider: str
    precision: str
    graph_file: str
    method: str

    @property
    def shape(self) -> Shape:
        return Shape(self.graph, self.batch, self.seq, self.returned_layers)


# --- the worker: every shape, one process -------------------------------------------------


class PeakMeter:
    """The artifact's graphs on one device, through the server's own backend, and one
    shape's peak (module docstring)."""

    def __init__(self, artifact_dir: Path, device: str, precision: str, threads: int):
        from attnserve.server.memory.probe import MemoryProbe
        from attnserve.server.runtime.backend import place

        self.artifact = load_artifact(artifact_dir)
        self.manifest = self.artifact.manifest
        self.device, self.threads = device, threads
        placement = place(self.artifact, device, precision)
        self.provider, self.precision = placement.provider, placement.precision
        self.cuda = placement.device == "cuda"
        self.probe = MemoryProbe(cuda=True) if self.cuda else None
        self.kinds = graph_kinds(self.manifest)
        self.graphs = {kind: self.manifest.graph(attention=kind == ATTENTION,
                                                 precision=self.precision).file
                       for kind in self.kinds}
        # On the CPU one backend serves every shape: memray's count does not depend on
        # what ran before. On CUDA each shape gets a backend (its sessions, its arena) of
        # its own.
        self.backend = None if self.cuda else self._backend()

    def _backend(self):
        from attnserve.server.runtime.backend import Strategy, create_backend

        # One lane, no shape buckets: one session per graph, each shape run as it is.
        backend = create_backend(self.artifact, self.device, self.precision, self.threads,
                                 Strategy(shape_buckets="off", sessions=1))
        for kind in self.kinds:  # kernels, thread pool, workspaces
            self._run(backend, kind, *self._inputs(1, 8), 1)
        return backend

    def _inputs(self, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seq * 1000 + batch)
        # Ordinary tokens: past the special and unused entries a vocabulary starts with
        # (BERT's first thousand), or in the upper half of a small one.
        vocab = self.manifest.vocab_size
        ids = rng.integers(min(1000, vocab // 2), vocab, size=(batch, seq), dtype=np.int64)
        return ids, np.ones_like(ids)

    @staticmethod
    def _run(backend, kind: str, ids: np.ndarray, mask: np.ndarray, returned_layers: int):
        # As the server runs it: the hidden state, and from the attention graph only the
        # maps returned; a reranker's logits, on pairs whose second half is the text's side.
        if kind == SCORES:
            return backend.run(ids, mask, outputs=frozenset({LOGITS_OUTPUT}),
                               token_type_ids=(np.arange(ids.shape[1]) >= ids.shape[1] // 2)
                               .astype(np.int64)[None, :].repeat(len(ids), axis=0))
        layers = tuple(range(returned_layers)) if kind == ATTENTION else ()
        return backend.run(ids, mask, layers)

    def _cpu_peak(self, shape: Shape, ids: np.ndarray, mask: np.ndarray) -> int:
        import memray

        with tempfile.TemporaryDirectory(prefix="memory-profile-") as scratch:
            capture = Path(scratch) / "run.bin"
            with memray.Tracker(capture, native_traces=False, trace_python_allocators=False,
                                file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS):
                out = self._run(self.backend, shape.graph, ids, mask, shape.returned_layers)
                del out
            with memray.FileReader(capture) as reader:
                return int(reader.metadata.peak_memory)

    def _cuda_peak(self, backend, shape: Shape, ids: np.ndarray, mask: np.ndarray) -> int:
        before = self.probe.device_memory().used
        out = self._run(backend, shape.graph, ids, mask, shape.returned_layers)
        peak = self.probe.device_memory().used - before
        del out
        return max(0, peak)

    def measure(self, shape: Shape, repeats: int) -> Measurement:
        ids, mask = self._inputs(shape.batch, shape.seq)
        backend = self._backend() if self.cuda else None
        peaks, times = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            peaks.append(self._cuda_peak(backend, shape, ids, mask) if self.cuda
                         else self._cpu_peak(shape, ids, mask))
            times.append(time.perf_counter() - started)
        del backend
        return Measurement(shape.graph, shape.batch, shape.seq, shape.returned_layers, max(peaks),
                           peaks, min(times), self.provider, self.precision,
                           self.graphs[shape.graph], CUDA_METHOD if self.cuda else CPU_METHOD)


def measure_shapes(artifact_dir: Path, shapes: list[Shape], device: str, precision: str,
                   threads: int, repeats: int, timeout_s: float = 1800,
                   progress=lambda message: None) -> tuple[list[Measurement], list[str]]:
    """Every shape in worker processes: one for all of them, and a new one for the rest
    after a shape that kills its worker (out of memory, say, or past `timeout_s` for the
    worker), which is left out. Returns the measurements and what was left out, why."""
    rows: list[Measurement] = []
    left_out: list[str] = []
    todo = list(shapes)
    while todo:
        command = [sys.executable, "-m", "attnserve.memory_profile", "--worker",
                   "--artifact", str(Path(artifact_dir).resolve()), "--device", device,
                   "--precision", precision, "--threads", str(threads), "--repeats", str(repeats),
                   "--shapes", json.dumps([asdict(s) for s in todo])]
        with tempfile.TemporaryFile("w+") as errors:
            worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors,
                                      text=True)
            stop = threading.Timer(timeout_s, worker.kill)
            stop.start()
            try:
                for line in worker.stdout:
                    row = Measurement(**json.loads(line))
                    rows.append(row)
                    todo.remove(row.shape)
                    progress(f"[{len(rows) + len(left_out)}/{len(shapes)}] {row.graph} "
                             f"batch={row.batch} seq={row.seq} maps={row.returned_layers}: "
                             f"{row.peak_bytes / MIB:.2f} MiB, {row.seconds:.3f} s")
                code = worker.wait()
            finally:
                stop.cancel()
            errors.seek(0)
            tail = errors.read()[-2000:]
        if todo and code != 0:
            failed = todo.pop(0)
            left_out.append(f"{failed}: worker exited {code}: {tail}")
            progress(f"[{len(rows) + len(left_out)}/{len(shapes)}] left out {failed}: worker "
                     f"exited {code}")
        elif todo:
            raise RuntimeError(f"the worker stopped with {len(todo)} shapes left: {tail}")
    return rows, left_out


# --- output -------------------------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(rows: list[Measurement], fits: dict[str, list[np.ndarray]], heads: int, held: set[int],
          previous: dict[Shape, int]) -> str:
    header = (f"{'graph':>10} {'maps':>4} {'batch':>5} {'seq':>5} {'peak MiB':>10} {'fit MiB':>10} "
              f"{'error':>7} {'prev run':>8} {'run s':>8}  held out")
    lines = [header, "-" * len(header)]
    for i, r in enumerate(rows):
        fitted = predict(fits[r.graph], r, heads)
        error = (fitted - r.peak_bytes) / r.peak_bytes if r.peak_bytes else None
        before = previous.get(r.shape)
        change = f"{100 * (r.peak_bytes - before) / before:+.1f}%" if before else ""
        lines.append(f"{r.graph:>10} {r.returned_layers:>4} {r.batch:>5} {r.seq:>5} "
                     f"{_mib(r.peak_bytes):>10} {_mib(fitted):>10} "
                     f"{'n/a' if error is None else f'{100 * error:+.1f}%':>7} {change:>8} "
                     f"{r.seconds:>8.3f}  {'yes' if i in held else ''}")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[Measurement], fits: dict[str, list[np.ndarray]],
              heads: int) -> None:
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        names = [n for n in asdict(rows[0]) if n != "run_peaks"]
        writer.writerow(names + ["predicted_bytes"])
        for r in rows:
            writer.writerow([getattr(r, n) for n in names] + [round(predict(fits[r.graph], r, heads))])


def plot(path: Path, rows: list[Measurement], fits: dict[str, list[np.ndarray]], heads: int,
         held: set[int], title: str) -> bool:
    """Write the PNG; without matplotlib (the `plot` extra) say how to get it and return
    False: the CSV and JSON hold every figure."""
    try:
        import matplotlib
    except ImportError as err:
        log.warning("event=plot_skipped file=%s reason=%r to_get_it=\"pip install "
                    "'attnserve[plot]'\" and run again", path, str(err))
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({(r.graph, r.returned_layers) for r in rows}, key=lambda m: (m[0] == ATTENTION, m[1]))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.8), squeeze=False,
                             sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (kind, maps) in zip(axes[0], modes, strict=True):
        mine = [(i, r) for i, r in enumerate(rows) if (r.graph, r.returned_layers) == (kind, maps)]
        for k, batch in enumerate(sorted({r.batch for _, r in mine})):
            points = sorted((r.seq, r.peak_bytes / MIB, i in held) for i, r in mine if r.batch == batch)
            seqs = [s for s, _, _ in points]
            color = colors[k % len(colors)]
            ax.plot(seqs, [m for _, m, _ in points], "o", color=color, label=f"batch {batch}")
            out = [(s, m) for s, m, h in points if h]
            if out:  # held-out shapes: a white centre
                ax.plot([s for s, _ in out], [m for _, m in out], "o", color="white", markersize=3)
            dense = np.geomspace(min(seqs), max(seqs), 64)
            fitted = [max(float(np.dot(p, features(kind, batch, s, heads, maps))) for p in fits[kind]) / MIB
                      for s in dense]
            ax.plot(dense, fitted, "-", color=color, alpha=0.6, linewidth=1)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.seq for _, r in mine})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(f"{kind} graph" + (f", {maps} layer(s) of maps returned" if kind == ATTENTION else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="measured (dots; hollow: held out), fit (lines)", fontsize=8, title_fontsize=8)
    axes[0][0].set_ylabel("peak memory of one batch (MiB)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def previous_peaks(path: Path, provider: str, precision: str) -> dict[Shape, int]:
    """The peaks of the run already in --out, when it measured on the same provider and
    precision: what this run's shapes are compared with."""
    try:
        report = json.loads(path.read_text())
        if (report.get("provider"), report.get("precision")) != (provider, precision):
            return {}
        return {Shape(r["graph"], r["batch"], r["seq"], r["returned_layers"]): r["peak_bytes"]
                for r in report["rows"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def agreement(rows: list[Measurement], previous: dict[Shape, int]) -> dict | None:
    changes = [abs(r.peak_bytes - previous[r.shape]) / previous[r.shape] for r in rows
               if previous.get(r.shape)]
    if not changes:
        return None
    return {"shapes": len(changes), "max_rel_change": max(changes),
            "mean_rel_change": float(np.mean(changes))}


# --- the command --------------------------------------------------------------------------


def memray_importable() -> bool:
    try:
        import memray  # noqa: F401
    except ImportError:
        return False
    return True


def shapes_for(attention: bool, seq_lens: list[int], batches: list[int], layers: int,
               max_tokens: int | None = None, first: str = EMBEDDINGS) -> list[Shape]:
    """The embeddings graph at every shape of the grid up to `max_tokens` (batch × seq);
    with `attention`, the attention graph too, returning every layer's maps or only the
    first layer's, alternately along the diagonals of the grid (so the fit sees both
    counts at every size). `first`: the graph without maps (a reranker's scores graph).

    Every term of the model grows linearly with the batch, so a shape over `max_tokens`
    (a large batch at a long length) costs most of the profile's time and teaches the
    fit nothing the same length at a smaller batch does not: the long lengths are
    measured at the small batches, the large batches at the short lengths."""
    def kept(batch: int, seq: int) -> bool:
        return max_tokens is None or batch * seq <= max_tokens

    shapes = [Shape(first, b, s, 0) for b in batches for s in seq_lens if kept(b, s)]
    if attention:
        shapes += [Shape(ATTENTION, b, s, layers if (i + j) % 2 == 0 else 1)
                   for j, b in enumerate(batches) for i, s in enumerate(seq_lens) if kept(b, s)]
    return shapes


def fitted_already(artifact, provider: str, precision: str, attention: bool) -> bool:
    """Whether memory_model.json beside the artifact holds a fit for every graph this run
    would measure on `provider` at `precision`. A damaged file holds none."""
    from attnserve.server.memory.model import read_entries

    try:
        entries = read_entries(artifact.directory / MEMORY_MODEL)
    except (ValueError, TypeError):
        return False
    kinds = graph_kinds(artifact.manifest)
    kinds = kinds if attention else kinds[:1]
    return all(model_key(provider, precision, kind) in entries for kind in kinds)


def run_memory_profile(args: argparse.Namespace) -> int:
    artifact = load_artifact(args.artifact)
    manifest = artifact.manifest
    seq_lens = sorted(set(args.seq_lens))
    skipped = [s for s in seq_lens if s > manifest.max_positions or s < 1]
    seq_lens = [s for s in seq_lens if s not in skipped]
    batches = sorted(set(args.batch_sizes))
    if not seq_lens or not batches or min(batches) < 1:
        print("memory-profile: no shapes to measure (check --seq-lens and --batch-sizes)",
              file=sys.stderr)
        return 2
    if skipped:
        print(f"skipping seq lens {skipped}: over the model's {manifest.max_positions} "
              "positions", file=sys.stderr)
    from attnserve.server.runtime.backend import place

    try:
        placement = place(artifact, args.device, args.precision)
    except (ValueError, RuntimeError) as err:  # ConfigError, ArtifactError, DeviceError
        print(f"memory-profile: {err}", file=sys.stderr)
        return 2
    provider = placement.provider
    if args.unless_fitted and fitted_already(artifact, provider, placement.precision,
                                             args.attention):
        print(f"memory-profile: {artifact.path(MEMORY_MODEL)} already holds a fit for "
              f"{provider}; kept (run without --unless-fitted to measure again)")
        return 0
    if placement.device == "cpu" and not memray_importable():
        print("memory-profile: on the CPU it counts allocations with memray, which is not "
              "installed: pip install 'attnserve[profile]'", file=sys.stderr)
        return 2
    heads, layers = manifest.num_heads, manifest.num_layers
    max_tokens = args.max_tokens or None
    reranker = manifest.kind == RERANKER
    if reranker and args.attention:
        print("memory-profile: a reranker has no attention graph; --attention is for "
              "embedders", file=sys.stderr)
        return 2
    shapes = shapes_for(args.attention, seq_lens, batches, layers, max_tokens,
                        SCORES if reranker else EMBEDDINGS)
    started = time.monotonic()
    rows, left_out = measure_shapes(artifact.directory, shapes, args.device, args.precision,
                                    args.threads, max(1, args.repeats),
                                    progress=lambda m: print(m, file=sys.stderr, flush=True))
    if not rows:
        print("memory-profile: every shape failed (see above)", file=sys.stderr)
        return 1
    provider, precision, method = rows[0].provider, rows[0].precision, rows[0].method
    result = fit_with_holdout(rows, heads, args.holdout_every)
    fits = result["fits"]
    held = result["held"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = previous_peaks(out / "memory_profile.json", provider, precision)
    agree = agreement(rows, previous)
    graph_files = {r.graph: r.graph_file for r in rows}
    models = {kind: MemoryModel(*map(float, phases[0]), source=f"fitted on {provider} {precision} "
                                f"({graph_files[kind]})",
                                other_phases=tuple(tuple(map(float, p)) for p in phases[1:]))
              for kind, phases in fits.items()}
    entries = {
        model_key(provider, precision, kind): model.entry() | {
            "graph_file": graph_files[kind], "measure": method,
            "shapes": sum(r.graph == kind for r in rows),
            "holdout": (result["holdout"] or {}).get("by_graph", {}).get(kind),
        } for kind, model in models.items()}
    title = (f"{manifest.model_name} on {provider} ({precision}): peak memory of one batch "
             f"({'allocation high-water mark' if method == CPU_METHOD else 'arena growth, fresh backend'})")
    written = [out / "memory_profile.csv", out / "memory_profile.json"]
    write_csv(written[0], rows, fits, heads)
    if plot(out / "memory_profile.png", rows, fits, heads, held, title):
        written.append(out / "memory_profile.png")
    model_path = None if args.no_save_model else save_entries(artifact.directory, entries)
    report = {
        "model": manifest.model_name, "provider": provider, "precision": precision,
        "artifact": str(artifact.directory), "artifact_sha256": artifact.manifest_sha256,
        "heads": heads, "layers": layers, "repeats": args.repeats, "max_tokens": max_tokens,
        "measure": method,
        "seconds": round(time.monotonic() - started, 1),
        "rows": [asdict(r) | {"predicted_bytes": round(predict(fits[r.graph], r, heads)),
                              "held_out": i in held} for i, r in enumerate(rows)],
        "left_out": left_out,
        "fit": {"formula": "max over phases of a + b*batch*seq + c*batch*heads*seq^2 "
                           "+ d*batch*heads*seq^2*returned_layers (d: attention graph only)",
                "weighting": "relative (1/measured, floored at 1 MiB); coefficients >= 0",
                "holdout": result["holdout"], "in_sample": result["in_sample"],
                "noise_floor_bytes": NOISE_FLOOR_BYTES, "models": entries},
        "previous_run": agree,
        "memory_model": str(model_path) if model_path else None,
    }
    (out / "memory_profile.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"memory profile: {manifest.model_name}, {provider} ({precision}), {heads} heads, "
          f"{layers} layers; peak = {method}")
    print(table(rows, fits, heads, held, previous))
    for kind, phases in fits.items():
        print(f"fit, {kind} graph ({graph_files[kind]}): bytes ≈ "
              + ("max of\n    " if len(phases) > 1 else "") + "\n    ".join(map(formula, phases)))
    holdout = result["holdout"]
    if holdout:
        per_graph = "; ".join(f"{kind} mean {_pct(e['mean_rel_error'])}, max {_pct(e['max_rel_error'])}"
                              for kind, e in holdout["by_graph"].items())
        print(f"held-out error (1 shape in {args.holdout_every} of each graph held out, fit on the "
              f"other {holdout['train_shapes']}; {holdout['shapes_scored']} of {holdout['shapes']} "
              f"at or above {NOISE_FLOOR_BYTES // MIB} MiB scored): mean "
              f"{_pct(holdout['mean_rel_error'])}, max {_pct(holdout['max_rel_error'])} ({per_graph})")
    else:
        print("held-out error: n/a (too few shapes to hold any out)")
    print(f"in-sample error (final fits on all {len(rows)} shapes): mean "
          f"{_pct(result['in_sample']['mean_rel_error'])}, max "
          f"{_pct(result['in_sample']['max_rel_error'])}")
    if agree:
        print(f"against the previous run in {out} ({agree['shapes']} shapes): per-shape change mean "
              f"{_pct(agree['mean_rel_change'])}, max {_pct(agree['max_rel_change'])}")
    for reason in left_out:
        print(f"left out: {reason.splitlines()[0]}")
    print(f"measured {len(rows)} shapes in {report['seconds']:.0f} s; wrote "
          f"{', '.join(map(str, written))}")
    if model_path:
        print(f"memory model saved to {model_path} under {provider}/{precision}/"
              f"{{{','.join(fits)}}} (the server loads it at start)")
    return 0


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="attnserve.memory_profile --worker")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--shapes", required=True, help="JSON list of Shape fields")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    meter = PeakMeter(args.artifact, args.device, args.precision, args.threads)
    for fields in json.loads(args.shapes):
        row = meter.measure(Shape(**fields), max(1, args.repeats))
        print(json.dumps(asdict(row)), flush=True)
    return 0


if __name__ == "__main__":
    # Only the worker runs as a module; people run `attnserve memory-profile`.
    sys.exit(_worker(sys.argv[1:]))
