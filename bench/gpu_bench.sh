#!/usr/bin/env bash
# The GPU benchmark (bench/gpu_bench.py; docs/benchmarks.md): the server's backend at fp32 and
# fp16 (parity against the CPU, tokens/s), onnxruntime at its default options against
# `attnserve serve --device cuda` over gRPC (shape buckets, CUDA graphs, 1 vs N sessions,
# 1 to 8 front ends, cold start), and peak memory against the shape; prints its table with
# the GPU, driver and date. Phases that would not fit in the budget are skipped.
#
# From the checkout root, on a machine with an NVIDIA GPU and onnxruntime-gpu:
#   bench/gpu_bench.sh                            # exports the fp16 artifact from $CKPT (or the default model)
#   bench/gpu_bench.sh --artifact DIR             # an artifact exported with --fp16 already
#   bench/gpu_bench.sh --phases backend,memory    # parity, tokens/s and memory alone
# The checkout need not be installed (gpu_env.sh makes it importable as `attnserve`).
# Dry run without a GPU:  bench/gpu_bench.sh --device cpu --quick --artifact DIR
# Other flags go to bench/gpu_bench.py (--help). Results: $OUT (else bench/results/gpu_bench/).
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_BENCH_BUDGET_S (450: the
# Python part stops starting phases past it), GPU_BENCH_TIMEOUT_S (hard stop, 480).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
[[ -f server/_proto/attnserve/v1/encoder_pb2.py ]] || { echo "gpu_bench: server/_proto missing (make proto, or carry it)" >&2; exit 2; }
timeout --kill-after=10 "${GPU_BENCH_TIMEOUT_S:-480}" "$PYTHON" -m bench.gpu_bench \
  --budget-s "${GPU_BENCH_BUDGET_S:-450}" "$@"
status=$?
[[ $status -eq 124 || $status -eq 137 ]] && echo "gpu_bench: stopped at the time limit" >&2
exit $status
