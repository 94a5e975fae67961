#!/usr/bin/env bash
# The wheels benchmarks/bench_gpu.py needs on the GPU machine beyond its image, which has torch,
# transformers, tokenizers, numba and pytest but not pydantic (backend.settings and the schemas):
# this venv's versions, built for that image's Python 3.12, into .whl/ (ignored by git). The GPU
# machine then installs them with --no-index (bench_gpu.py's docstring has the command).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
pins=()
for name in pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types \
  typing-extensions; do
  pins+=("$name==$($python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
rm -rf .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls -1 .whl
du -sh .whl
