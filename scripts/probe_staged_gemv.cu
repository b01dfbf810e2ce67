// One-row GEMV kernels that hold their weights in shared memory across the PDL wait (scripts/probe_staged_gemv.py).
//
// The one-row decode step's projections stream their weights at 1.5-2.1 TB/s because each one starts loading only
// while the kernel before it finishes, and the weights a resident Triton program loads ahead of its wait land in
// registers (docs/benchmarks.md, "Where the one-row step waits"). Here each CTA owns `cols` output rows of the
// weight ([N, K] bf16, row-major), which are one contiguous run of memory, and copies that run into shared memory
// with bulk asynchronous copies (`cp.async.bulk`, completing on an mbarrier) as soon as it starts. Shared memory
// holds the bf16 bytes themselves, not the fp32 values a register tile would, and the copy needs no thread to
// wait for it. Then the CTA waits for the kernel before it (`griddepcontrol.wait`), reads the input vector and sums
// each group of eight rows as soon as that group has landed (one barrier per group). The input is kept as bf16 in
// shared memory, so that a warp reads it as it reads a weight row, 16 bytes a lane, without bank conflicts.
// The copy, barrier and launch helpers are in scripts/staged_copy.cuh.
//
// - `stage_first` 1: the copy is issued before the PDL wait; 0: after it (the same kernel with no lookahead).
// - `mode` 0: no PDL; 1: wait, then let the next kernel launch (`early`, the served rule); 3: let it launch first,
//   then wait (`ahead`: a chain of kernels can then be resident at once, each with its copy in flight).
//
// The launcher takes raw device pointers and the caller's CUDA stream, so a torch CUDA graph captures it.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "staged_copy.cuh"

namespace {

using mstar::gdc_launch_dependents;
using mstar::gdc_wait;
using mstar::smem_addr;
using mstar::stage;
using mstar::wait_phase0;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroups = 8;  // so at most 64 rows per CTA

// y[n0 + c] = sum_k w[n0 + c, k] * x[k] for the CTA's `cols` rows; K a multiple of 8, x and w 16-byte aligned.
// The rows travel in groups of kWarps (one row per warp), each group on its own barrier, so the first group's sums
// start while the later groups are still on their way.
__global__ void __launch_bounds__(kThreads) staged_gemv(const __nv_bfloat16* __restrict__ w,
                                                        const __nv_bfloat16* __restrict__ x,
                                                        __nv_bfloat16* __restrict__ y, int n, int k, int cols,
                                                        int mode, int stage_first) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMaxGroups];
  const int n0 = blockIdx.x * cols;
  const int rows = min(cols, n - n0);
  const int groups = (rows + kWarps - 1) / kWarps;
  __nv_bfloat16* ws = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* xs = ws + static_cast<size_t>(cols) * k;  // the input, as bf16 (the same reads as a weight row)
  const __nv_bfloat16* src = w + static_cast<size_t>(n0) * k;
  const uint32_t row_bytes = static_cast<uint32_t>(k) * 2;

  auto issue = [&]() {
    for (int g = 0; g < groups; ++g) {
      const uint32_t group_rows = min(kWarps, rows - g * kWarps);
      stage(ws + static_cast<size_t>(g) * kWarps * k, src + static_cast<size_t>(g) * kWarps * k,
            group_rows * row_bytes, &bars[g]);
    }
  };
  if (mode == 3) gdc_launch_dependents();
  if (threadIdx.x == 0) {
    for (int g = 0; g < groups; ++g)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[g])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (stage_first) issue();  // the weights are nobody's output: copy before the wait
  }
  if (mode) gdc_wait();
  if (mode == 1) gdc_launch_dependents();
  if (threadIdx.x == 0 && !stage_first) issue();
  // the input, written by the kernel before: read after the wait, from L2 (.cg: no stale L1 line)
  for (int i = threadIdx.x * 8; i < k; i += kThreads * 8)
    *reinterpret_cast<uint4*>(xs + i) = __ldcg(reinterpret_cast<const uint4*>(x + i));
  __syncthreads();  // xs written; the barriers' init is visible to every thread
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = 0; g < groups; ++g) {
    wait_phase0(&bars[g]);
    const int c = g * kWarps + warp;
    if (c >= rows) continue;
    const __nv_bfloat16* row = ws + static_cast<size_t>(c) * k;
    float acc = 0.f;
    for (int i = lane * 8; i < k; i += 32 * 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + i);
      const uint4 u = *reinterpret_cast<const uint4*>(xs + i);
      const __nv_bfloat162* e = reinterpret_cast<const __nv_bfloat162*>(&v);
      const __nv_bfloat162* f = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = __bfloat1622float2(e[j]), b = __bfloat1622float2(f[j]);
        acc += a.x * b.x;
        acc += a.y * b.y;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) y[n0 + c] = __float2bfloat16(acc);
  }
}

// y = x, one CTA, launched as the chain's projections are: the probe's stand-in for the small kernel (an RMSNorm, a
// rotary embedding) that runs in front of each projection in a decode step and takes no shared memory.
__global__ void __launch_bounds__(kThreads) relay(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
                                                  int n, int mode) {
  if (mode == 3) gdc_launch_dependents();
  if (mode) gdc_wait();
  if (mode == 1) gdc_launch_dependents();
  for (int i = threadIdx.x; i < n; i += kThreads) y[i] = __ldcg(x + i);
}

}  // namespace

extern "C" {

// The preferred shared-memory carveout (percent of the unified L1/shared memory) of both kernels; -1: the default.
int mstar_set_carveout(int percent) {
  cudaError_t err = cudaFuncSetAttribute(staged_gemv, cudaFuncAttributePreferredSharedMemoryCarveout, percent);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(relay, cudaFuncAttributePreferredSharedMemoryCarveout, percent);
  return err;
}

int mstar_relay(const void* x, void* y, int n, int mode, void* stream) {
  return mstar::launch(relay, dim3(1), dim3(kThreads), 0, static_cast<cudaStream_t>(stream), mode != 0,
                       static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), n, mode);
}

// 0 on success, else a cudaError_t (or -1: a shape the kernel does not take).
int mstar_staged_gemv(const void* w, const void* x, void* y, int n, int k, int cols, int mode, int stage_first,
                      void* stream) {
  if (k % 8 != 0 || cols < 1 || cols > kWarps * kMaxGroups || n < 1 || (mode != 0 && mode != 1 && mode != 3)) return -1;
  const size_t smem = static_cast<size_t>(cols + 1) * k * 2;
  if (smem > 200 * 1024) return -1;
  static size_t allowed = 0;
  if (smem > allowed) {
    cudaError_t err = cudaFuncSetAttribute(staged_gemv, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    allowed = smem;
  }
  return mstar::launch(staged_gemv, dim3((n + cols - 1) / cols), dim3(kThreads), smem,
                       static_cast<cudaStream_t>(stream), mode != 0, static_cast<const __nv_bfloat16*>(w),
                       static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), n, k, cols, mode,
                       stage_first);
}

}  // extern "C"
