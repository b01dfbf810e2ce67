#!/usr/bin/env bash
# One command from a fresh clone to a running server: set up, then serve a deployment
# (default: the built-in tiny Qwen3 demo, built locally; no downloads). Extra args go to `mstar serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/mstar serve "${@:-qwen3}"
