#!/usr/bin/env bash
# Family benchmarks on the device, in one call: Orpheus TTS (served, then the HF-generate + snac baseline under
# the image's Python), FLUX.2 klein (engine + diffusers baseline), Z-Image-Turbo, Whisper. Pick with arguments
# (default: all).
# Carried wheels (snac, diffusers) in .whl/ are installed to /tmp/site (diffusers cut by scripts/trim_diffusers_wheel.py:
# the whole wheel does not fit a call's 64 MiB carry beside .device/). Results land in $OUT.
# Usage (device): source .device/prepare.sh && bash scripts/gpu_family_benches.sh [orpheus] [orpheus-served]
#   [gpu-tests] [sweeps] [attention-variants] [gemv-sweep] [profile] [pdl] [persistent] [gemv-chain] [ab] [orpheus-probe] [orpheus-baseline] [orpheus-inproc] [dit-kernels] [flux2] [flux2-served] [z-image] [whisper]
#   [whisper-probe] [stub-health] [orpheus-pyspy]
# Env: ORPHEUS_ARGS (extra bench_orpheus.py flags), ORPHEUS_TIMEOUT, BASELINE_CONCURRENCY / BASELINE_TIMEOUT, MSTAR_STACK_DUMP_S, STUB_HEALTH_S,
#   PROBE_ARGS / PROBE_CONCURRENCY / PROBE_SAMPLING / PROBE_PROFILE_C (probe_orpheus_engine.py), FLUX_ARGS
#   (e.g. --profile) / FLUX_TIMEOUT (bench_flux2.py), ZIMAGE_ARGS (both z-image runs, e.g. --concurrency 1,4) /
#   ZIMAGE_TIMEOUT (each of them), SWEEP_TIMEOUT, GEMV_ARGS (sweep_gemv.py), PROFILE_ARGS / PROFILE_TIMEOUT
#   (profile_decode_step.py); PDL_FAMILIES / PDL_ROWS / PDL_MAX_ROWS (the pdl stage); PERSISTENT_SETTINGS /
#   PERSISTENT_TIMEOUT (the persistent stage); AB_FAMILIES / AB_ROWS / AB_VARIANTS (the
#   ab stage: ab_decode_step.py --variant flags); DIT_ARGS / DIT_TIMEOUT (bench_dit_kernels.py); MSTAR_GEMV_MAX_ROWS, MSTAR_TOP_P_KERNEL,
#   MSTAR_FP8_FP16_DOTS, MSTAR_DECODE_FORM, MSTAR_DIFFUSION_KERNELS, MSTAR_DIT_ATTENTION, MSTAR_DENOISE_EXACT_BATCHES,
#   MSTAR_PDL, MSTAR_PDL_MAX_ROWS
#   reach every engine built.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mstar-gpu-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 MSTAR_CACHE_DIR=/tmp/mstar-gpu/cache
exec > >(tee -a "$OUT/families.log") 2>&1
source "$(dirname "$0")/device_env.sh"
if ls .whl/*.whl >/dev/null 2>&1; then
  $IMAGE_PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# The stubs do not see /tmp/site: what they import beyond the image goes into the server's venv (isal: PNG deflate).
if ls .whl/isal-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile .whl/isal-*.whl
fi
# Native frames of any stub that dies of a fatal signal (docs/architecture.md); skipped without a C compiler.
if $PY -m mstar_common.native_backtrace /tmp/mstar_backtrace.so >/dev/null 2>&1; then
  export MSTAR_NATIVE_BACKTRACE=/tmp/mstar_backtrace.so
fi
T0=$(date +%s)
stage() { echo; echo "=== $1 (t+$(( $(date +%s) - T0 )) s)"; }
FAILED=()  # the stages that failed: the script goes on past each, and exits 1 at its end if any did
failed() { echo "STAGE FAILED: $1"; FAILED+=("$1"); }
ARGS=("$@")
has() { [ ${#ARGS[@]} -eq 0 ] || [[ " ${ARGS[*]} " == *" $1 "* ]]; }

if has gpu-tests; then
  stage "GPU tests: kernels (incl. fp8 KV, SNAC) and the GPU-marked unit tests, under the image's Python"
  ensure_soundfile
  timeout ${GPU_TESTS_TIMEOUT:-360} $IMAGE_PY -m pytest -q -m gpu tests/kernels tests/gpu tests/unit/test_orpheus_snac.py tests/unit/test_flux2_parity.py \
    tests/unit/test_whisper_parity.py tests/unit/test_whisper_parity_varied.py tests/unit/test_diffusion_engines.py tests/unit/test_png.py \
    tests/unit/test_fp8_linear.py tests/unit/test_capture_policy.py tests/unit/test_step_buffers.py -p no:cacheprovider --tb=short > "$OUT/gpu_tests.log" 2>&1 || failed "gpu tests"
  tail -5 "$OUT/gpu_tests.log"
fi
if has sweeps; then
  stage "kernel sweeps: sort-free top-k/top-p, the skinny GEMM vs cuBLAS, decode attention knobs (inside CUDA graphs)"
  timeout ${SWEEP_TIMEOUT:-300} $IMAGE_PY scripts/sweep_sampling.py --out "$OUT/sweep_sampling.json" || failed "sampling sweep"
  timeout ${SWEEP_TIMEOUT:-300} $IMAGE_PY scripts/sweep_gemv.py --out "$OUT/sweep_gemv.json" ${GEMV_ARGS:-} \
    || failed "gemv sweep"
  timeout ${SWEEP_TIMEOUT:-300} $IMAGE_PY scripts/sweep_decode_attention.py --out "$OUT/sweep_attention.json" \
    > "$OUT/sweep_attention.txt" 2>&1 || failed "attention sweep"
  grep -v "^  " "$OUT/sweep_attention.txt" | tail -12
fi
if has attention-variants; then
  stage "decode attention forms (heads/tokens major, fp16 dots, fp8 q.k) on bf16 and fp8 pools"
  timeout ${GPU_TESTS_TIMEOUT:-240} $IMAGE_PY -m pytest -q -m gpu tests/kernels/test_paged_attention.py -p no:cacheprovider \
    --tb=short > "$OUT/attention_tests.log" 2>&1 || failed "attention tests"
  tail -3 "$OUT/attention_tests.log"
  timeout ${SWEEP_TIMEOUT:-300} $IMAGE_PY scripts/sweep_decode_attention.py --variants --top 3 \
    --out "$OUT/sweep_attention_variants.json" > "$OUT/sweep_attention_variants.txt" 2>&1 \
    || failed "attention variants"
  cat "$OUT/sweep_attention_variants.txt" | cut -c1-220
fi
if has gemv-sweep; then
  stage "skinny GEMM vs cuBLAS on cold weights (GEMV_ARGS, e.g. --shapes llama --rows 1)"
  timeout ${SWEEP_TIMEOUT:-300} $IMAGE_PY scripts/sweep_gemv.py --out "$OUT/sweep_gemv.json" ${GEMV_ARGS:-} \
    || failed "gemv sweep"
fi
if has profile; then
  stage "decode step kernel by kernel (PROFILE_ARGS, e.g. --family llama --rows 1,256)"
  timeout ${PROFILE_TIMEOUT:-240} $IMAGE_PY scripts/profile_decode_step.py --out "$OUT/profile_decode.json" \
    ${PROFILE_ARGS:---family llama --rows 1,256} || failed "profile"
fi
if has pdl; then
  stage "Programmatic Dependent Launch: the chain probe, then each decode step with MSTAR_PDL=0/1 (PDL_ROWS, PDL_FAMILIES)"
  timeout 120 $IMAGE_PY scripts/probe_pdl.py --json "$OUT/probe_pdl.json" > "$OUT/probe_pdl.log" 2>&1 \
    || failed "pdl probe"
  for family in ${PDL_FAMILIES:-qwen3 llama}; do
    for flag in 0 1; do
      MSTAR_PDL=$flag MSTAR_PDL_MAX_ROWS=${PDL_MAX_ROWS:-1024} timeout ${PROFILE_TIMEOUT:-150} $IMAGE_PY \
        scripts/profile_decode_step.py --family $family --rows ${PDL_ROWS:-1,2,4} \
        --out "$OUT/profile_${family}_pdl$flag.json" 2>&1 | grep "^\[profile\]" || failed "$family pdl=$flag"
    done
  done
fi
if has persistent; then
  stage "whole-step persistent decode probe: the barrier, one process per Triton setting (PERSISTENT_SETTINGS), the CUDA forms"
  timeout 60 $IMAGE_PY scripts/probe_persistent_step.py --barrier-only --json "$OUT/probe_barrier.json" \
    || failed "barrier probe"
  # "shapes per_sm poll block_n warps tma_stages" each; tma_stages 0 is the register form (measured 2026-12-02)
  default="qwen3 2 0 4 4 0;qwen3 1 0 8 4 4;qwen3 2 0 8 4 4;qwen3 1 0 16 4 3;qwen3 2 0 16 4 4;qwen3 1 0 32 4 4"
  IFS=';' read -r -a settings <<< "${PERSISTENT_SETTINGS:-$default;llama 2 0 8 4 4}"
  i=0
  for setting in "${settings[@]}"; do
    read -r shapes per_sm poll block_n warps stages <<< "$setting"; i=$((i + 1))
    timeout ${PERSISTENT_TIMEOUT:-90} $IMAGE_PY scripts/probe_persistent_step.py --no-barrier --shapes $shapes \
      --per-sm $per_sm --poll $poll --block-n $block_n --warps $warps --tma-stages $stages \
      --json "$OUT/probe_persistent_$i.json" 2>&1 | grep -E "launches:|us$|rel err|Error" \
      || failed "persistent probe $setting"
  done
  # the CUDA C++ forms (scripts/probe_persistent_step.cu, built with the device's nvcc; measured 2026-12-02)
  for shapes in qwen3 llama; do
    timeout ${PERSISTENT_TIMEOUT:-90} $IMAGE_PY scripts/probe_persistent_step.py --cuda --no-barrier --shapes $shapes \
      --per-sm 1 --warps 16 32 --units 4 --early 0 1 --trace --json "$OUT/probe_persistent_cuda_$shapes.json" 2>&1 \
      | grep -E "launches:|us$|rel err|Error" || failed "persistent probe, CUDA forms, $shapes"
  done
fi
if has gemv-chain; then
  stage "the one-row chain of 112 skinny-GEMM launches with whole-K settings (scripts/probe_gemv_chain.py)"
  timeout ${PROFILE_TIMEOUT:-150} $IMAGE_PY scripts/probe_gemv_chain.py qwen3 llama 2>&1 | grep -E " us|Error" \
    | tee "$OUT/probe_gemv_chain.log" || failed "gemv chain probe"
fi
if has ab; then
  stage "A/B of decode-step kernel switches in one process per family (AB_FAMILIES, AB_ROWS, AB_VARIANTS)"
  read -r -a variants <<< "${AB_VARIANTS:---variant base:MSTAR_NORM_GEMV=auto --variant norm_apart:MSTAR_NORM_GEMV=0 --variant no_pdl:MSTAR_PDL=0}"
  for family in ${AB_FAMILIES:-qwen3 llama}; do
    timeout ${PROFILE_TIMEOUT:-150} $IMAGE_PY scripts/ab_decode_step.py --family $family --rows ${AB_ROWS:-1,2,4} \
      "${variants[@]}" --out "$OUT/ab_${family}.json" 2>&1 | grep "^\[ab\]" || failed "ab $family"
  done
fi
build_orpheus() {
  stage "orpheus: random-weight 3B checkpoint (built with transformers under the image's Python)"
  timeout 120 $IMAGE_PY -c "
from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.families.registry import get_family
print(resolve_checkpoint('builtin:orpheus-3b-random', get_family('orpheus').builtin_checkpoints))
" || failed "orpheus checkpoint"
}
if has orpheus-served; then
  build_orpheus
  stage "orpheus: served only"
  df -h /dev/shm; (for i in $(seq 1 40); do date +%T; df -k /dev/shm | tail -1
     ps -eo pid,stat,rss,etimes,args | grep -E "triton_python_backend_stub|tritonserver" | grep -v grep | cut -c1-160
     sleep 5; done) > "$OUT/monitor.log" 2>&1 &
  MSTAR_STACK_DUMP_S=${MSTAR_STACK_DUMP_S:-45} MSTAR_BENCH_LOG_DIR=$OUT timeout ${ORPHEUS_TIMEOUT:-300} $PY scripts/bench_orpheus.py --baseline-concurrency "" ${ORPHEUS_ARGS:-} \
    --out "$OUT/orpheus_served.json" || failed "orpheus served"
  grep -v "^[|+]" "$OUT/orpheus_tritonserver.log" | grep -iE "error|not healthy|Traceback" -A3 | head -40
  grep -c "Thread 0x" "$OUT/orpheus_tritonserver.log" && echo "(stack dumps in orpheus_tritonserver.log)"
fi
if has orpheus-probe; then
  build_orpheus
  stage "orpheus: the LM engine alone (no Triton, no codec), per sampling rule; profile at c=256"
  timeout ${PROBE_TIMEOUT:-300} $PY scripts/probe_orpheus_engine.py --concurrency ${PROBE_CONCURRENCY:-1,64,256} \
    --sampling ${PROBE_SAMPLING:-reference,greedy,nopenalty} --profile-concurrency ${PROBE_PROFILE_C:-256} ${PROBE_ARGS:-} \
    || failed "orpheus probe"
fi
if has orpheus-baseline; then
  stage "orpheus: HF generate + snac baseline"
  timeout ${BASELINE_TIMEOUT:-150} $IMAGE_PY scripts/bench_orpheus.py --concurrency "" --baseline-concurrency ${BASELINE_CONCURRENCY:-1,16} \
    --out "$OUT/orpheus_baseline.json" || failed "orpheus baseline"
fi
if has orpheus; then
  build_orpheus
  stage "orpheus: served (3B LM + SNAC, random weights, 1200 audio tokens)"
  MSTAR_BENCH_LOG_DIR=$OUT timeout ${ORPHEUS_TIMEOUT:-240} $PY scripts/bench_orpheus.py --baseline-concurrency "" \
    ${ORPHEUS_ARGS:-} --out "$OUT/orpheus_served.json" || failed "orpheus served"
  grep -v "^[|+]" "$OUT/orpheus_tritonserver.log" | grep -iE "error|not healthy|Traceback" | head -20
  stage "orpheus: HF generate + snac baseline (BASELINE_CONCURRENCY, default 1,16)"
  timeout ${BASELINE_TIMEOUT:-150} $IMAGE_PY scripts/bench_orpheus.py --concurrency "" \
    --baseline-concurrency ${BASELINE_CONCURRENCY:-1,16} --out "$OUT/orpheus_baseline.json" \
    || failed "orpheus baseline"
fi
if has flux2; then
  stage "flux2 klein-4B shapes: engine + diffusers, 1024x1024, 4 steps"
  timeout ${FLUX_TIMEOUT:-330} $IMAGE_PY scripts/bench_flux2.py --json "$OUT/flux2.json" ${FLUX_ARGS:-} || failed "flux2"
fi
if has dit-kernels; then
  stage "dit-kernels: klein-4B transformer and VAE decoder, eager vs fused kernels, per SDPA backend"
  timeout ${DIT_TIMEOUT:-400} $PY scripts/bench_dit_kernels.py --json "$OUT/dit_kernels.json" ${DIT_ARGS:-} \
    || failed "dit-kernels"
fi
if has flux2-served; then
  # diffusers' Qwen3 text encoder (and the checkpoint writer's tokenizer module) need the image's numpy 2 stack,
  # tritonclient lives in the server's venv: the pipeline first (it writes the checkpoint), then the served
  # walk on the same checkpoint, in the same device call.
  stage "flux2: diffusers' pipeline, klein-4B shapes, 1024x1024, 4 steps"
  timeout ${FLUX_BASELINE_TIMEOUT:-200} $IMAGE_PY scripts/bench_flux2.py --skip-ours --diffusers-calls 2 \
    --json "$OUT/flux2_diffusers.json" || failed "flux2 diffusers"
  stage "flux2: served (tritonserver + the walk) on the same checkpoint"
  MSTAR_BENCH_LOG_DIR=$OUT timeout ${FLUX_TIMEOUT:-330} $PY scripts/bench_flux2.py --mode served --skip-diffusers \
    --json "$OUT/flux2_served.json" ${FLUX_ARGS:-} || failed "flux2 served"
fi
if has z-image; then
  # As flux2-served: diffusers' pipeline under the image's Python first (it writes the ~20 GB checkpoint), then
  # the served walk under the server's Python on the same checkpoint.
  stage "z-image: diffusers' ZImagePipeline, Z-Image-Turbo shapes (6B DiT), 1024x1024, 8 steps"
  timeout ${ZIMAGE_TIMEOUT:-420} $IMAGE_PY scripts/bench_flux2.py --family z_image_turbo --skip-ours \
    --diffusers-calls 2 --json "$OUT/z_image_diffusers.json" ${ZIMAGE_ARGS:-} || failed "z-image diffusers"
  stage "z-image: served (tritonserver + the walk) on the same checkpoint"
  MSTAR_BENCH_LOG_DIR=$OUT timeout ${ZIMAGE_TIMEOUT:-420} $PY scripts/bench_flux2.py --family z_image_turbo \
    --mode served --skip-diffusers --json "$OUT/z_image_served.json" ${ZIMAGE_ARGS:-} || failed "z-image served"
fi
if has whisper; then
  stage "whisper: random-weight large-v3 checkpoint (built with transformers under the image's Python)"
  timeout 150 $IMAGE_PY -c "
from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.families.registry import get_family
print(resolve_checkpoint('builtin:whisper-large-v3-random', get_family('whisper').builtin_checkpoints))
" || failed "whisper checkpoint"
  stage "whisper large-v3 shapes: served (ITL, RTFx)"
  MSTAR_BENCH_LOG_DIR=$OUT timeout 240 $PY scripts/bench_whisper.py --baseline-concurrency "" \
    --out "$OUT/whisper_served.json" || failed "whisper served"
  stage "whisper: transformers pipeline baseline"
  # It writes its WAV uploads with soundfile (batch 64 of large-v3 needs more than an H100's 80 GB:
  # WHISPER_BASELINE_C=1,16 there).
  ensure_soundfile
  timeout 200 $IMAGE_PY scripts/bench_whisper.py --concurrency "" --itl-runs 0 --baseline-concurrency ${WHISPER_BASELINE_C:-1,16,64} \
    --out "$OUT/whisper_baseline.json" || failed "whisper baseline"
fi
if has whisper-probe; then
  stage "whisper: random-weight large-v3 checkpoint, then the decoder engine alone (step time, profile)"
  timeout 150 $IMAGE_PY -c "
from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.families.registry import get_family
print(resolve_checkpoint('builtin:whisper-large-v3-random', get_family('whisper').builtin_checkpoints))
" || failed "whisper checkpoint"
  timeout ${PROBE_TIMEOUT:-200} $PY scripts/probe_whisper_decoder.py --profile || failed "whisper probe"
fi
if has orpheus-inproc; then
  build_orpheus
  stage "orpheus: served, SNAC inside the LM component (no BLS hop)"
  MSTAR_STACK_DUMP_S=${MSTAR_STACK_DUMP_S:-45} MSTAR_BENCH_LOG_DIR=$OUT timeout ${ORPHEUS_TIMEOUT:-300} $PY scripts/bench_orpheus.py \
    --baseline-concurrency "" --codec-in-process ${ORPHEUS_ARGS:-} --out "$OUT/orpheus_inproc.json" \
    || failed "orpheus in-process"
  grep -v "^[|+]" "$OUT/orpheus_tritonserver.log" | grep -iE "error|not healthy|Fatal" -A3 | head -30
fi
if has orpheus-pyspy; then
  # py-spy on the LM stub during a c=256 in-process run: where its threads spend their time (needs the py-spy
  # wheel in .whl/: pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d .whl py-spy)
  build_orpheus
  stage "orpheus: py-spy of the LM stub at c=256 (codec in process)"
  rm -rf /tmp/pyspy && $IMAGE_PY -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy*.whl
  MSTAR_BENCH_LOG_DIR=$OUT timeout ${ORPHEUS_TIMEOUT:-300} $PY scripts/bench_orpheus.py --baseline-concurrency "" \
    --codec-in-process --concurrency 256 ${ORPHEUS_ARGS:-} --out "$OUT/orpheus_pyspy_run.json" > "$OUT/orpheus_pyspy_run.log" 2>&1 &
  BENCH=$!
  for _ in $(seq 1 240); do grep -q "warm-up:" "$OUT/orpheus_pyspy_run.log" 2>/dev/null && break; sleep 1; done
  sleep 4
  LM_PID=$(pgrep -f "triton_python_backend_stub.*orpheus_lm" | head -1)
  /tmp/pyspy/bin/py-spy record -p "$LM_PID" -d 10 -r 250 -f raw --threads --nonblocking -o "$OUT/lm_stacks.txt" \
    || failed "py-spy"
  /tmp/pyspy/bin/py-spy record -p "$LM_PID" -d 3 -r 250 -f raw --gil --nonblocking -o "$OUT/lm_stacks_gil.txt" \
    || failed "py-spy --gil"
  wait $BENCH
  grep -E "^system|^mstar" "$OUT/orpheus_pyspy_run.log"
fi
if has stub-health; then
  stage "256-stream stub health: random-weight Qwen3-0.6B, configs/qwen3_0_6b_gpu.yaml"
  timeout 120 $IMAGE_PY -c "
from mstar_common.bench.checkpoints import build_random_checkpoint
print(build_random_checkpoint('qwen3-0.6b', '/tmp/mstar-gpu/qwen3-0.6b'))
" || failed "qwen3 checkpoint"
  timeout ${STUB_HEALTH_TIMEOUT:-300} $PY scripts/stub_health_256.py --checkpoint /tmp/mstar-gpu/qwen3-0.6b \
    --duration-s ${STUB_HEALTH_S:-180} --out "$OUT/stub_health_256.json" || failed "stub health"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
stage "done"
# Exit 1 naming each stage that failed (0 when every one passed), as scripts/gpu_suite.sh does.
[ ${#FAILED[@]} -eq 0 ] && { echo "=== every stage passed"; exit 0; }
printf '=== %d stage(s) failed:' "${#FAILED[@]}"; printf ' [%s]' "${FAILED[@]}"; echo; exit 1
