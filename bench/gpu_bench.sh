#!/usr/bin/env bash
# The GPU benchmark, `python -m bench gpu` (bench/benchmarks/gpu.py; docs/benchmarks.md): the
# server's backend at fp32 and fp16 (parity against the CPU, tokens/s), onnxruntime at its
# default options against `attnserve serve --device cuda` over gRPC (shape buckets, CUDA graphs,
# 1 vs N sessions, 1 to 8 front ends, cold start), and peak memory against the shape; prints its
# table with the GPU, driver and date. Phases that would not fit in the budget are skipped.
#
# From the checkout root, on a machine with an NVIDIA GPU and onnxruntime-gpu:
#   bench/gpu_bench.sh                            # exports the fp16 artifact from $CKPT (or the default model)
#   bench/gpu_bench.sh --artifact DIR             # an artifact exported with --fp16 already
#   bench/gpu_bench.sh --phases backend,memory    # parity, tokens/s and memory alone
# Dry run without a GPU:  bench/gpu_bench.sh --device cpu --quick --artifact DIR
# Other flags: python -m bench gpu --help. Results: $OUT (else bench/results/gpu/).
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_BENCH_BUDGET_S (450: the
# Python part stops starting phases past it), GPU_BENCH_TIMEOUT_S (hard stop, 480).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# `attnserve` is the repository root, so a checkout that was never installed (a GPU machine
# without a package index, say) imports only through an entry of that name on sys.path; first
# on the path, so this checkout (its generated stubs included) wins over any installed copy.
mkdir -p /tmp/pkg && ln -sfn "$ROOT" /tmp/pkg/attnserve
export PYTHONPATH="/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
[[ -f server/_proto/attnserve/v1/encoder_pb2.py ]] || { echo "gpu_bench: server/_proto missing (make proto, or carry it)" >&2; exit 2; }
timeout --kill-after=10 "${GPU_BENCH_TIMEOUT_S:-480}" "$PYTHON" -m bench gpu \
  --budget-s "${GPU_BENCH_BUDGET_S:-450}" --out-dir "${OUT:-bench/results/gpu}" "$@"
status=$?
[[ $status -eq 124 || $status -eq 137 ]] && echo "gpu_bench: stopped at the time limit" >&2
exit $status
