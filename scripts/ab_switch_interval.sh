#!/usr/bin/env bash
# A/B of the component processes' GIL switch interval (MSTAR_SWITCH_INTERVAL_MS, docs/deployment.md) on the GPU:
# Qwen3-0.6B at real shapes (random weights), 512-token prompts, 256 output tokens, c=64 through Triton gRPC and
# through the OpenAI proxy, once per interval (unset = Python's 5 ms), in one device call. The step loop's and
# the output pump's time lines (MSTAR_STEP_TIMES=1) land in each run's server log under $OUT/logs.
# Usage (device): source .device/prepare.sh && bash scripts/ab_switch_interval.sh [INTERVAL_MS ...]   (default: "" 0.5)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mstar-gpu-out}
WORK=/tmp/mstar-gpu
mkdir -p "$OUT/logs"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 MSTAR_CACHE_DIR=$WORK/cache TOKENIZERS_PARALLELISM=false
export MSTAR_STEP_TIMES=1
source "$(dirname "$0")/device_env.sh"
CKPT=$WORK/qwen3-0.6b
timeout 150 $IMAGE_PY -c "
from mstar_common.bench.checkpoints import build_random_checkpoint
print(build_random_checkpoint('qwen3-0.6b', '$CKPT'))" 2>&1 | tail -n 1
[ $# -eq 0 ] && set -- "" 0.5
for interval in "$@"; do
  tag=${interval:-default}
  echo "=== switch interval: ${interval:-unset (5 ms)}"
  MSTAR_BENCH_LOG_DIR=$OUT/logs/$tag MSTAR_SWITCH_INTERVAL_MS=$interval timeout 240 $PY scripts/bench.py serve \
    --family qwen3 --checkpoint "$CKPT" --name qwen3-0.6b --prompt-len 512 --output-len 256 --concurrency 64 \
    --proxy-concurrency 64 --requests-per-level 6 --check-eager 0 --no-capture-sampling \
    --decode-buckets 1 2 4 8 16 32 64 --token-buckets 512 1024 2048 4096 --out "$OUT/switch_$tag.json" \
    2>&1 | grep "\[bench\]" || echo "RUN FAILED: $tag"
  grep -h "step times\|output\]" "$OUT"/logs/$tag/*.log 2>/dev/null | tail -n 6
done
