#!/usr/bin/env bash
# The GPU benchmark: raw onnxruntime CUDA session vs `attnserve serve --device cuda` over
# gRPC, shape buckets, CUDA graphs, 1 vs N sessions, cold start; prints the README's GPU
# table (bench/gpu_bench.py) in about 5 minutes.
#
# On the GPU machine (no package index; see shared/gpu/README.md), from the checkout root:
#   mkdir -p /tmp/gp && cp -r .gpu1/. /tmp/gp/          # part 1
#   source .gpu2/unpack.sh && bench/gpu_bench.sh        # part 2: exports from $CKPT
# Dry run without a GPU:  bench/gpu_bench.sh --device cpu --quick --artifact DIR
# Other flags go to bench/gpu_bench.py (--help). Results: $OUT (else bench/results/gpu_bench/).
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_BENCH_BUDGET_S (330: the
# Python part stops starting phases past it), GPU_BENCH_TIMEOUT_S (hard stop, 360).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
[[ -f server/_proto/attnserve/v1/encoder_pb2.py ]] || { echo "gpu_bench: server/_proto missing (make proto, or carry it)" >&2; exit 2; }
timeout --kill-after=10 "${GPU_BENCH_TIMEOUT_S:-360}" "$PYTHON" -m attnserve.bench.gpu_bench \
  --budget-s "${GPU_BENCH_BUDGET_S:-330}" "$@"
status=$?
[[ $status -eq 124 || $status -eq 137 ]] && echo "gpu_bench: stopped at the time limit" >&2
exit $status
