# Sourced by gpu_bench.sh: the checkout as the working directory, the
# interpreter ($PYTHON, default .venv/bin/python, else python3), and `attnserve`
# importable. `attnserve` is the repository root, so a checkout that was never installed
# (a GPU machine without a package index, say) imports only through an entry of that name
# on sys.path; first on the path, so this checkout (its generated stubs included) wins
# over any installed copy.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p /tmp/pkg && ln -sfn "$ROOT" /tmp/pkg/attnserve
export PYTHONPATH="/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
