"""Reproducible benchmarks, a repository tool run from a checkout: `python -m bench --help`
lists them, `python -m bench NAME [options]` runs one (bench/runner.py). Each prints a table
headed by its machine and date, and writes it with its JSON and a plot under bench/results/.

  runner.py     the registry, the options every benchmark takes, the machine, the result files
  measure.py    the timing loop and its summaries, other load on the machine
  load.py       the load generator: concurrent callers over gRPC or HTTP
  plot.py       matplotlib, set up once
  report.py     markdown tables, and the runs' sections of docs/benchmarks.md
  workloads.py  texts of known token counts, the same ids for every engine
  raw.py        the engines without a server (onnxruntime, PyTorch), each in a process of its own
  served.py     `attnserve serve` as the benchmarks run it, and what its /metrics say
  benchmarks/   one module a benchmark, each a function registered with `@benchmark`

A new benchmark is a function in a new module of bench/benchmarks/:

    @benchmark("name", option("--calls", type=int, default=100))
    def name(args) -> Result:
        \"\"\"One line for --help. ...\"\"\"

The server runs as `attnserve serve` (tests/harness.py, shared with the tests); torch and
onnxruntime are never busy in one process (on a few cores they slow each other 3-4×).
"""
