"""`python -m bench engines`: its phases' results -> rows, target verdicts, the markdown
tables and the plot.

FLOPs: per sequence of n tokens, per layer (hidden H, feed-forward width I), counting a
multiply-add as 2 FLOPs and only the matrix products:
  Q, K, V and output projections   4 · n · H²   multiply-adds
  feed-forward up and down         2 · n · H·I  multiply-adds
  scores QKᵀ and probabilities·V   2 · n² · H   multiply-adds (all heads together)
so FLOPs(n) = layers · (n · (8H² + 4HI) + 4 · n² · H). all-MiniLM-L6-v2 (H=384, I=1536,
6 layers): 21.2 MFLOP/token + 9.2 kFLOP/token per token of context. Embedding lookups,
LayerNorm, GELU and softmax are left out (a few % at most). Only real tokens count:
padding is waste.
"""

from pathlib import Path

from bench.plot import figure
from bench.report import table

RAW, PLAIN, DEFAULT, RAW_INT8 = ("raw ORT", "raw ORT plain graph", "raw ORT default options",
                                 "raw ORT int8")
DEFAULT_TEXTS = "tokenizer + raw ORT default options"
GRPC, HTTP, GRPC_INT8 = "attnserve gRPC", "attnserve HTTP /v1/embeddings", "attnserve gRPC int8"
GRPC_WORKERS = "attnserve gRPC, --workers 2"
OURS, ST = "PyTorch eager (ours)", "sentence-transformers"
MIXED_IDEAL, MIXED_ONE = "mixed, ideal batches", "mixed, one at a time"
SHORT_IDEAL, SHORT_CALLERS = "short, ideal batches", "short, 64 callers"
SHORT_CONNECTIONS = "short, 64 callers, a connection each"


def callers_name(n: int) -> str:
    return f"mixed, {n} caller{'s' if n > 1 else ''}"


def _row(workload: str, system: str, data: dict, work: float, peak_gflops: float,
         ceiling: dict | None, note: str = "") -> dict:
    seconds = data["tokens"] / data["tokens_per_s"]
    return {
        "workload": workload, "system": system, "tokens_per_s": data["tokens_per_s"],
        "p50_ms": data["p50_ms"], "p99_ms": data["p99_ms"], "n": data["n"],
        "pct_peak": 100 * work / seconds / (peak_gflops * 1e9),
        "x_raw": data["tokens_per_s"] / ceiling["tokens_per_s"] if ceiling else None,
        "note": note,
    }


def flops(model: dict, lengths: list[int]) -> float:
    """The FLOPs of one sequence of each of `lengths` tokens (the module's docstring)."""
    h, i = model["hidden"], model["intermediate"]
    return float(sum(model["layers"] * (n * (8 * h * h + 4 * h * i) + 4 * n * n * h) for n in lengths))


def build_rows(result: dict) -> list[dict]:
    model = result["model"]
    peak = result["peak"]["peak_gflops"]
    raw, grpc = result.get("raw", {}), result.get("grpc", {})
    torch = result.get("torch", {})
    workload = result["workload"]
    rows = []
    for shape in workload["shapes"]:
        name, batch, seq = shape["name"], shape["batch"], shape["seq"]
        work = flops(model, [seq] * batch)
        ceiling = raw.get("shapes", {}).get(name)
        sources = [(RAW, ceiling), (PLAIN, raw.get("plain_shapes", {}).get(name)),
                   (DEFAULT, raw.get("default_shapes", {}).get(name)),
                   (DEFAULT_TEXTS, raw.get("default_texts_shapes", {}).get(name)),
                   (RAW_INT8, raw.get("int8_shapes", {}).get(name)),
                   (GRPC, grpc.get("shapes", {}).get(name)),
                   (HTTP, grpc.get("http_shapes", {}).get(name)),
                   (GRPC_INT8, grpc.get("int8_shapes", {}).get(name)),
                   (GRPC_WORKERS, grpc.get("workers_shapes", {}).get(name)),
                   (OURS, torch.get("ours", {}).get("shapes", {}).get(name)),
                   (ST, torch.get("st", {}).get("shapes", {}).get(name))]
        served = grpc.get("shapes", {}).get(name)
        for system, data in sources:
            if data:
                note = (f"{data['tokens_per_s'] / served['tokens_per_s']:.2f}× gRPC"
                        if system in (HTTP, GRPC_INT8, GRPC_WORKERS) and served else "")
                rows.append(_row(name, system, data, work, peak, ceiling, note))
    work = flops(model, workload["mixed_lengths"])
    ideal = raw.get("mixed_ideal")
    for workload_name, system, data, note in (
        (MIXED_IDEAL, RAW, ideal, "sorted, ≤32 a batch, padding ≤1.1×: the ceiling for the "
                                  "caller rows"),
        (MIXED_IDEAL, PLAIN, raw.get("plain_mixed_ideal"), ""),
        (MIXED_IDEAL, DEFAULT, raw.get("default_mixed_ideal"), ""),
        (MIXED_IDEAL, OURS, torch.get("ours", {}).get("mixed_ideal"), ""),
        (MIXED_IDEAL, ST, torch.get("st", {}).get("mixed_ideal"),
         "encode(all, batch_size=32): its own length sort"),
        (MIXED_ONE, RAW, raw.get("mixed_one"), "batch 1, no tokenizing"),
        (MIXED_ONE, OURS, torch.get("ours", {}).get("mixed_one"), "batch 1, no tokenizing"),
        (MIXED_ONE, ST, torch.get("st", {}).get("mixed_one"), "encode([text]) per text"),
    ):
        if data:
            rows.append(_row(workload_name, system, data, work, peak, ideal, note))
    for callers, data in grpc.get("concurrency", {}).items():
        note = f"padded/real {data['padded_over_real']:.2f}, mean batch {data['mean_batch_size']:.1f}"
        rows.append(_row(callers_name(int(callers)), GRPC, data, work, peak, ideal, note))
    short = raw.get("short_ideal")
    if short:
        work = flops(model, workload["short_lengths"])
        rows.append(_row(SHORT_IDEAL, RAW, short, work, peak, short,
                         f"{workload['short_count']} texts of 8-32 tokens, sorted, ≤32 a batch"))
        rows.append(_row(SHORT_IDEAL, DEFAULT, raw["default_short_ideal"], work, peak, short))
        data = grpc["short_callers"]
        rows.append(_row(SHORT_CALLERS, GRPC, data, work, peak, short,
                         f"padded/real {data['padded_over_real']:.2f}, mean batch "
                         f"{data['mean_batch_size']:.1f}"))
        one = grpc.get("short_connections")
        if one:
            rows.append(_row(SHORT_CONNECTIONS, GRPC, one, work, peak, short))
            group = grpc["short_workers"]
            rows.append(_row(SHORT_CONNECTIONS, GRPC_WORKERS, group, work, peak, short,
                             f"{group['tokens_per_s'] / one['tokens_per_s']:.2f}× gRPC"))
    return rows


def _find(rows: list[dict], workload: str, system: str) -> dict | None:
    return next((r for r in rows if r["workload"] == workload and r["system"] == system), None)


def targets(result: dict, rows: list[dict]) -> list[dict]:
    out = []

    def add(name: str, value: float | None, limit: float, above: bool, figures: str) -> None:
        met = None if value is None else (value >= limit if above else value <= limit)
        out.append({"target": name, "value": value, "limit": limit, "met": met,
                    "figures": figures})

    g, r = _find(rows, "32x128", GRPC), _find(rows, "32x128", RAW)
    if g and r:
        add("batch 32×128 over gRPC ≥ 0.90× raw tokens/s", g["x_raw"], 0.90, True,
            f"{g['tokens_per_s']:.0f} vs {r['tokens_per_s']:.0f} tokens/s")
    c64 = _find(rows, callers_name(64), GRPC)
    ideal, st_one = _find(rows, MIXED_IDEAL, RAW), _find(rows, MIXED_ONE, ST)
    if c64 and ideal:
        paired = result.get("grpc", {}).get("concurrency", {}).get("64", {}).get(
            "paired_ratios_to_raw_ideal", [])
        add("64 callers, mixed lengths ≥ 0.80× raw ideally batched", c64["x_raw"], 0.80, True,
            f"{c64['tokens_per_s']:.0f} vs {ideal['tokens_per_s']:.0f} tokens/s; per round "
            + ", ".join(f"{r:.2f}" for r in paired))
    if c64 and st_one:
        add("64 callers, mixed lengths ≥ 1.5× sentence-transformers one at a time",
            c64["tokens_per_s"] / st_one["tokens_per_s"], 1.5, True,
            f"{c64['tokens_per_s']:.0f} vs {st_one['tokens_per_s']:.0f} tokens/s")
    concurrency = result.get("grpc", {}).get("concurrency", {})
    if "64" in concurrency:
        s = concurrency["64"]["server"]
        add("padded ≤ 1.25× real tokens at 64 callers", concurrency["64"]["padded_over_real"],
            1.25, False, f"{s['padded_tokens']:.0f} padded / {s['real_tokens']:.0f} real tokens "
            f"in {s['batches']:.0f} batches (server /metrics)")
    g, r = _find(rows, "1x16", GRPC), _find(rows, "1x16", RAW)
    d = _find(rows, "1x16", DEFAULT)
    if g and r:
        add("1 text × 16 tokens, one caller: p50 ≤ 1.5× raw", g["p50_ms"] / r["p50_ms"], 1.5,
            False, f"{g['p50_ms']:.2f} ms vs {r['p50_ms']:.2f} ms"
            + (f" (default options {d['p50_ms']:.2f} ms)" if d else ""))
    g, r = _find(rows, SHORT_CALLERS, GRPC), _find(rows, SHORT_IDEAL, RAW)
    if g and r:
        add("64 callers of 8-32-token texts ≥ 0.85× raw ideally batched", g["x_raw"], 0.85,
            True, f"{g['tokens_per_s']:.0f} vs {r['tokens_per_s']:.0f} tokens/s")
    for shape in result["workload"]["shapes"]:
        name = shape["name"]
        g, d, st = _find(rows, name, GRPC), _find(rows, name, DEFAULT), _find(rows, name, ST)
        if g and d:
            add(f"{name}: gRPC ≥ 0.90× onnxruntime at default options",
                g["tokens_per_s"] / d["tokens_per_s"], 0.90, True,
                f"{g['tokens_per_s']:.0f} vs {d['tokens_per_s']:.0f} tokens/s")
        dt = _find(rows, name, DEFAULT_TEXTS)
        if g and dt:  # texts in on both sides: the server tokenizes too
            add(f"{name}: gRPC ≥ 0.90× tokenizer + onnxruntime at default options",
                g["tokens_per_s"] / dt["tokens_per_s"], 0.90, True,
                f"{g['tokens_per_s']:.0f} vs {dt['tokens_per_s']:.0f} tokens/s")
        if g and st:
            add(f"{name}: gRPC ≥ 1.0× sentence-transformers", g["tokens_per_s"] / st["tokens_per_s"],
                1.0, True, f"{g['tokens_per_s']:.0f} vs {st['tokens_per_s']:.0f} tokens/s")
    for name, limit in (("32x128", 1.6), ("32x512", 1.0)):
        i8, r = _find(rows, name, RAW_INT8), _find(rows, name, RAW)
        if i8 and r:
            add(f"{name}: int8 ≥ {limit:.1f}× fp32 (raw, the server's backend)", i8["x_raw"], limit,
                True, f"{i8['tokens_per_s']:.0f} vs {r['tokens_per_s']:.0f} tokens/s")
    longest = max(result["workload"]["shapes"], key=lambda x: x["batch"] * x["seq"])["name"]
    r, d = _find(rows, longest, RAW), _find(rows, longest, DEFAULT)
    if r and d:
        add(f"{longest}: the server's session (arena off) ≥ 0.95× onnxruntime at default options",
            r["tokens_per_s"] / d["tokens_per_s"], 0.95, True,
            f"{r['tokens_per_s']:.0f} vs {d['tokens_per_s']:.0f} tokens/s")
    served = result.get("grpc", {}).get("shapes", {}).get(longest, {})
    if "rss_after_idle" in served:
        back = (served["rss_after_idle"] - served["rss_before"]) / 2**20
        add(f"{longest}: the server's resident set 1 s after it ≤ 50 MiB over before it", back,
            50, False, f"{served['rss_before'] / 2**20:.0f} MiB before, "
            f"{served['rss_after_idle'] / 2**20:.0f} MiB after")
    g8, st = _find(rows, "32x128", GRPC_INT8), _find(rows, "32x128", ST)
    if g8 and st:
        add("32x128: gRPC int8 ≥ 1.5× sentence-transformers", g8["tokens_per_s"] / st["tokens_per_s"],
            1.5, True, f"{g8['tokens_per_s']:.0f} vs {st['tokens_per_s']:.0f} tokens/s")
    memory = result.get("grpc", {}).get("attention_memory", {})
    raw_memory = result.get("raw", {}).get("attention_memory", {})
    one, every = memory.get("one_float32"), memory.get("all_float32")
    raw_att = result.get("raw", {}).get("attention", {})
    if one and every and raw_att.get("all"):
        # Asking for 1 layer instead of all should save at least the maps of the others:
        # (layers - 1) × one layer's maps. Met when the request's peak saves half of that.
        layers = result["model"]["layers"]
        expected = raw_att["all"]["output_bytes_fp32"] * (layers - 1) / layers
        saved = every["request_peak_rss_bytes"] - one["request_peak_rss_bytes"]
        batch_saved = every["batch_peak_bytes"] - one["batch_peak_bytes"]
        raw_fig = ""
        if raw_memory.get("one") and raw_memory.get("all"):
            raw_fig = (f"; raw session peak {raw_memory['one']['peak_bytes'] / 2**20:.0f} vs "
                       f"{raw_memory['all']['peak_bytes'] / 2**20:.0f} MiB")
        mib = 2**20
        add(f"1 layer's attention maps do not cost the memory of all {layers} "
            f"({result['workload']['attention_shape']}, float32): request peak saved ÷ the "
            f"other {layers - 1} layers' maps ≥ 0.5", saved / expected, 0.5, True,
            f"server request peak RSS {one['request_peak_rss_bytes'] / mib:.0f} vs "
            f"{every['request_peak_rss_bytes'] / mib:.0f} MiB (saves {saved / mib:.0f}, maps of "
            f"{layers - 1} layers {expected / mib:.0f} MiB); batch peak (/metrics) "
            f"{one['batch_peak_bytes'] / mib:.0f} vs {every['batch_peak_bytes'] / mib:.0f} MiB "
            f"(saves {batch_saved / mib:.0f}){raw_fig}")
    return out


# --- text ------------------------------------------------------------------------------------

def _fmt(value, spec: str, missing: str = "–") -> str:
    return missing if value is None else format(value, spec)


def _mib(value: float | None) -> str:
    return _fmt(None if value is None else value / 2**20, ".1f")


def markdown(result: dict, rows: list[dict], verdicts: list[dict], tree: bool = True) -> str:
    """The run's tables; `tree`: with the commit measured (bench/results keeps it; the
    docs name the version and the date instead, see report.docs_section)."""
    peak, environment, mixed = result["peak"], result["environment"], result["workload"]["mixed_distribution"]
    source = (f"Tree: commit {environment['commit']}"
              + (" with uncommitted changes under server/" if environment["server_dirty"] else "")
              + "; ") if tree else ""
    lines = [
        f"Peak fp32 matmul ({peak['n']}², {peak['threads']} threads): {peak['peak_gflops']:.0f} GFLOP/s "
        f"({peak['peak_source']}; numpy {peak['numpy_gflops']:.0f}, torch {peak['torch_gflops']:.0f}). "
        f"Raw ORT graph: `{result.get('raw', {}).get('graph', '?')}` (the server's).",
        f"{source}`{environment['command']}`, {result.get('seconds', 0):.0f} s. Mixed workload: "
        f"{mixed['count']} texts, {mixed['kind']}, mean {mixed['mean']:.0f} tokens "
        f"(p10 {mixed['p10']:.0f}, p90 {mixed['p90']:.0f}).",
        "Other load on the machine while each phase ran (cores, from /proc/stat): "
        + ", ".join(f"{k} {result[k]['other_load_cores']:.2f}"
                    for k in ("peak", "grpc", "torch") if k in result)
        + " (grpc: the raw session and the server, measured in alternating blocks).", "",
        table(["workload", "system", "tokens/s", "p50 ms", "p99 ms", "% peak", "× raw", "note"],
              [[r["workload"], r["system"], f"{r['tokens_per_s']:,.0f}", f"{r['p50_ms']:.2f}",
                f"{r['p99_ms']:.2f}", f"{r['pct_peak']:.0f}", _fmt(r["x_raw"], ".2f"), r["note"]]
               for r in rows], "llrrrrrl"), "",
        table(["target", "value", "limit", "verdict", "figures"],
              [[v["target"], _fmt(v["value"], ".2f"), f"{v['limit']:.2f}",
                {True: "met", False: "NOT met", None: "not measured"}[v["met"]], v["figures"]]
               for v in verdicts], "lrrll")]
    grpc, raw = result.get("grpc", {}), result.get("raw", {})
    attention, memory = grpc.get("attention"), grpc.get("attention_memory", {})
    if attention:
        lines += ["", f"Attention maps, {attention['shape']} (texts × tokens) per request; memory "
                  "measured on a fresh server / process per row:", "",
                  table(["layers returned", "dtype", "gRPC p50 ms", "response MiB", "server batch peak MiB",
                         "server request peak RSS MiB", "raw p50 ms", "raw peak MiB"],
                        [[f"{row['layers']} ({row['layers_returned']})", row["dtype"], f"{row['p50_ms']:.1f}",
                          _mib(row["response_bytes"]), _mib(memory.get(key, {}).get("batch_peak_bytes")),
                          _mib(memory.get(key, {}).get("request_peak_rss_bytes")),
                          _fmt(raw.get("attention", {}).get(row["layers"], {}).get("p50_ms"), ".1f"),
                          _mib(raw.get("attention_memory", {}).get(row["layers"], {}).get("peak_bytes"))]
                         for key, row in attention.items() if key != "shape"], "llrrrrrr")]
    items = [(f"shape {k}", v["server"]) for k, v in grpc.get("shapes", {}).items()]
    items += [(callers_name(int(k)), v["server"]) for k, v in grpc.get("concurrency", {}).items()]
    if "short_callers" in grpc:
        items.append((SHORT_CALLERS, grpc["short_callers"]["server"]))
    if items:
        lines += ["", "Where the server's time goes (sums over each measurement, seconds; CPU "
                  "seconds of the server and of the bench's client process):", "",
                  table(["measurement", "wall", "requests", "batches", "queue", "tokenize", "inference",
                         "respond", "server CPU", "client CPU"],
                        [[name, f"{s['wall_s']:.2f}", f"{s['requests']:.0f}", f"{s['batches']:.0f}",
                          *(f"{s['stage_seconds'][stage]:.2f}" for stage in ("queue", "tokenize", "inference",
                                                                             "respond")),
                          f"{s['server_cpu_s']:.2f}", f"{s['client_cpu_s']:.2f}"] for name, s in items])]
    return "\n".join(lines)


# --- plot --------------------------------------------------------------------------------------

SYSTEM_COLORS = {RAW: "#1f77b4", PLAIN: "#aec7e8", DEFAULT: "#17becf", DEFAULT_TEXTS: "#bcbd22",
                 RAW_INT8: "#9edae5", GRPC: "#d62728", HTTP: "#ff9896", GRPC_INT8: "#8c564b",
                 GRPC_WORKERS: "#9467bd", OURS: "#2ca02c", ST: "#ff7f0e"}


def plot(result: dict, rows: list[dict], path: Path) -> None:
    import numpy as np

    with figure(path, 3, 1, figsize=(13, 13), dpi=110, gridspec_kw={"height_ratios": [3, 2, 2]}) as (_, axes):
        ax = axes[0]
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        width, x = 0.8 / len(SYSTEM_COLORS), np.arange(len(workloads))
        for k, (system, color) in enumerate(SYSTEM_COLORS.items()):
            values = [next((r["tokens_per_s"] for r in rows
                            if r["workload"] == w and r["system"] == system), 0) for w in workloads]
            if any(values):
                ax.bar(x + (k - len(SYSTEM_COLORS) / 2 + 0.5) * width, values, width, label=system,
                       color=color)
        ax.set_xticks(x, workloads, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s (real tokens)")
        ax.set_title(f"all-MiniLM-L6-v2 fp32 on {result['environment']['cores']} cores "
                     f"(peak {result['peak']['peak_gflops']:.0f} GFLOP/s): tokens/s by workload")
        ax.legend(fontsize=8, ncol=3)
        ax.grid(axis="y", alpha=0.3)

        ax = axes[1]
        served = [r for r in rows if r["system"] == GRPC and r["x_raw"] is not None]
        ax.barh([r["workload"] for r in served], [r["x_raw"] for r in served], color=SYSTEM_COLORS[GRPC])
        for line, label in ((0.9, "0.90: 32×128 target"), (0.8, "0.80: 64 callers target")):
            ax.axvline(line, color="k", ls="--", lw=0.8)
            ax.text(line, len(served) - 0.45, label, fontsize=7, rotation=90, va="top", ha="right")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("attnserve tokens/s ÷ raw session tokens/s (same inputs, same run; caller "
                      "rows vs raw ideal batches)")
        ax.tick_params(axis="y", labelsize=8)

        ax = axes[2]
        attention = result.get("grpc", {}).get("attention", {})
        keys = [k for k in attention if k != "shape"]
        if keys:
            memory = result.get("grpc", {}).get("attention_memory", {})
            raw_memory = result.get("raw", {}).get("attention_memory", {})
            bars = (("response", lambda k: attention[k]["response_bytes"], "#9467bd"),
                    ("raw session peak (fresh process)",
                     lambda k: raw_memory.get(attention[k]["layers"], {}).get("peak_bytes"), "#1f77b4"),
                    ("server batch peak (fresh server, /metrics)",
                     lambda k: memory.get(k, {}).get("batch_peak_bytes"), "#8c564b"),
                    ("server request peak RSS (fresh server)",
                     lambda k: memory.get(k, {}).get("request_peak_rss_bytes"), "#e377c2"))
            for j, (label, value, color) in enumerate(bars):
                ax.bar(np.arange(len(keys)) + (j - 1.5) * 0.2, [(value(k) or 0) / 2**20 for k in keys], 0.2,
                       label=label, color=color)
            ax.set_xticks(np.arange(len(keys)), [
                f"{attention[k]['layers']} layer(s)\n{attention[k]['dtype']}\n{attention[k]['p50_ms']:.0f} ms"
                for k in keys], fontsize=8)
            ax.set_ylabel("MiB per request")
            ax.set_title(f"attention maps, {attention['shape']} texts per request: bytes, memory, "
                         "p50 latency")
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
