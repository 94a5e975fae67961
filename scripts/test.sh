#!/usr/bin/env bash
# The one test command: set up (idempotent, never serves), then the whole suite. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -k cli -x`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
