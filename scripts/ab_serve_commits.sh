#!/usr/bin/env bash
# A/B of two commits' serving path on one GPU machine, in turns (old, new, old, new): the Qwen3-0.6B benchmark at
# real shapes (random weights), 512-token prompts, 256 output tokens, c=1 and c=64 through Triton gRPC, each arm's
# results JSON and log under $OUT (old1, new1, old2, new2). OLD_TGZ is the other commit's tree, made here with
#   git archive --format=tar.gz -o .ab/old.tgz <commit>
# and carried to the device with the working tree (the new arm is this checkout). TOTAL (default 585) is the
# seconds the whole call may take; an arm that would not fit is skipped and says so.
# Usage (device): source .device/prepare.sh && bash scripts/ab_serve_commits.sh .ab/old.tgz [TOTAL]
set -u
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 OLD_TGZ [TOTAL]" >&2; exit 2; }
OLD_TGZ=$1; TOTAL=${2:-585}
OUT=${OUT:-/tmp/mstar-gpu-out}; mkdir -p "$OUT"
source scripts/device_env.sh
NEW=$PWD; mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
echo "host: $(nproc) cpus; $(lscpu | grep 'Model name' | sed 's/  */ /g'); load $(cat /proc/loadavg)"
T0=$(date +%s)
timeout 60 $IMAGE_PY -c "
from mstar_common.bench.checkpoints import build_random_checkpoint
print(build_random_checkpoint('qwen3-0.6b', '/tmp/mstar-gpu/qwen3-0.6b'))" > /dev/null 2>&1
LOAD=(--prompt-len 512 --output-len 256 --concurrency 1 64 --requests-per-level 2 --min-requests 12
      --no-capture-sampling --decode-buckets 1 2 4 8 16 32 64 --token-buckets 512 1024 2048)
run() {  # label dir
  local left=$(( TOTAL - ($(date +%s) - T0) ))
  [ $left -lt 90 ] && { echo "$1: skipped, $left s left"; return; }
  (cd "$2" && PYTHONPATH="$2" timeout $(( left < 160 ? left : 160 )) $PY scripts/bench.py serve --family qwen3 \
     --checkpoint /tmp/mstar-gpu/qwen3-0.6b --name qwen3-0.6b --out "$OUT/$1.json" "${LOAD[@]}" > "$OUT/$1.log" 2>&1)
  echo "== $1 rc $? at t+$(( $(date +%s) - T0 )) s; load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -E "\[bench\] triton \{" "$OUT/$1.log" | sed 's/.*triton/triton/' | cut -c1-200
}
run old1 /tmp/old; run new1 "$NEW"; run old2 /tmp/old; run new2 "$NEW"
