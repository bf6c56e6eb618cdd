"""Reproducible benchmarks, a repository tool run from a checkout: `python -m bench --help`
lists them, `python -m bench NAME [options]` runs one (bench/runner.py). Each prints a table
headed by its machine and date, and writes it with its JSON and a plot under bench/results/.

  runner.py          the registry, the options every benchmark takes, the machine, the files
  measure.py         the timing loop and its summaries, other load on the machine
  load.py            the load generator: concurrent callers over gRPC or HTTP
  plot.py            matplotlib, set up once
  report.py          markdown tables, and the runs' sections of docs/benchmarks.md
  workloads.py       texts of known token counts, the same ids for every engine
  raw.py             the engines without a server (onnxruntime, PyTorch), a process each
  served.py          `attnserve serve` as the benchmarks run it, and what its /metrics say
  benchmarks/        one module a benchmark, each a function registered with `@benchmark`
  engines_report.py  the engines benchmark's rows, targets, tables and plot
  gpu_phases.py      the GPU benchmark's plan and its in-process phases
  coreference.py     the chunking benchmark's documents
  gpu_bench.sh       the GPU benchmark from a checkout that was never installed

A new benchmark is a function in a new module of bench/benchmarks/, its docstring its help
(the first line in `python -m bench --help`):

    @benchmark("name", option("--calls", type=int, default=100))
    def name(args) -> Result:
        ...  # servers from tests.harness, callers from load.run, torch in raw.isolated
        return Result(report.table(header, rows), data, plot=draw)  # draw(path): plot.figure

The server runs as `attnserve serve` (tests/harness.py, shared with the tests); torch and
onnxruntime are never busy in one process (on a few cores they slow each other 3-4×).
"""
