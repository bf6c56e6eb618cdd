#!/usr/bin/env bash
# Build an attnserve image from the repository root, with podman or docker
# (deploy/docker/engine.sh chooses; ENGINE=docker forces one):
#
#   deploy/docker/build.sh cpu|gpu [--local] [--tag TAG] [--torch-wheels DIR]
#                          [-- ENGINE-BUILD-ARGS...]
#
# With no options this is the plain build of deploy/README.md: the Dockerfile's defaults
# (python:3.11-slim, nvidia/cuda, torch from PyTorch's CPU index), for a machine that
# reaches a registry. Anything after `--` goes to `build` as it is (`--build-arg
# PIP_INDEX_URL=...`, `--build-arg PYTHON_IMAGE=mirror/python:3.11-slim`, ...).
#
# --local: for a machine that reaches neither a registry nor PyTorch's index (package
#   indexes only):
#   - the base is made locally (deploy/docker/make-base.sh: Debian bookworm, Python 3.11),
#     for the CPU image's stages, and for the GPU image's Python stages and CUDA stages
#     alike; the GPU image then takes CUDA and cuDNN from NVIDIA's pip wheels
#     (ORT_EXTRAS=cuda,cudnn) instead of the nvidia/cuda base;
#   - torch's CPU wheel comes from a local wheel directory: --torch-wheels DIR, or else
#     the directory pip is configured with (`pip config list`: find-links) when it holds
#     a torch CPU wheel;
#   - pip inside the build trusts the host's CA bundle (the local base carries it).
# --torch-wheels DIR: torch from DIR (podman: DIR is mounted read-only into the build;
#   docker cannot mount one into a build: serve DIR over HTTP and pass
#   `-- --build-arg TORCH_INDEX_URL= --build-arg TORCH_FIND_LINKS=http://...` instead).
# --tag TAG: default attnserve:0.1.0-cpu / attnserve:0.1.0-gpu.
#
# Prints the build's wall time and the image's size at the end.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
engine_sh="$here/engine.sh"
base_tag=localhost/attnserve-base:bookworm

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

device=${1:-}
case "$device" in cpu|gpu) shift ;; *) usage ;; esac
local_build="" tag="" wheels="" extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --local) local_build=1 ;;
        --tag) tag=${2:?--tag needs a value}; shift ;;
        --torch-wheels) wheels=${2:?--torch-wheels needs a directory}; shift ;;
        --) shift; extra=("$@"); break ;;
        *) usage ;;
    esac
    shift
done
tag=${tag:-attnserve:0.1.0-$device}
engine=$("$engine_sh" --name)

# pip's configured wheel directories (find-links), the first that holds torch's CPU wheel.
pip_wheel_dir() {
    local python dirs dir
    python=$(command -v python3.11 || command -v python3) || return 0
    dirs=$("$python" -m pip config list 2>/dev/null |
           sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n') || true
    for dir in $dirs; do
        dir=${dir#file://}
        if compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null; then
            echo "$dir"
            return 0
        fi
    done
}

args=(-f "$repo/deploy/docker/Dockerfile.$device" -t "$tag")
if [ -n "$local_build" ]; then
    "$here/make-base.sh" "$base_tag"
    args+=(--network=host --build-arg "PYTHON_IMAGE=$base_tag"
           --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
    [ "$engine" = podman ] && args+=(--pull=never)
    if [ "$device" = gpu ]; then
        args+=(--build-arg "CUDA_IMAGE=$base_tag" --build-arg ORT_EXTRAS=cuda,cudnn)
    fi
    wheels=${wheels:-$(pip_wheel_dir)}
fi
if [ -n "$wheels" ]; then
    [ -d "$wheels" ] || { echo "build.sh: --torch-wheels $wheels is not a directory" >&2; exit 2; }
    if [ "$engine" != podman ]; then
        echo "build.sh: $engine cannot mount $wheels into a build; serve it over HTTP and pass" \
             "-- --build-arg TORCH_INDEX_URL= --build-arg TORCH_FIND_LINKS=http://..." >&2
        exit 2
    fi
    args+=(-v "$(cd "$wheels" && pwd):/torch-wheels:ro"
           --build-arg TORCH_INDEX_URL= --build-arg TORCH_FIND_LINKS=/torch-wheels)
fi

started=$(date +%s)
echo "build.sh: $engine build ${args[*]} ${extra[*]} $repo"
"$engine_sh" build "${args[@]}" "${extra[@]}" "$repo"
seconds=$(($(date +%s) - started))
size=$("$engine_sh" image inspect --format '{{.Size}}' "$tag")
echo "build.sh: $tag built in $seconds s; image size $size bytes ($((size / 1000000)) MB)"
