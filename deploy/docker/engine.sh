#!/usr/bin/env bash
# The container engine that the image scripts and tests use:
#   deploy/docker/engine.sh ARGS...   runs the engine with ARGS (build, run, kube play, ...)
#   deploy/docker/engine.sh --name    prints which engine that is
# ENGINE=podman|docker chooses; otherwise podman where it is installed, else docker where
# it has a working daemon (`docker info`).
#
# Podman gets two settings where the machine needs them (and only there), through a
# containers.conf of its own (CONTAINERS_CONF; one already set is left alone):
# - runtime runc where /sys/fs/cgroup is not cgroup v2 only: crun, podman's default, stops
#   with "cgroups in hybrid mode not supported" there;
# - explicit ulimits (nofile and nproc 4096, or the caller's soft limit where that is
#   lower) where the caller lacks CAP_SYS_RESOURCE: runc otherwise fails every container
#   and every build step with "error setting rlimits ... operation not permitted". On the
#   machine this was written on (shell limits nofile 20000, nproc 96364), 8192 failed too:
#   podman's own processes run with lower limits than the shell (conmon: nproc 32768).
set -euo pipefail

pick() {
    if [ -n "${ENGINE:-}" ]; then
        echo "$ENGINE"
    elif command -v podman >/dev/null; then
        echo podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    else
        echo "no container engine: install podman (Debian: apt-get install podman runc)," \
             "or docker with a running daemon" >&2
        exit 127
    fi
}

engine=$(pick)
if [ "${1:-}" = "--name" ]; then
    echo "$engine"
    exit 0
fi

if [ "$engine" = podman ] && [ -z "${CONTAINERS_CONF:-}" ]; then
    conf_lines=()
    if [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && command -v runc >/dev/null; then
        conf_lines+=("[engine]" "runtime = \"runc\"")
    fi
    # CAP_SYS_RESOURCE is capability 24.
    cap_eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
    if (( (0x$cap_eff >> 24 & 1) == 0 )); then
        nofile=$(ulimit -Sn) nproc=$(ulimit -Su)
        [ "$nofile" = unlimited ] || [ "$nofile" -gt 4096 ] && nofile=4096
        [ "$nproc" = unlimited ] || [ "$nproc" -gt 4096 ] && nproc=4096
        conf_lines+=("[containers]"
                     "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]")
    fi
    if [ ${#conf_lines[@]} -gt 0 ]; then
        dir=${XDG_RUNTIME_DIR:-/tmp}
        conf=$dir/attnserve-containers-$(id -u).conf
        tmp=$(mktemp "$dir/attnserve-containers.XXXXXX")
        printf '%s\n' "${conf_lines[@]}" >"$tmp"
        mv -f "$tmp" "$conf"
        export CONTAINERS_CONF=$conf
    fi
fi

exec "$engine" "$@"
