"""`attnserve memory-profile`: the peak memory and the time of one batch against its shape,
and the memory and time models fitted to them, saved beside the artifact in
memory_model.json under `provider/precision/graph` (other providers' entries kept).
docs/memory.md ("Fitting it: `attnserve memory-profile`", "The time model") says which
shapes are measured, how a peak and a time are measured on the CPU and on CUDA, and how
they are fitted (server/memory/fit.py). It asserts nothing.

The CPU's count is memray's, through the server's own backend with onnxruntime's CPU arena
and memory patterns off, so each tensor is an allocation of its own: with an arena its
growth would be counted, which depends on what ran before and on its rounding.
"""

import argparse
import csv
import functools
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnserve.artifact import LOGITS_OUTPUT, MEMORY_MODEL, SCORERS, load_artifact
from attnserve.server.memory.batch_time import TIME, TimeModel
from attnserve.server.memory.fit import (
    BATCH_TIME,
    NOISE_FLOOR_BYTES,
    NOISE_FLOOR_SECONDS,
    fit_with_holdout,
    formula,
    predict,
)
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
TIME_METHOD = ("median of the timed runs through the server's backend, after one untimed run "
               "at the shape, outside the allocation tracking")


@dataclass(frozen=True)
class Shape:
    graph: str
    """embeddings, attention or scores"""
    batch: int
    seq: int
    returned_layers: int


@dataclass(frozen=True)
class Measurement(Shape):
    peak_bytes: int
    """the largest over the runs"""
    run_peaks: list[int]
    batch_seconds: float
    """the median of the timed runs (TIME_METHOD)"""
    batch_runs: list[float]
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
    shape's peak and time (docs/memory.md)."""

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
        self.graphs = {kind: self.manifest.graph(attention=kind == ATTENTION, precision=self.precision).file
                       for kind in self.kinds}
        # On the CPU one backend serves every shape (memray's count does not depend on what
        # ran before); on CUDA each shape gets one of its own (its sessions, its arena).
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
        # maps returned; a scorer's logits, on pairs whose second half is the text's side.
        if kind == SCORES:
            return backend.run(ids, mask, outputs=frozenset({LOGITS_OUTPUT}),
                               token_type_ids=(np.arange(ids.shape[1]) >= ids.shape[1] // 2)
                               .astype(np.int64)[None, :].repeat(len(ids), axis=0))
        layers = tuple(range(returned_layers)) if kind == ATTENTION else ()
        return backend.run(ids, mask, layers)

    @staticmethod
    def _cpu_peak(run: Callable[[], object]) -> int:
        import memray

        with tempfile.TemporaryDirectory(prefix="memory-profile-") as scratch:
            capture = Path(scratch) / "run.bin"
            with memray.Tracker(capture, native_traces=False, trace_python_allocators=False,
                                file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS):
                run()
            with memray.FileReader(capture) as reader:
                return int(reader.metadata.peak_memory)

    def _cuda_peak(self, run: Callable[[], object]) -> int:
        before = self.probe.device_memory().used
        out = run()
        peak = self.probe.device_memory().used - before
        del out
        return max(0, peak)

    @staticmethod
    def _times(run: Callable[[], object], runs: int) -> list[float]:
        run()  # the shape's first run
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return times

    def measure(self, shape: Shape, repeats: int, time_runs: int) -> Measurement:
        ids, mask = self._inputs(shape.batch, shape.seq)
        backend = self._backend() if self.cuda else self.backend
        run = functools.partial(self._run, backend, shape.graph, ids, mask, shape.returned_layers)
        peaks = [self._cuda_peak(run) if self.cuda else self._cpu_peak(run) for _ in range(repeats)]
        times = self._times(run, time_runs)
        return Measurement(shape.graph, shape.batch, shape.seq, shape.returned_layers, max(peaks),
                           peaks, float(np.median(times)), times, self.provider, self.precision,
                           self.graphs[shape.graph], CUDA_METHOD if self.cuda else CPU_METHOD)


def measure_shapes(artifact_dir: Path, shapes: list[Shape], device: str, precision: str,
                   threads: int, repeats: int, time_runs: int, timeout_s: float = 1800,
                   progress=lambda message: None) -> tuple[list[Measurement], list[str]]:
    """Every shape in worker processes: one for all of them, and a new one for the rest
    after a shape that kills its worker (out of memory, say, or past `timeout_s` for the
    worker), which is left out. Returns the measurements and what was left out, why."""
    rows: list[Measurement] = []
    left_out: list[str] = []
    todo = list(shapes)
    while todo:
        job = {"artifact_dir": str(Path(artifact_dir).resolve()), "device": device,
               "precision": precision, "threads": threads, "repeats": repeats,
               "time_runs": time_runs, "shapes": [asdict(s) for s in todo]}
        command = [sys.executable, "-m", "attnserve.memory_profile", json.dumps(job)]
        with tempfile.TemporaryFile("w+") as errors:
            worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
            stop = threading.Timer(timeout_s, worker.kill)
            stop.start()
            try:
                for line in worker.stdout:
                    row = Measurement(**json.loads(line))
                    rows.append(row)
                    todo.remove(row.shape)
                    progress(f"[{len(rows) + len(left_out)}/{len(shapes)}] {row.graph} "
                             f"batch={row.batch} seq={row.seq} maps={row.returned_layers}: "
                             f"{row.peak_bytes / MIB:.2f} MiB, {1000 * row.batch_seconds:.2f} ms")
                code = worker.wait()
            finally:
                stop.cancel()
            errors.seek(0)
            tail = errors.read()[-2000:]
        if todo and code != 0:
            failed = todo.pop(0)
            left_out.append(f"{failed}: worker exited {code}: {tail}")
            progress(f"[{len(rows) + len(left_out)}/{len(shapes)}] left out {failed}: worker exited {code}")
        elif todo:
            raise RuntimeError(f"the worker stopped with {len(todo)} shapes left: {tail}")
    return rows, left_out


# --- output -------------------------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _error(fitted: float, measured: float) -> str:
    return "n/a" if not measured else f"{100 * (fitted - measured) / measured:+.1f}%"


def table(rows: list[Measurement], predicted: list[tuple[float, float]], held: set[int],
          previous: dict[Shape, int]) -> str:
    header = (f"{'graph':>10} {'maps':>4} {'batch':>5} {'seq':>5} {'peak MiB':>10} {'fit MiB':>10} "
              f"{'error':>7} {'prev run':>8} {'batch ms':>9} {'fit ms':>9} {'error':>7}  held out")
    lines = [header, "-" * len(header)]
    for i, (r, (fitted, fitted_s)) in enumerate(zip(rows, predicted, strict=True)):
        before = previous.get(r.shape)
        change = f"{100 * (r.peak_bytes - before) / before:+.1f}%" if before else ""
        lines.append(f"{r.graph:>10} {r.returned_layers:>4} {r.batch:>5} {r.seq:>5} "
                     f"{_mib(r.peak_bytes):>10} {_mib(fitted):>10} "
                     f"{_error(fitted, r.peak_bytes):>7} {change:>8} "
                     f"{1000 * r.batch_seconds:>9.3f} {1000 * fitted_s:>9.3f} "
                     f"{_error(fitted_s, r.batch_seconds):>7}  {'yes' if i in held else ''}")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[Measurement], predicted: list[tuple[float, float]]) -> None:
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        names = [n for n in asdict(rows[0]) if n not in ("run_peaks", "batch_runs")]
        writer.writerow(names + ["predicted_bytes", "predicted_seconds"])
        for r, (fitted, fitted_s) in zip(rows, predicted, strict=True):
            writer.writerow([getattr(r, n) for n in names] + [round(fitted), fitted_s])


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
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.8), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (kind, maps) in zip(axes[0], modes, strict=True):
        mine = [(i, r) for i, r in enumerate(rows) if (r.graph, r.returned_layers) == (kind, maps)]
        for k, batch in enumerate(sorted({r.batch for _, r in mine})):
            points = sorted((r.seq, r.peak_bytes / MIB, i in held) for i, r in mine if r.batch == batch)
            seqs, mibs, _ = zip(*points, strict=True)
            color = colors[k % len(colors)]
            ax.plot(seqs, mibs, "o", color=color, label=f"batch {batch}")
            if out := [(s, m) for s, m, h in points if h]:  # held-out shapes: a white centre
                ax.plot(*zip(*out, strict=True), "o", color="white", markersize=3)
            dense = np.geomspace(min(seqs), max(seqs), 64)
            fitted = [predict(fits[kind], Shape(kind, batch, s, maps), heads) / MIB for s in dense]
            ax.plot(dense, fitted, "-", color=color, alpha=0.6, linewidth=1)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.seq for _, r in mine})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set(yscale="log", xlabel="sequence length (tokens)")
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


def shapes_for(attention: bool, seq_lens: list[int], batches: list[int], layers: int,
               max_tokens: int | None = None, first: str = EMBEDDINGS) -> list[Shape]:
    """The embeddings graph at every shape of the grid up to `max_tokens` (batch × seq);
    with `attention`, the attention graph too, returning every layer's maps or only the
    first layer's, alternately along the diagonals of the grid (so the fit sees both
    counts at every size). `first`: the graph without maps (a reranker's scores graph).
    Why the grid leaves out the shapes over `max_tokens`: docs/memory.md."""
    grid = [(j, b, i, s) for j, b in enumerate(batches) for i, s in enumerate(seq_lens)
            if max_tokens is None or b * s <= max_tokens]
    shapes = [Shape(first, b, s, 0) for _, b, _, s in grid]
    return shapes + [Shape(ATTENTION, b, s, layers if (i + j) % 2 == 0 else 1)
                     for j, b, i, s in grid if attention]


def fitted_already(artifact, provider: str, precision: str, attention: bool) -> bool:
    """Whether memory_model.json beside the artifact (a damaged one holds none) holds a fit,
    memory and time, for every graph this run would measure on `provider` at `precision`."""
    from attnserve.server.memory.model import read_entries

    try:
        entries = read_entries(artifact.directory / MEMORY_MODEL)
    except (ValueError, TypeError):
        return False
    kinds = graph_kinds(artifact.manifest)
    kinds = kinds if attention else kinds[:1]
    return all(TIME in entries.get(model_key(provider, precision, kind), {}) for kind in kinds)


def run_memory_profile(args: argparse.Namespace) -> int:
    artifact = load_artifact(args.artifact)
    manifest = artifact.manifest
    seq_lens = sorted(set(args.seq_lens))
    skipped = [s for s in seq_lens if s > manifest.max_positions or s < 1]
    seq_lens = [s for s in seq_lens if s not in skipped]
    batches = sorted(set(args.batch_sizes))
    if not seq_lens or not batches or min(batches) < 1:
        print("memory-profile: no shapes to measure (check --seq-lens and --batch-sizes)", file=sys.stderr)
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
    if args.unless_fitted and fitted_already(artifact, provider, placement.precision, args.attention):
        print(f"memory-profile: {artifact.path(MEMORY_MODEL)} already holds a fit for "
              f"{provider}; kept (run without --unless-fitted to measure again)")
        return 0
    try:
        if placement.device == "cpu":
            import memray  # noqa: F401
    except ImportError:
        print("memory-profile: on the CPU it counts allocations with memray, which is not "
              "installed: pip install 'attnserve[profile]'", file=sys.stderr)
        return 2
    heads, layers = manifest.num_heads, manifest.num_layers
    max_tokens = args.max_tokens or None
    scorer = manifest.kind in SCORERS
    if scorer and args.attention:
        print(f"memory-profile: a {manifest.kind} has no attention graph; --attention is for "
              "embedders", file=sys.stderr)
        return 2
    shapes = shapes_for(args.attention, seq_lens, batches, layers, max_tokens,
                        SCORES if scorer else EMBEDDINGS)
    started = time.monotonic()
    rows, left_out = measure_shapes(artifact.directory, shapes, args.device, args.precision,
                                    args.threads, max(1, args.repeats), max(1, args.time_runs),
                                    progress=lambda m: print(m, file=sys.stderr, flush=True))
    if not rows:
        print("memory-profile: every shape failed (see above)", file=sys.stderr)
        return 1
    provider, precision, method = rows[0].provider, rows[0].precision, rows[0].method
    result = fit_with_holdout(rows, heads, args.holdout_every)
    timed = fit_with_holdout(rows, heads, args.holdout_every, BATCH_TIME)
    fits, times, held = result["fits"], timed["fits"], result["held"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = previous_peaks(out / "memory_profile.json", provider, precision)
    agree = agreement(rows, previous)
    graph_files = {r.graph: r.graph_file for r in rows}
    sources = {kind: f"fitted on {provider} {precision} ({graph_files[kind]})" for kind in fits}
    entries = {
        model_key(provider, precision, kind): MemoryModel(
            *map(float, phases[0]), source=sources[kind],
            other_phases=tuple(tuple(map(float, p)) for p in phases[1:])).entry() | {
            "graph_file": graph_files[kind], "measure": method, "shapes": sum(r.graph == kind for r in rows),
            "holdout": (result["holdout"] or {}).get("by_graph", {}).get(kind),
            TIME: TimeModel(*map(float, times[kind][0]), source=sources[kind]).entry() | {
                "measure": TIME_METHOD, "runs": max(1, args.time_runs), "threads": args.threads,
                "holdout": (timed["holdout"] or {}).get("by_graph", {}).get(kind)},
        } for kind, phases in fits.items()}
    title = (f"{manifest.model_name} on {provider} ({precision}): peak memory of one batch "
             f"({'allocation high-water mark' if method == CPU_METHOD else 'arena growth, fresh backend'})")
    written = [out / "memory_profile.csv", out / "memory_profile.json"]
    predicted = [(predict(fits[r.graph], r, heads), predict(times[r.graph], r, heads)) for r in rows]
    write_csv(written[0], rows, predicted)
    if plot(out / "memory_profile.png", rows, fits, heads, held, title):
        written.append(out / "memory_profile.png")
    model_path = None if args.no_save_model else save_entries(artifact.directory, entries)
    report = {
        "model": manifest.model_name, "provider": provider, "precision": precision,
        "artifact": str(artifact.directory), "artifact_sha256": artifact.manifest_sha256,
        "heads": heads, "layers": layers, "repeats": args.repeats, "max_tokens": max_tokens,
        "measure": method, "seconds": round(time.monotonic() - started, 1),
        "rows": [asdict(r) | {"predicted_bytes": round(b), "predicted_seconds": s, "held_out": i in held}
                 for i, (r, (b, s)) in enumerate(zip(rows, predicted, strict=True))],
        "left_out": left_out,
        "fit": {"formula": "max over phases of a + b*batch*seq + c*batch*heads*seq^2 "
                           "+ d*batch*heads*seq^2*returned_layers (d: attention graph only)",
                "weighting": "relative (1/measured, floored at 1 MiB); coefficients >= 0",
                "holdout": result["holdout"], "in_sample": result["in_sample"],
                "noise_floor_bytes": NOISE_FLOOR_BYTES, "models": entries,
                "time": {"formula": "a + b*batch*seq + c*batch*heads*seq^2 "
                                    "+ d*batch*heads*seq^2*returned_layers (one phase)",
                         "weighting": "relative (1/measured, floored at 0.1 ms); coefficients >= 0",
                         "measure": TIME_METHOD, "holdout": timed["holdout"], "in_sample": timed["in_sample"],
                         "noise_floor_seconds": NOISE_FLOOR_SECONDS}},
        "previous_run": agree, "memory_model": str(model_path) if model_path else None,
    }
    (out / "memory_profile.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"memory profile: {manifest.model_name}, {provider} ({precision}), {heads} heads, "
          f"{layers} layers; peak = {method}")
    print(table(rows, predicted, held, previous))
    for kind, phases in fits.items():
        print(f"fit, {kind} graph ({graph_files[kind]}): bytes ≈ "
              + ("max of\n    " if len(phases) > 1 else "") + "\n    ".join(map(formula, phases)))
    for kind, phases in times.items():
        print(f"time fit, {kind} graph ({graph_files[kind]}): seconds ≈ {formula(phases[0])}")
    for what, fitted, floor in (("", result, f"{NOISE_FLOOR_BYTES // MIB} MiB"),
                                ("time ", timed, f"{1000 * NOISE_FLOOR_SECONDS:g} ms")):
        print(_errors(what, fitted, floor, len(rows), args.holdout_every))
    if agree:
        print(f"against the previous run in {out} ({agree['shapes']} shapes): per-shape change mean "
              f"{_pct(agree['mean_rel_change'])}, max {_pct(agree['max_rel_change'])}")
    for reason in left_out:
        print(f"left out: {reason.splitlines()[0]}")
    print(f"measured {len(rows)} shapes in {report['seconds']:.0f} s; wrote {', '.join(map(str, written))}")
    if model_path:
        print(f"memory and time models saved to {model_path} under {provider}/{precision}/"
              f"{{{','.join(fits)}}} (the server loads them at start)")
    return 0


def _errors(what: str, fitted: dict, floor: str, shapes: int, every: int) -> str:
    """The held-out and in-sample errors of a fit (fit_with_holdout's), as lines."""
    holdout = fitted["holdout"]
    if holdout:
        per_graph = "; ".join(f"{kind} mean {_pct(e['mean_rel_error'])}, max {_pct(e['max_rel_error'])}"
                              for kind, e in holdout["by_graph"].items())
        lines = [f"{what}held-out error (1 shape in {every} of each graph held out, fit on the "
                 f"other {holdout['train_shapes']}; {holdout['shapes_scored']} of "
                 f"{holdout['shapes']} at or above {floor} scored): mean "
                 f"{_pct(holdout['mean_rel_error'])}, max {_pct(holdout['max_rel_error'])} "
                 f"({per_graph})"]
    else:
        lines = [f"{what}held-out error: n/a (too few shapes to hold any out)"]
    in_sample = fitted["in_sample"]
    lines.append(f"{what}in-sample error (final fits on all {shapes} shapes): mean "
                 f"{_pct(in_sample['mean_rel_error'])}, max {_pct(in_sample['max_rel_error'])}")
    return "\n".join(lines)


def _worker(job: dict) -> int:
    """Measure `job`'s shapes (measure_shapes's arguments), printing each row as JSON."""
    meter = PeakMeter(Path(job["artifact_dir"]), job["device"], job["precision"], job["threads"])
    for fields in job["shapes"]:
        row = meter.measure(Shape(**fields), job["repeats"], job["time_runs"])
        print(json.dumps(asdict(row)), flush=True)
    return 0


if __name__ == "__main__":
    # Only the worker runs as a module; people run `attnserve memory-profile`.
    sys.exit(_worker(json.loads(sys.argv[1])))
