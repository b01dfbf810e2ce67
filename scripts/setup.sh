#!/usr/bin/env bash
# Sets up .venv with the project and its test tools (idempotent; a second run is quick).
# PYTHON picks the interpreter (3.11+); TORCH_VERSION pins torch (2.13.0: the CPU build on our dev/CI
# machines; on a GPU machine PyPI's build of the same version has CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install -q -e '.[test]'
# Puts the Python-backend stub for this Python beside the backend (fails loudly if the wheel lacks it).
.venv/bin/python -c "from mstar_common.triton_env import find_triton; print('tritonserver:', find_triton().binary)"
