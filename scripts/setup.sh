#!/usr/bin/env bash
# Sets up .venv with the project and its test tools (idempotent; a second run is quick).
# PYTHON picks the interpreter (3.11 or 3.12); TORCH_VERSION pins torch (2.13.0: the CPU build on our dev/CI
# machines; on a GPU machine PyPI's build of the same version has CUDA); TRITON_VERSION pins the Triton compiler
# installed where torch brought none (3.9.0: its interpreter runs the kernel tests on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # pyproject's requires-python, said before anything is installed: on 3.13+ pip would try to build NumPy 1.x
  if ! "$py" -c "import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))"; then
    echo "setup.sh: $("$py" --version 2>&1) ($py) is not supported: use Python 3.11 or 3.12 (PYTHON=python3.12)" >&2
    exit 1
  fi
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install -q -e '.[test]'
# Triton (the compiler): a CUDA build of torch brings its own; on a CPU the kernel tests run its interpreter
if ! .venv/bin/python -c "import triton" 2>/dev/null; then
  .venv/bin/pip install -q "triton==${TRITON_VERSION:-3.9.0}"
fi
# Puts the Python-backend stub for this Python beside the backend (fails loudly if the wheel lacks it).
.venv/bin/python -c "from mstar_common.triton_env import find_triton; print('tritonserver:', find_triton().binary)"
