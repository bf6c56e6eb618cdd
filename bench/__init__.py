"""Reproducible benchmarks: `python -m bench` (or `attnserve bench`) measures, on identical
inputs and in one run, the raw onnxruntime session, attnserve over gRPC, our PyTorch model
and sentence-transformers, and prints a table, writes JSON and a plot under bench/results/.

Each engine runs in its own phase (torch and onnxruntime never busy in one process): the
FLOP peak, the raw session and the PyTorch baselines in subprocesses (`bench.phases`), the
server as an `attnserve serve` subprocess with the client in this process.
"""
