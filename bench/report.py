"""Markdown tables, and the runs' sections of docs/benchmarks.md."""

import re

from bench.runner import machine


def table(header: list[str], rows: list[list], align: str = "") -> str:
    """A markdown table; `align`, a letter a column: l(eft) or r(ight) (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = [header, ["---:" if a == "r" else "---" for a in align], *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


# Where a machine's first run goes in the page: below this line, newest first.
RUNS_MARKER = ("<!-- python -m bench: runs written by `python -m bench engines --docs` follow, newest "
               "first -->")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _markers(key: str) -> tuple[str, str]:
    """The lines a machine's section starts and ends with."""
    return f"<!-- python -m bench: {key} -->", f"<!-- /python -m bench: {key} -->"


def docs_section(result: dict, tables: str, plot_file: str | None) -> tuple[str, str]:
    """(the machine, its section of the page): a heading naming the machine and the date,
    the command and versions measured, the plot, the tables."""
    environment = result["environment"]
    key = machine(environment)
    begin, end = _markers(key)
    lines = [begin,
             f"### {key}, {environment['date']}", "",
             f"`{environment['command']}` ({result['seconds']:.0f} s): attnserve "
             f"{environment['attnserve']}, onnxruntime {environment['onnxruntime']}, Python "
             f"{environment['python']}, {environment['threads']} threads.", ""]
    if plot_file:
        lines += [f"![python -m bench engines on {key}]({plot_file})", ""]
    lines += [tables, end]
    return key, "\n".join(lines)


def update_page(page: str, key: str, section: str) -> str:
    """`page` with `section` in place of the earlier section of the same machine, or, for
    a machine not in it yet, first below RUNS_MARKER; the rest of the page as it was."""
    begin, end = _markers(key)
    start = page.find(begin)
    if start >= 0 and page.find(end, start) >= 0:
        stop = page.find(end, start) + len(end)
        return page[:start] + section + page[stop:]
    at = page.find(RUNS_MARKER)
    if at < 0:
        raise ValueError(f"the page has no line {RUNS_MARKER!r} to put the run below")
    at += len(RUNS_MARKER)
    return page[:at] + "\n\n" + section + page[at:]
