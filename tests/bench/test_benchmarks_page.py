"""`python -m bench engines --docs docs/benchmarks.md`: a run's section is headed by its machine and
date, replaces the same machine's earlier run in place, goes first below the marker for a
machine not yet in the page, and leaves the page's own prose as it was. Every benchmark the
pages name is one `python -m bench` runs."""

import re

import pytest

from bench.report import RUNS_MARKER, docs_section, update_page
from bench.runner import BENCHMARKS, parser
from tests.harness import REPO

PAGE = f"# Benchmarks\n\nHow to read these.\n\n{RUNS_MARKER}\n\n### An older machine, by hand\n\nIts table.\n"


def run(cpu: str, date: str, table: str) -> tuple[str, str]:
    environment = {"cpu": cpu, "cores": 2, "threads": 2, "date": date, "attnserve": "0.1.0",
                   "onnxruntime": "1.31.1", "python": "3.11.2",
                   "command": "python -m bench engines --docs docs/benchmarks.md"}
    return docs_section({"environment": environment, "seconds": 600.0}, table, "bench-x.png")


def test_a_section_names_the_machine_date_versions_and_plot():
    key, section = run("Intel(R) Xeon(R) Processor", "2026-12-01", "| a | b |")
    assert key == "Intel(R) Xeon(R) Processor, 2 cores"
    lines = section.splitlines()
    assert lines[1] == "### Intel(R) Xeon(R) Processor, 2 cores, 2026-12-01"
    assert "onnxruntime 1.31.1" in lines[3] and "attnserve 0.1.0" in lines[3]
    assert "![python -m bench engines on Intel(R) Xeon(R) Processor, 2 cores](bench-x.png)" in lines
    assert "| a | b |" in lines


def test_a_new_machine_goes_first_below_the_marker_and_a_rerun_replaces_it():
    first = update_page(PAGE, *run("CPU A", "2026-12-01", "| first |"))
    second = update_page(first, *run("CPU B", "2026-12-02", "| other machine |"))
    rerun = update_page(second, *run("CPU A", "2026-12-03", "| rerun |"))
    assert rerun.startswith(f"# Benchmarks\n\nHow to read these.\n\n{RUNS_MARKER}\n\n")
    assert rerun.endswith("### An older machine, by hand\n\nIts table.\n")
    assert rerun.index("### CPU B, 2 cores, 2026-12-02") < rerun.index("### CPU A, 2 cores, 2026-12-03")
    assert "| first |" not in rerun and "2026-12-01" not in rerun
    assert rerun.count("| rerun |") == 1 and rerun.count("| other machine |") == 1


def test_a_page_without_the_marker_is_refused():
    with pytest.raises(ValueError, match="no line"):
        update_page("# Benchmarks\n", *run("CPU A", "2026-12-01", "| t |"))


def test_the_benchmarks_page_takes_a_rerun_of_its_machine_in_place():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert RUNS_MARKER in page
    rerun = update_page(page, *run("Intel(R) Xeon(R) Processor", "2027-01-02", "| rerun |"))
    assert rerun.count("### Intel(R) Xeon(R) Processor, 2 cores") == 1
    assert "| rerun |" in rerun and "### Intel(R) Xeon(R) Processor, 2 cores, 2027-01-02" in rerun
    assert rerun.endswith(page[page.index("### AMD EPYC"):])


def test_every_benchmark_the_pages_and_the_code_name_is_one_the_runner_has():
    parser()  # imports every benchmark
    files = [REPO / "README.md", REPO / "Makefile", REPO / "bench" / "gpu_bench.sh",
             *(REPO / "docs").glob("*.md"), *(REPO / "server").rglob("*.py"), *REPO.glob("*.py")]
    texts = {path: path.read_text() for path in files}
    named = {name for text in texts.values() for name in re.findall(r"-m\s+bench\s+([a-z][a-z0-9-]*)", text)}
    assert [path for path, text in texts.items() if re.search(r"-m\s+bench\.", text)] == []
    assert {"engines", "gpu", "workers", "fairness", "memory-load", "rerank", "chunking"} <= named
    assert named <= set(BENCHMARKS), sorted(named - set(BENCHMARKS))
