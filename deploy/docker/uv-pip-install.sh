#!/bin/sh
# `uv pip install` into the venv of PYTHON, for the image's build stages:
#   uv-pip-install.sh PYTHON [PIP-INSTALL-ARGS...]
# uv installs the dependencies minutes faster than pip on 2 cores (about 150 s of pip in a
# cold CPU build). It reads no PIP_* variable, so pip's settings, the build args
# PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST and PIP_CERT, are handed to it as
# flags, and like pip it weighs every index alike (torch's CPU wheel from a find-links
# directory beside the index). uv itself goes into /opt/uv, which no stage copies on.
set -eu
python=$1
shift
if [ ! -x /opt/uv/bin/uv ]; then
    python3 -m venv /opt/uv
    /opt/uv/bin/pip install --quiet uv
fi
set -- --python "$python" --index-strategy unsafe-best-match "$@"
case " $* " in
    *" --index-url "*) ;;  # the caller's own, which wins as on pip's command line
    *) if [ -n "${PIP_INDEX_URL:-}" ]; then set -- --index-url "$PIP_INDEX_URL" "$@"; fi ;;
esac
for url in ${PIP_EXTRA_INDEX_URL:-}; do set -- --extra-index-url "$url" "$@"; done
for host in ${PIP_TRUSTED_HOST:-}; do set -- --allow-insecure-host "$host" "$@"; done
if [ -n "${PIP_CERT:-}" ]; then export SSL_CERT_FILE="$PIP_CERT"; fi
export UV_NO_CACHE=1  # as pip's PIP_NO_CACHE_DIR: nothing kept in the layer
exec /opt/uv/bin/uv pip install "$@"
