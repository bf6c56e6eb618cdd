"""The GPU benchmark's result as markdown, headed by the machine and the date: the raw
sessions against each server configuration, then the backend's (or the PyTorch model's)
parity and tokens/s, then peak memory against the shape."""

from bench.gpu_plan import CONCURRENT_CALLERS, MIXED_CALLERS
from bench.machine import machine
from bench.workloads import shape_name


def _cell(data: dict | None, key: str = "p50_ms", unit: str = "ms") -> str:
    if not data or key not in data:
        return "–"
    value = data[key]
    return f"{value / 1e6:.2f} M tok/s" if unit == "tok" else f"{value:.2f} ms"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def servers_table(result: dict) -> list[str]:
    """One row a workload: onnxruntime at its default options, then each server."""
    raw, servers = result.get("raw", {}), result.get("servers", {})
    lines = [_row(["workload", "raw (hidden out)", "raw (pooled out)", *servers]),
             _row(["---", *["---:"] * (2 + len(servers))])]
    for shape in result["plan"]["one_caller_shapes"]:
        name = shape_name(*shape)
        base = raw.get("shapes", {}).get(name)
        cells = []
        for server in servers.values():
            data = server.get("shapes", {}).get(name)
            ratio = f" ({data['tokens_per_s'] / base['tokens_per_s']:.2f}× raw)" if data and base else ""
            cells.append(_cell(data) + ratio)
        lines.append(_row([f"{name}, one caller, p50", _cell(base),
                           _cell(raw.get("pooled_only", {}).get(name)), *cells]))
    sessions = raw.get("sessions", {})
    raw_conc = " / ".join(f"{k}: {v['tokens_per_s'] / 1e6:.2f}" for k, v in sessions.items())

    def line(label: str, first: str, each) -> None:
        lines.append(_row([label, first, "", *(each(s) for s in servers.values())]))

    def throughput(data: dict | None, *keys: str) -> str:
        return f"{_cell(data, 'tokens_per_s', 'tok')} ({' / '.join(_cell(data, k) for k in keys)})"

    line(f"{CONCURRENT_CALLERS} callers of 32x128: tok/s (p99)",
         f"backend sessions in threads {raw_conc} M tok/s" if sessions else "",
         lambda s: throughput(s.get("concurrent"), "p99_ms"))
    line(f"{MIXED_CALLERS} callers, mixed texts: tok/s (p50 / p99)", "",
         lambda s: throughput(s.get("mixed"), "p50_ms", "p99_ms"))
    line("cold start: spawn to SERVING (warm-up s, shapes × lanes)", "",
         lambda s: f"{s['ready_s']:.1f} s ({s.get('warm_up_s', 0):.1f} s, {s.get('warm_up_shapes', '?')} "
                   f"× {s.get('lanes', '?')})" if "ready_s" in s else "–")
    line("first request after SERVING", "",
         lambda s: f"{s['first_request_ms']:.1f} ms" if "first_request_ms" in s else "–")
    line("never-seen shapes after the load (embeddings)", "",
         lambda s: f"{s['unseen_shape_runs']:.0f} of {s['batches']:.0f} batches"
                   if "unseen_shape_runs" in s else "–")
    line("requests/s, 32 callers × client processes: GetModelInfo / Embed 1x16", "",
         lambda s: " / ".join(f"{v:,.0f}" for v in s["front_end_rps"].values())
                   if "front_end_rps" in s else "–")
    line("pooled cosine to raw (min, 32x128)", "",
         lambda s: f"{s['min_cosine_vs_raw']:.6f}" if "min_cosine_vs_raw" in s else "–")
    bound = raw.get("bound", {})
    if bound:
        def described(rows: dict) -> str:
            if "error" in rows:
                return rows["error"]
            return ", ".join(f"{shape} {r['p50_ms']:.3f} ms (max diff to the backend without "
                             f"{r['max_abs_diff_vs_plain']:.1e})" for shape, r in rows.items())

        lines += ["", "Backend, fixed IO-bound buffers (pooled out), p50: " + "; ".join(
            f"{kind}: {described(rows)}" for kind, rows in bound.items())]
    for name, server in servers.items():
        if "error" in server:
            lines.append(f"- {name}: {server['error']}")
    return lines


def check_tables(title: str, check: dict) -> list[str]:
    """Parity, then tokens/s per precision and shape, one caller."""
    lines = [f"{title}:", ""]
    for precision, row in check.get("parity", {}).items():
        lines.append(f"- parity {precision}: {row}")
    lines += ["", "| precision | shape | tokens/s | p50 ms | p99 ms |", "| --- | --- | ---: | ---: | ---: |"]
    for precision, rows in check.get("throughput", {}).items():
        for shape, row in rows.items():
            if isinstance(row, dict):
                lines.append(f"| {precision} | {shape} | {row['tokens_per_s']:,.0f} | "
                             f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} |")
            else:
                lines.append(f"| {precision} | {shape} | {row} | | |")
    return lines


def memory_tables(memory: dict) -> list[str]:
    """Each shape's peak against the memory model fitted to the peaks, per precision."""
    lines: list[str] = []
    for precision, m in memory.items():
        if "rows" not in m:  # skipped, or failed
            lines += ["", f"- memory {precision}: {m}"]
            continue
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
    return lines


def torch_memory_table(memory: dict) -> list[str]:
    """torch.cuda.max_memory_allocated above the weights, per graph kind and seq_len."""
    seqs = list(dict.fromkeys(seq for rows in memory.values() for seq in rows))
    lines = ["", "| memory | " + " | ".join(f"seq {s}" for s in seqs) + " |",
             "| --- |" + " ---: |" * len(seqs)]
    for name, rows in memory.items():
        cells = []
        for s in seqs:
            row = rows.get(s)
            value = row.get("peak_above_weights_bytes") if isinstance(row, dict) else None
            cells.append("–" if value is None else f"{value / 2**20:,.0f} MiB")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    environment = result["environment"]
    graph = result.get("raw", {}).get("graph")
    lines = [f"{machine(environment)}, {environment['date']}: onnxruntime {environment['onnxruntime']}"
             + (f", graph {graph}" if graph else "")
             + f"; phases {', '.join(result['phases'])}; {result.get('seconds', 0):.0f} s in all"]
    if "servers" in result or "shapes" in result.get("raw", {}):
        lines += ["", *servers_table(result)]
    for phase in ("backend", "torch"):
        if "parity" in result.get(phase, {}):
            title = "The server's backend" if phase == "backend" else "Our PyTorch model"
            lines += ["", *check_tables(title, result[phase])]
    if "memory" in result:
        lines += memory_tables(result["memory"])
    if result.get("torch", {}).get("memory"):
        lines += torch_memory_table(result["torch"]["memory"])
    for phase in result["phases"]:
        data = result.get(phase)
        if isinstance(data, dict) and ("error" in data or "skipped" in data):
            lines += ["", f"- {phase}: {data.get('error') or data.get('skipped')}"]
    return "\n".join(lines)
