#!/usr/bin/env bash
# Create .venv in the repository root with a CPU torch, verl 0.9.1 and this project (editable).
# Idempotent: re-running only installs what is missing. No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q "verl[verl-core]==0.9.1"
.venv/bin/python -m pip install -q -e ".[verl,test]"
.venv/bin/python -c "import verl, torch, tailsieve_verl; print('env ok: verl', verl.__version__, 'torch', torch.__version__)"
