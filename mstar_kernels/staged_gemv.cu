// Skinny GEMM for one to four rows whose weights wait in shared memory across the PDL wait (mstar_kernels/staged_gemv.py).
//
// out[r, n] = sum_k in[r, k] * w[n, k] (+ bias[n]) for M <= 4 rows, bf16 in and out, fp32 sums. Each CTA owns
// `cols` output columns, whose weight rows are one contiguous run of memory, and as soon as it starts, before it
// waits for the kernel that writes its input (griddepcontrol.wait), its first thread copies that run into shared
// memory with bulk asynchronous copies (cp.async.bulk), a barrier per group of eight rows. The weights are nobody's
// output, so this is safe, and under PDL the whole projection streams in while the kernel before it finishes; a
// Triton program can only hold what it loads ahead of its wait in registers. It wins in a chain of projections
// and lost in the served step (docs/benchmarks.md, "Weights staged in shared memory ahead of the PDL wait").
// After the wait the CTA builds its input rows in shared memory as bf16, then each warp sums one weight row of each
// group against every input row as soon as that group has landed.
//
// The input, as mstar_kernels/gemv.py builds it (the same roundings, so the same bf16 values):
// - plain: x[r, :K];
// - SwiGLU: x is [M, 2K] (gate | up), in = bf16(bf16(silu(gate)) * up);
// - RMSNorm: h = x (+ residual, rounded to bf16), in = bf16(bf16(h * rsqrt(mean(h^2) + eps)) * g); with a residual,
//   CTA 0 writes h to `res_out` (the residual stream for the next block).
//
// PDL `mode`: 0 none; 1 wait, then let the next kernel launch (mstar_kernels/_pdl.py `early`); 2 wait only (`fit` on a
// grid deeper than the SMs); 3 let the next kernel launch first, then wait (`ahead`).

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
constexpr int kMaxGroups = 8;  // so at most 64 output columns per CTA
constexpr int kMaxRows = 4;

enum Input { kPlain = 0, kSwiglu = 1, kNorm = 2 };

struct Args {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  const __nv_bfloat16* bias;     // or null
  __nv_bfloat16* out;
  const __nv_bfloat16* res;      // kNorm: the residual added to x first, or null
  const __nv_bfloat16* g;        // kNorm: the norm's weight
  __nv_bfloat16* res_out;        // kNorm with a residual: where x + residual goes
  long long stride_x, stride_out, stride_res, stride_res_out;  // elements between rows
  int n, k, cols, input, mode;
  float eps;
};

__device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* e = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = __bfloat1622float2(e[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
}

__device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* e = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) e[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Reads after the PDL wait go to L2 (.cg): an L1 line of an earlier kernel on this SM could be stale.
__device__ __forceinline__ uint4 load_cg(const __nv_bfloat16* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// The M input rows into `xs` ([M, K] bf16); every thread of the CTA calls it; ends with a __syncthreads.
template <int M>
__device__ void build_input(const Args& a, __nv_bfloat16* xs) {
  const int k = a.k;
  if (a.input == kPlain || a.input == kSwiglu) {
    for (int r = 0; r < M; ++r) {
      const __nv_bfloat16* x = a.x + r * a.stride_x;
      for (int i = threadIdx.x * 8; i < k; i += kThreads * 8) {
        uint4 v = load_cg(x + i);
        if (a.input == kSwiglu) {
          float gate[8], up[8];
          unpack(v, gate);
          unpack(load_cg(x + k + i), up);
#pragma unroll
          for (int j = 0; j < 8; ++j) gate[j] = round_bf16(gate[j] / (1.0f + __expf(-gate[j]))) * up[j];
          v = pack(gate);
        }
        *reinterpret_cast<uint4*>(xs + r * k + i) = v;
      }
    }
    __syncthreads();
    return;
  }
  // RMSNorm: h into xs and the sums of squares, then the scale and the weight in place (each thread its own chunks)
  __shared__ float partial[kWarps][M];
  float sq[M];
  for (int r = 0; r < M; ++r) {
    sq[r] = 0.f;
    for (int i = threadIdx.x * 8; i < k; i += kThreads * 8) {
      float h[8];
      unpack(load_cg(a.x + r * a.stride_x + i), h);
      if (a.res != nullptr) {
        float s[8];
        unpack(load_cg(a.res + r * a.stride_res + i), s);
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = round_bf16(h[j] + s[j]);
      }
      const uint4 packed = pack(h);
      *reinterpret_cast<uint4*>(xs + r * k + i) = packed;
      if (a.res != nullptr && blockIdx.x == 0)
        *reinterpret_cast<uint4*>(a.res_out + r * a.stride_res_out + i) = packed;
#pragma unroll
      for (int j = 0; j < 8; ++j) sq[r] += h[j] * h[j];
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < M; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], off);
    if (lane == 0) partial[warp][r] = sq[r];
  }
  __syncthreads();
  for (int r = 0; r < M; ++r) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][r];
    const float inv = rsqrtf(total / k + a.eps);
    for (int i = threadIdx.x * 8; i < k; i += kThreads * 8) {
      float h[8], g[8];
      unpack(*reinterpret_cast<const uint4*>(xs + r * k + i), h);
      unpack(__ldg(reinterpret_cast<const uint4*>(a.g + i)), g);  // the norm's weight: nobody writes it
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = round_bf16(h[j] * inv) * g[j];
      *reinterpret_cast<uint4*>(xs + r * k + i) = pack(h);
    }
  }
  __syncthreads();
}

template <int M>
__global__ void __launch_bounds__(kThreads) staged_gemv(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMaxGroups];
  const int k = a.k;
  const int n0 = blockIdx.x * a.cols;
  const int cols = min(a.cols, a.n - n0);
  const int groups = (cols + kWarps - 1) / kWarps;
  __nv_bfloat16* ws = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* xs = ws + static_cast<size_t>(a.cols) * k;

  if (a.mode == 3) gdc_launch_dependents();
  if (threadIdx.x == 0) {
    for (int g = 0; g < groups; ++g)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[g])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const __nv_bfloat16* src = a.w + static_cast<size_t>(n0) * k;
    for (int g = 0; g < groups; ++g) {
      const uint32_t rows = min(kWarps, cols - g * kWarps);
      stage(ws + static_cast<size_t>(g) * kWarps * k, src + static_cast<size_t>(g) * kWarps * k, rows * k * 2,
            &bars[g]);
    }
  }
  if (a.mode != 0) gdc_wait();
  if (a.mode == 1) gdc_launch_dependents();
  build_input<M>(a, xs);  // its __syncthreads also makes the barriers' init visible to every thread

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = 0; g < groups; ++g) {
    wait_phase0(&bars[g]);
    const int c = g * kWarps + warp;
    if (c >= cols) continue;
    const __nv_bfloat16* row = ws + static_cast<size_t>(c) * k;
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.f;
    for (int i = lane * 8; i < k; i += 32 * 8) {
      float wf[8];
      unpack(*reinterpret_cast<const uint4*>(row + i), wf);
#pragma unroll
      for (int r = 0; r < M; ++r) {
        float xf[8];
        unpack(*reinterpret_cast<const uint4*>(xs + r * k + i), xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r] += wf[j] * xf[j];
      }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
    if (lane == 0) {
      const float b = a.bias != nullptr ? __bfloat162float(a.bias[n0 + c]) : 0.f;
#pragma unroll
      for (int r = 0; r < M; ++r) a.out[r * a.stride_out + n0 + c] = __float2bfloat16(acc[r] + b);
    }
  }
}

template <int M>
int launch(const Args& a, size_t smem, cudaStream_t stream) {
  static size_t allowed = 0;  // the dynamic shared memory this instance was allowed so far
  if (smem > allowed) {
    const cudaError_t err =
        cudaFuncSetAttribute(staged_gemv<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    allowed = smem;
  }
  return mstar::launch(staged_gemv<M>, dim3((a.n + a.cols - 1) / a.cols), dim3(kThreads), smem, stream, a.mode != 0,
                       a);
}

}  // namespace

extern "C" {

// 0 on success, -1 for arguments the kernel does not take, else a cudaError_t.
int mstar_staged_gemv(const void* w, const void* x, const void* bias, void* out, const void* res, const void* g,
                      void* res_out, int m, int n, int k, int cols, long long stride_x, long long stride_out,
                      long long stride_res, long long stride_res_out, float eps, int input, int mode, void* stream) {
  if (m < 1 || m > kMaxRows || n < 1 || k < 8 || k % 8 != 0 || cols < 1 || cols > kWarps * kMaxGroups ||
      input < kPlain || input > kNorm || mode < 0 || mode > 3 || stride_x % 8 != 0 ||
      (res != nullptr && stride_res % 8 != 0) || (res_out != nullptr && stride_res_out % 8 != 0))
    return -1;
  const Args a{static_cast<const __nv_bfloat16*>(w),   static_cast<const __nv_bfloat16*>(x),
               static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(out),
               static_cast<const __nv_bfloat16*>(res), static_cast<const __nv_bfloat16*>(g),
               static_cast<__nv_bfloat16*>(res_out),    stride_x,
               stride_out,                              stride_res,
               stride_res_out,                          n,
               k,                                       cols,
               input,                                   mode,
               eps};
  const size_t smem = static_cast<size_t>(cols + m) * k * 2;  // its weight rows and the input rows, bf16
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (m) {
    case 1: return launch<1>(a, smem, s);
    case 2: return launch<2>(a, smem, s);
    case 3: return launch<3>(a, smem, s);
    default: return launch<4>(a, smem, s);
  }
}

}  // extern "C"
