#!/usr/bin/env bash
# Sourced by the device scripts after `source .device/prepare.sh`: picks the two Pythons of the device.
# The server runs in the prepared venv (numpy 1.x for the Python-backend stub). transformers' model classes
# need the image's own numpy 2.x stack (its scipy), so checkpoints, HF generate and the tests use that Python.
PY=python
IMAGE_SITE=$(cat /tmp/mstar-venv/lib/python3*/site-packages/image-packages.pth 2>/dev/null)
IMAGE_PY=${IMAGE_SITE%/lib/*}/bin/python3
[ -x "$IMAGE_PY" ] || IMAGE_PY=python3
# transformers imports sklearn.metrics (for assisted generation) on the way to AutoTokenizer, and the image's
# scikit-learn/scipy fail under NumPy 1.x; serving never uses it, so the server's venv gets a stand-in.
VENV_SITE=$(ls -d /tmp/mstar-venv/lib/python3*/site-packages 2>/dev/null)
if [ -n "$VENV_SITE" ]; then
  cat > "$VENV_SITE/mstar_sklearn_shim.py" <<'SHIM'
import importlib.machinery
import sys
import types


def _module(name):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    return module


def _roc_curve(*args, **kwargs):
    raise RuntimeError("scikit-learn is not usable beside NumPy 1.x in this environment")


if "sklearn" not in sys.modules:
    sklearn, metrics = _module("sklearn"), _module("sklearn.metrics")
    metrics.roc_curve = _roc_curve
    sklearn.metrics = metrics
    sys.modules["sklearn"], sys.modules["sklearn.metrics"] = sklearn, metrics
SHIM
  echo "import mstar_sklearn_shim" > "$VENV_SITE/00-mstar-sklearn-shim.pth"
fi
# soundfile (whisper's tests and its baseline write WAV uploads with it) is missing from the image's Python: take the
# server's wheels from .device/ (without it tests/unit/test_whisper_parity.py fails to collect and stops the run)
ensure_soundfile() {
  if ! $IMAGE_PY -c "import soundfile" 2>/dev/null && ls .device/soundfile-*.whl >/dev/null 2>&1; then
    $IMAGE_PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/soundfile-*.whl \
      .device/cffi-*.whl .device/pycparser-*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-$PWD}
  fi
}
