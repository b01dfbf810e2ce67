#!/usr/bin/env bash
# A/B/A of a code change on the whisper served bench (device; after `source .device/prepare.sh`):
#   bash scripts/ab_whisper_served.sh OTHER_DIR FILE...
# Arms: the working tree's FILEs, then OTHER_DIR/FILE (the other version of each, e.g. written by
# `git show REV:FILE > OTHER_DIR/FILE` before the call, and carried), then the working tree's again; each arm
# runs `scripts/bench_whisper.py` served (ITL at c=1, RTFx at c=1/16/64) on the random large-v3 checkpoint, its
# report in $OUT/whisper_served_{a,b,a2}.json. The working tree's files are restored at the end.
set -u
cd "$(dirname "$0")/.."
OTHER=$1; shift
OUT=${OUT:-/tmp/mstar-gpu-out}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 MSTAR_CACHE_DIR=/tmp/mstar-gpu/cache
source scripts/device_env.sh
timeout 150 $IMAGE_PY -c "
from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.families.registry import get_family
print(resolve_checkpoint('builtin:whisper-large-v3-random', get_family('whisper').builtin_checkpoints))" \
  || { echo "the checkpoint could not be built"; exit 1; }
SAVED=$(mktemp -d)
for f in "$@"; do mkdir -p "$SAVED/$(dirname "$f")"; cp "$f" "$SAVED/$f"; done
swap() { for f in "${@:2}"; do cp "$1/$f" "$f"; done; }
for arm in a b a2; do
  if [ $arm = b ]; then swap "$OTHER" "$@"; else swap "$SAVED" "$@"; fi
  echo "=== arm $arm ($( [ $arm = b ] && echo "$OTHER" || echo "working tree" )) $(date -u +%T)"
  MSTAR_BENCH_LOG_DIR=$OUT/$arm timeout 200 $PY scripts/bench_whisper.py --baseline-concurrency "" \
    --out "$OUT/whisper_served_$arm.json" 2>&1 | grep -E '^(mstar|system)' || echo "ARM FAILED: $arm"
done
swap "$SAVED" "$@"
