#!/usr/bin/env bash
# The one test command: set up (idempotent, never serves), then the whole suite. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -k cli -x`. `--fast` first runs the fast lane instead: every
# test not marked slow (no real SmolLM2 analysis, no browser, no end-to-end service), a couple of
# minutes, for the loop of a change; the whole suite stays the check before it lands.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
lane=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  lane=(-m "not slow")
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "${lane[@]}" "$@"
