#!/usr/bin/env bash
# Sets up what the tests need, then runs them (GPU tests skip without a GPU). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "${@:-tests}"
