#!/usr/bin/env bash
# YaRN RoPE on the GPU (docs/benchmarks.md, "YaRN RoPE served on the GPU ..."): a random Qwen3-0.6B at the real
# shapes given Qwen3's long-context RoPE (yarn, factor 4 over 32,768 positions), served with CUDA graphs, the
# overlapped step and the fused kernels, its greedy tokens checked against the in-process eager engine, at
# 512-token prompts and at 36,000-token prompts (past the 32,768 positions the scaling starts from).
# On the device: bash scripts/yarn_gpu_check.sh (writes under $OUT; sources .device/prepare.sh first).
set -u
OUT=${OUT:-/tmp/yarn_check}
mkdir -p "$OUT"
source .device/prepare.sh > /tmp/prep.log 2>&1; tail -1 /tmp/prep.log
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
name=qwen3-0.6b-yarn
timeout 90 $IMAGE_PY - <<'PY'
import json, shutil
from mstar_common.bench.checkpoints import build_random_checkpoint
src = build_random_checkpoint('qwen3-0.6b', '/tmp/mstar-gpu/qwen3-0.6b')
shutil.copytree(src, '/tmp/mstar-gpu/qwen3-0.6b-yarn', dirs_exist_ok=True)
path = '/tmp/mstar-gpu/qwen3-0.6b-yarn/config.json'
config = json.load(open(path))
config.pop('rope_scaling', None)
theta = config.pop('rope_theta', None) or config.get('rope_parameters', {}).get('rope_theta', 1e6)
config['rope_parameters'] = {'rope_type': 'yarn', 'rope_theta': theta, 'factor': 4.0,
                             'original_max_position_embeddings': 32768}
json.dump(config, open(path, 'w'), indent=1)
print('yarn checkpoint', config['rope_parameters'])
PY
COMMON=(--family qwen3 --checkpoint /tmp/mstar-gpu/$name --concurrency 1 --check-eager 2 --no-capture-sampling
        --decode-buckets 1 2)
timeout 220 $PY scripts/bench.py serve "${COMMON[@]}" --name $name --prompt-len 512 --output-len 128 \
  --requests-per-level 2 --min-requests 4 --token-buckets 512 --max-model-len 2048 --max-concurrent 4 \
  --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
echo "== 512-token prompts: rc $?"
grep -E "\[bench\] triton \{|identical" "$OUT/$name.log" | tail -2
timeout 330 $PY scripts/bench.py serve "${COMMON[@]}" --name $name-36k --prompt-len 36000 --output-len 64 \
  --check-len 64 --requests-per-level 1 --min-requests 2 --token-buckets 512 2048 --max-model-len 40960 \
  --max-concurrent 2 --num-pages 1400 --out "$OUT/$name-36k.json" > "$OUT/$name-36k.log" 2>&1
echo "== 36,000-token prompts: rc $?"
grep -E "\[bench\] triton \{|identical" "$OUT/$name-36k.log" | tail -2
