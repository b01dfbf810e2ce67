#!/usr/bin/env bash
# A/B of one environment variable of the served components (or one flag of the benchmark) on the GPU, e.g. the GIL switch interval
# (MSTAR_SWITCH_INTERVAL_MS, docs/deployment.md): Qwen3-0.6B at real shapes (random weights), 512-token prompts,
# 256 output tokens, c=64 (AB_CONCURRENCY) through Triton gRPC and through the OpenAI proxy, one server per value,
# in one device call. The step loop's and the output pump's time lines (MSTAR_STEP_TIMES=1) land in each run's
# server log under $OUT/logs/<value>.
# Usage (device): source .device/prepare.sh && bash scripts/ab_serve_env.sh VARIABLE VALUE [VALUE ...]
#   ("" is the variable unset), e.g. bash scripts/ab_serve_env.sh MSTAR_SWITCH_INTERVAL_MS 5 0.5
# A VARIABLE that starts with -- is a flag of `bench serve` instead ("" leaves it out), e.g.
#   AB_CONCURRENCY="1 64" bash scripts/ab_serve_env.sh --triton-outputs all token_ids
# A flag's value may be several words, e.g. the mixed graphs' token buckets:
#   bash scripts/ab_serve_env.sh --token-buckets "512 1024 2048" "512 640 768 1024 1536 2048"
# AB_CONCURRENCY (default "64") sets the closed-loop levels, e.g. AB_CONCURRENCY="1 64"; each level runs
# 6 requests per stream through Triton and through the proxy. AB_PROXY_CONCURRENCY sets the proxy's levels apart
# ("" runs none: Triton alone, e.g. to fit the device time left).
set -u
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 VARIABLE VALUE [VALUE ...]" >&2; exit 2; }
VAR=$1; shift
OUT=${OUT:-/tmp/mstar-gpu-out}
WORK=/tmp/mstar-gpu
mkdir -p "$OUT/logs"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 MSTAR_CACHE_DIR=$WORK/cache TOKENIZERS_PARALLELISM=false
export MSTAR_STEP_TIMES=1
source "$(dirname "$0")/device_env.sh"
CKPT=$WORK/qwen3-0.6b
if [[ $VAR == MSTAR_* ]]; then  # every value through the switch's own parser first: a typo costs no server start
  for value in "$@"; do
    env "$VAR=$value" $IMAGE_PY -c "from mstar_common.switches import check_switches; check_switches()" \
      || { echo "refused: $VAR=$value" >&2; exit 2; }
  done
fi
timeout 150 $IMAGE_PY -c "
from mstar_common.bench.checkpoints import build_random_checkpoint
print(build_random_checkpoint('qwen3-0.6b', '$CKPT'))" 2>&1 | tail -n 1
for value in "$@"; do
  tag=${value:-unset}; tag=${tag// /_}
  echo "=== $VAR=$tag"
  flag=(); setting=("$VAR=$value")
  # a flag's value of several words is several arguments (after the script's own, so it wins)
  if [[ $VAR == --* ]]; then setting=(); read -ra words <<< "$value"; [ -n "$value" ] && flag=("$VAR" "${words[@]}"); fi
  env "${setting[@]}" MSTAR_BENCH_LOG_DIR=$OUT/logs/$tag timeout 240 $PY scripts/bench.py serve \
    --family qwen3 --checkpoint "$CKPT" --name qwen3-0.6b --prompt-len 512 --output-len 256 \
    --concurrency ${AB_CONCURRENCY:-64} --proxy-concurrency ${AB_PROXY_CONCURRENCY-${AB_CONCURRENCY:-64}} --requests-per-level 6 --check-eager 0 --no-capture-sampling \
    --decode-buckets 1 2 4 8 16 32 64 --token-buckets 512 1024 2048 --out "$OUT/ab_${VAR#--}_$tag.json" "${flag[@]}" \
    2>&1 | grep "\[bench\]" || echo "RUN FAILED: $tag"
  grep -h "step times\|output\]" "$OUT"/logs/$tag/*.log 2>/dev/null | tail -n 6
done
