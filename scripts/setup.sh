#!/usr/bin/env bash
# Idempotent setup of a fresh checkout: .venv (Python 3.11), CPU torch first (a plain `pip install
# torch` would pull a multi-GB CUDA build), the package with its dev and training extras, and both catalog models.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
TORCH_SPEC="torch==2.13.0"

if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON="${PYTHON:-$(command -v python3.11 || true)}"
  if [[ -z "$PYTHON" ]]; then
    echo "setup.sh: python3.11 is required (set PYTHON=/path/to/python3.11)" >&2
    exit 1
  fi
  echo "setup.sh: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  # Pinned: a plain `torch` could resolve to another build. TORCH_INDEX_URL selects a wheel index
  # (e.g. https://download.pytorch.org/whl/cpu) where one is reachable.
  echo "setup.sh: installing $TORCH_SPEC"
  "${PIP[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
fi
"${PIP[@]}" install -q -e '.[dev,training]'

"$VENV/bin/fisherscope" fetch smollm2-135m
"$VENV/bin/fisherscope" fetch tiny-random
echo "setup.sh: ready. Serve with: .venv/bin/fisherscope serve"
