"""Reproducible benchmarks, a repository tool run from a checkout: `python -m bench` (or
`make bench`) measures, on identical inputs and in one run, the server's backend,
onnxruntime at its default options, attnserve over gRPC, our PyTorch model and
sentence-transformers, and prints a table, writes JSON and a plot under bench/results/.

Each engine runs in its own phase (torch and onnxruntime never busy in one process): the
FLOP peak, the raw sessions and the PyTorch baselines in subprocesses (`bench.phases`), the
server as an `attnserve serve` subprocess with the client in this process. The GPU
benchmark is bench/gpu_bench.sh (`python -m bench.gpu_bench`).
"""
