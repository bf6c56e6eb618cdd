#!/usr/bin/env bash
# What can be checked of the GPU image on a machine without a GPU:
#   deploy/docker/check-gpu-image.sh [IMAGE]     (default attnserve:0.1.0-gpu)
# Each check prints one line; the first that fails stops the script (exit 1).
#
# Not checked here, because it needs an NVIDIA GPU and its driver: that onnxruntime's CUDA
# provider loads (it links libcuda.so.1, the driver's library, which the NVIDIA container
# toolkit mounts from the node; no image carries it), that a CUDA session runs and agrees
# with the CPU, NVML's memory gauges, and `--device cuda` starting at all.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
image=${1:-attnserve:0.1.0-gpu}
engine="$here/engine.sh"

run() { "$engine" run --rm --entrypoint "$1" "$image" "${@:2}"; }
ok() { echo "ok: $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

config=$("$engine" image inspect --format '{{.Config.User}} {{json .Config.Entrypoint}} {{json .Config.Cmd}}' "$image")
[ "$config" = '10001:10001 ["attnserve","serve","--artifact","/artifact"] ["--device","cuda"]' ] ||
    fail "user, entrypoint, command: $config"
ok "runs as 10001:10001: attnserve serve --artifact /artifact --device cuda"

providers=$(run python -c "import onnxruntime as o; print(o.__version__, *o.get_available_providers())")
case " $providers " in
    *" CUDAExecutionProvider "*) ok "onnxruntime-gpu imports: $providers" ;;
    *) fail "no CUDAExecutionProvider: $providers" ;;
esac

# Every library the CUDA provider links resolves but the driver's (libcuda.so.1), and the
# ones it opens at run time (cuDNN 9, cuFFT, NVRTC) are on the loader's path.
missing=$(run sh -c 'ldd /opt/venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so | sed -n "s/^\s*\(\S*\) => not found/\1/p"' | tr '\n' ' ')
[ "$missing" = "libcuda.so.1 " ] || fail "CUDA provider: unresolved libraries: ${missing:-none}; expected only libcuda.so.1"
ok "CUDA provider's libraries all resolve but the driver's libcuda.so.1 (the node's)"
for lib in libcudnn.so.9 libcufft.so.12 libnvrtc.so.13; do
    run sh -c "ldconfig -p | grep -q '$lib '" || fail "$lib is not on the loader's path"
done
ok "cuDNN 9, cuFFT and NVRTC on the loader's path"

# A CUDA session: onnxruntime cannot load its CUDA provider for the driver's library alone
# (and falls back to the CPU, which the server's --device cuda does not).
session=$(run python -c "
import onnxruntime as o
s = o.InferenceSession('/artifact/encoder.onnx', providers=['CUDAExecutionProvider'])
print('providers:', *s.get_providers())" 2>&1 | sed 's/\x1b\[[0-9;]*m//g')
reason=$(sed -n 's/.*libonnxruntime_providers_cuda.so with error: //p' <<<"$session")
[ "$reason" = "libcuda.so.1: cannot open shared object file: No such file or directory" ] ||
    fail "a CUDA session without a GPU: $session"
ok "a CUDA session fails to load the provider only for the driver: $reason"

run python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" ||
    fail "torch is importable"
ok "no torch"

run attnserve serve --check-config --artifact /artifact --device cpu >/dev/null 2>&1 ||
    fail "--check-config --device cpu"
ok "attnserve serve --check-config --device cpu passes"

out=$(run attnserve serve --check-config --artifact /artifact --device cuda 2>&1) && status=0 || status=$?
[ "$status" = 2 ] && [[ "$out" == *"no usable GPU"* ]] ||
    fail "--check-config --device cuda without a GPU: exit $status: $out"
ok "--device cuda refuses to start without a GPU (exit 2: no usable GPU)"

size=$("$engine" image inspect --format '{{.Size}}' "$image")
ok "image size $size bytes ($((size / 1000000)) MB)"
