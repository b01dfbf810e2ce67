// The persistent projection chain of scripts/probe_persistent_step.py, written in CUDA C++.
//
// The Triton forms of the probe (registers, TMA) lost to the served chain of PDL launches. These forms ask
// whether the loss is Triton's. All run one CTA per SM over the same grid barrier (a release add, `ld.acquire`
// polls), and split each projection's output rows into one contiguous run of rows per CTA, so a CTA's slice of
// a weight ([layers, N, K] bf16, row-major) is one contiguous run of memory read with 16-byte loads. The input
// vector goes into shared memory as fp32 (read through L2 only: other SMs wrote it).
//
// - register form (`unroll`): thread t takes vectors t, t + T, ...; two chunks of `unroll` vectors per thread in
//   registers (one summed while the next loads); a warp's 32 vectors always lie in one row (K is a multiple of
//   256), so each vector's sum is reduced across the warp and added to the row's total in shared memory. The
//   next projection's first chunk loads before the barrier in front of it.
// - ring form (`ring`): the same vectors as one stream over all projections and layers, copied with cp.async
//   into a per-thread ring of shared memory that keeps `ring` - 1 vectors in flight across barriers.
// - unit form (`units`): (row, K segment) units, about one per warp; a lane sums its vectors of a unit in one
//   register and the warp reduces once per unit. Optionally (`early`) each warp's first unit is copied into
//   shared memory two projections ahead.
//
// Built by the probe with nvcc into a shared library that ctypes loads; the launchers take raw device pointers
// and the caller's CUDA stream (so a torch CUDA graph captures them), and refuse a grid the GPU cannot hold at
// once (its barrier would never open).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kMaxK = 8192;      // the longest input (Llama-3.2-3B's intermediate width)
constexpr int kMaxRows = 256;    // rows of one projection per CTA

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every CTA of the grid arrives, then waits until `target` arrivals are counted. The counter only grows during a
// launch; grid_leave puts it back to zero at the end.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    while (ld_acquire(counter) < target) {
    }
  }
  __syncthreads();
}

// The last CTA to leave zeroes both counters; every other CTA has left its last wait by then.
__device__ __forceinline__ void grid_leave(unsigned* sync) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(sync + 1, 1u) == gridDim.x - 1) {
      sync[0] = 0;
      sync[1] = 0;
      __threadfence();
    }
  }
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }

struct Proj {
  const __nv_bfloat16* x;  // input (K values; with swiglu: K gates, then K ups)
  const __nv_bfloat16* w;  // this layer's [N, K] weight
  __nv_bfloat16* out;      // N outputs
  int n, k;
  bool swiglu;
};

// The chain's buffers and shapes, as every kernel takes them.
struct Chain {
  __nv_bfloat16 *h, *qkv, *o, *gu;
  const __nv_bfloat16 *wqkv, *wo, *wgu, *wd;
  unsigned* sync;  // two zeroed counters
  int layers, hidden, qkv_n, q, inter;
};

// Projection `s` of `layer`: 0 qkv, 1 o (on the q part of qkv), 2 gate/up, 3 down with SwiGLU on load.
__host__ __device__ inline Proj stage_of(const Chain& c, int layer, int s) {
  const int64_t l = layer;
  switch (s) {
    case 0: return Proj{c.h, c.wqkv + l * c.qkv_n * c.hidden, c.qkv, c.qkv_n, c.hidden, false};
    case 1: return Proj{c.qkv, c.wo + l * c.hidden * c.q, c.o, c.hidden, c.q, false};
    case 2: return Proj{c.o, c.wgu + l * 2 * c.inter * c.hidden, c.gu, 2 * c.inter, c.hidden, false};
    default: return Proj{c.gu, c.wd + l * c.hidden * c.inter, c.h, c.hidden, c.inter, true};
  }
}

// The projection's input into shared memory as fp32, one value per thread and iteration (through L2 only: other
// SMs wrote it).
__device__ __forceinline__ void input_to_shared(const Proj& p, float* xs) {
  for (int i = threadIdx.x; i < p.k; i += blockDim.x) {
    float v = __bfloat162float(__ldcg(p.x + i));
    if (p.swiglu) {
      float up = __bfloat162float(__ldcg(p.x + p.k + i));
      v = bf16_round(bf16_round(v / (1.f + __expf(-v))) * up);
    }
    xs[i] = v;
  }
}

// One 16-byte weight vector (8 bf16) dotted with its 8 inputs (16-byte aligned in shared memory).
__device__ __forceinline__ float dot8(const uint4& w, const float* x) {
  const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
  const float4 xa = *reinterpret_cast<const float4*>(x);
  const float4 xb = *reinterpret_cast<const float4*>(x + 4);
  const float2 w0 = __bfloat1622float2(w2[0]), w1 = __bfloat1622float2(w2[1]);
  const float2 w2f = __bfloat1622float2(w2[2]), w3 = __bfloat1622float2(w2[3]);
  return w0.x * xa.x + w0.y * xa.y + w1.x * xa.z + w1.y * xa.w + w2f.x * xb.x + w2f.y * xb.y + w3.x * xb.z +
         w3.y * xb.w;
}

// The warp's sum of `s` added to `total` (a row's fp32 sum in shared memory).
__device__ __forceinline__ void warp_add(float s, float* total) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(total, s);
}

// This CTA's run of rows: [row0, row0 + rows).
__device__ __forceinline__ void cta_rows(int n, int& row0, int& rows) {
  int per = (n + gridDim.x - 1) / gridDim.x;
  row0 = blockIdx.x * per;
  rows = max(0, min(per, n - row0));
}

// Loads chunk `c` of this CTA's weight vectors (vector v = threadIdx.x + (c * U + u) * blockDim.x) into `r`.
template <int U>
__device__ __forceinline__ void load_chunk(const Proj& p, int c, uint4 (&r)[U]) {
  int row0, rows;
  cta_rows(p.n, row0, rows);
  const int total = rows * (p.k / 8);
  const uint4* base = reinterpret_cast<const uint4*>(p.w + static_cast<int64_t>(row0) * p.k);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    int v = threadIdx.x + (c * U + u) * blockDim.x;
    if (v < total) r[u] = __ldg(base + v);
  }
}

template <int U>
__device__ __forceinline__ void sum_chunk(const Proj& p, int c, const uint4 (&r)[U], const float* xs, float* acc) {
  int row0, rows;
  cta_rows(p.n, row0, rows);
  const int per_row = p.k / 8;
  const int total = rows * per_row;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    int v = threadIdx.x + (c * U + u) * blockDim.x;
    if (v < total) {  // the same for the whole warp: total is a multiple of 32
      const int row = v / per_row;
      warp_add(dot8(r[u], xs + (v - row * per_row) * 8), acc + row);
    }
  }
}

// out = x @ W.T for this CTA's rows; `a` holds chunk 0 of the weights on entry (loaded before the barrier).
template <int U>
__device__ void projection(const Proj& p, uint4 (&a)[U], uint4 (&b)[U], float* xs, float* acc) {
  int row0, rows;
  cta_rows(p.n, row0, rows);
  input_to_shared(p, xs);
  for (int i = threadIdx.x; i < rows; i += blockDim.x) acc[i] = 0.f;
  __syncthreads();
  const int per_thread = (rows * (p.k / 8) + blockDim.x - 1) / blockDim.x;
  const int chunks = (per_thread + U - 1) / U;
  for (int c = 0; c < chunks; c += 2) {
    if (c + 1 < chunks) load_chunk<U>(p, c + 1, b);
    sum_chunk<U>(p, c, a, xs, acc);
    if (c + 2 < chunks) load_chunk<U>(p, c + 2, a);
    if (c + 1 < chunks) sum_chunk<U>(p, c + 1, b, xs, acc);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows; i += blockDim.x) p.out[row0 + i] = __float2bfloat16(acc[i]);
}

// Up to 1,024 threads per CTA with two chunks of 2 or 4 vectors per thread in registers, 512 with 8.
template <int U>
__global__ void __launch_bounds__(U >= 8 ? 512 : 1024, 1)
    chain_kernel(Chain c) {
  __shared__ __align__(16) float xs[kMaxK];
  __shared__ float acc[kMaxRows];
  uint4 a[U], b[U];
  unsigned arrivals = 0;
  load_chunk<U>(stage_of(c, 0, 0), 0, a);
  for (int layer = 0; layer < c.layers; ++layer) {
    for (int s = 0; s < 4; ++s) {
      projection<U>(stage_of(c, layer, s), a, b, xs, acc);
      const int next_layer = s == 3 ? layer + 1 : layer;
      if (next_layer < c.layers) load_chunk<U>(stage_of(c, next_layer, (s + 1) % 4), 0, a);
      arrivals += gridDim.x;
      grid_barrier(c.sync, arrivals);
    }
  }
  grid_leave(c.sync);
}

// The ring form: the weights of all projections of all layers are one stream of 16-byte vectors per thread, copied
// into a per-thread ring of R slots in shared memory with cp.async. Each thread keeps R - 1 vectors in flight and
// issues the next one as it consumes one, across projection and layer boundaries, so the copies keep streaming
// while the CTA waits at a grid barrier or for its input vector. (Each thread reads back only the slots it
// copied, so a cp.async.wait_group is all the ordering it needs.)
struct Stream {  // the producer's cursor over this CTA's vectors
  int layer, stage, item;
};

template <int R>
__global__ void __launch_bounds__(1024, 1)
    ring_chain_kernel(Chain c) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);                       // [R][blockDim.x]
  float* xs = reinterpret_cast<float*>(ring + R * blockDim.x);        // [kMaxK]
  float* acc = xs + kMaxK;                                             // [kMaxRows]
  const int layers = c.layers;
  auto stage = [&](int layer, int s) { return stage_of(c, layer, s); };
  auto items = [&](const Proj& p) {  // vectors per thread of this CTA's rows (the same for all its threads)
    int row0, rows;
    cta_rows(p.n, row0, rows);
    return (rows * (p.k / 8) + blockDim.x - 1) / blockDim.x;
  };
  Stream cursor{0, 0, 0};
  unsigned issued = 0;
  auto issue = [&]() {  // the next vector of the stream into its slot (an empty group past the end)
    while (cursor.layer < layers && cursor.item >= items(stage(cursor.layer, cursor.stage))) {
      cursor.item = 0;
      if (++cursor.stage == 4) {
        cursor.stage = 0;
        ++cursor.layer;
      }
    }
    if (cursor.layer < layers) {
      const Proj p = stage(cursor.layer, cursor.stage);
      int row0, rows;
      cta_rows(p.n, row0, rows);
      const int v = threadIdx.x + cursor.item * blockDim.x;
      if (v < rows * (p.k / 8)) {
        const uint4* src = reinterpret_cast<const uint4*>(p.w + static_cast<int64_t>(row0) * p.k) + v;
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(ring + (issued % R) * blockDim.x +
                                                                            threadIdx.x));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
      }
      ++cursor.item;
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    ++issued;
  };
  for (int i = 0; i < R - 1; ++i) issue();
  unsigned consumed = 0, arrivals = 0;
  for (int layer = 0; layer < layers; ++layer) {
    for (int s = 0; s < 4; ++s) {
      const Proj p = stage(layer, s);
      int row0, rows;
      cta_rows(p.n, row0, rows);
      input_to_shared(p, xs);
      for (int i = threadIdx.x; i < rows; i += blockDim.x) acc[i] = 0.f;
      __syncthreads();
      const int per_row = p.k / 8, total = rows * per_row, n_items = items(p);
      for (int it = 0; it < n_items; ++it) {
        issue();
        asm volatile("cp.async.wait_group %0;" ::"n"(R - 1) : "memory");
        const int v = threadIdx.x + it * blockDim.x;
        if (v < total) {  // the same for the whole warp
          const int row = v / per_row;
          warp_add(dot8(ring[(consumed % R) * blockDim.x + threadIdx.x], xs + (v - row * per_row) * 8), acc + row);
        }
        ++consumed;
      }
      __syncthreads();
      for (int i = threadIdx.x; i < rows; i += blockDim.x) p.out[row0 + i] = __float2bfloat16(acc[i]);
      arrivals += gridDim.x;
      grid_barrier(c.sync, arrivals);
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  grid_leave(c.sync);
}

// The unit form: a projection's rows are split into `splits` segments of K so that the CTA has about one
// (row, segment) unit per warp; a warp takes whole units, each lane loads its `per_lane` vectors of the unit at
// once (lane + 32 j), sums them against the input in one register, and the warp reduces once per unit. Row and
// segment come from one division per unit, not per vector. Units are double-buffered in registers, and each
// warp's first unit of the next projection loads before the barrier in front of it.
struct Plan {
  const __nv_bfloat16* w;  // the first of this CTA's rows
  int k, rows, splits, per_lane, units;
};

__host__ __device__ inline Plan plan_for(const __nv_bfloat16* w, int n, int k, int ctas, int cta, int warps,
                                         int vmax) {
  const int per = (n + ctas - 1) / ctas;
  const int row0 = cta * per;
  const int rows = row0 < n ? (n - row0 < per ? n - row0 : per) : 0;
  const int groups = k / 256;  // 32 lanes x 8 values
  int splits = 1;
  while ((rows * splits < warps || groups / splits > vmax) && groups % (splits * 2) == 0) splits *= 2;
  return Plan{w + static_cast<int64_t>(row0) * k, k, rows, splits, groups / splits, rows * splits};
}

template <int V>
__device__ __forceinline__ void load_unit(const Plan& p, int u, uint4 (&r)[V]) {
  const int row = u / p.splits, seg = u - row * p.splits;
  const uint4* base = reinterpret_cast<const uint4*>(p.w + static_cast<int64_t>(row) * p.k) +
                      seg * p.per_lane * 32 + (threadIdx.x & 31);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (j < p.per_lane) r[j] = __ldg(base + 32 * j);
  }
}

template <int V>
__device__ __forceinline__ void sum_unit(const Plan& p, int u, const uint4 (&r)[V], const float* xs, float* acc) {
  const int row = u / p.splits, seg = u - row * p.splits;
  const float* x = xs + (seg * p.per_lane * 32 + (threadIdx.x & 31)) * 8;
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (j < p.per_lane) s += dot8(r[j], x + 256 * j);
  }
  warp_add(s, acc + row);
}

// This warp's units first, first + warps, ... summed double-buffered: `cur` holds unit `first` on entry, and each
// unit's weights load into the other buffer while the one before it is summed.
template <int V>
__device__ __forceinline__ void stream_units(const Plan& pl, int first, uint4 (&cur)[V], uint4 (&nxt)[V],
                                             const float* xs, float* acc) {
  const int warps = blockDim.x >> 5;
  for (int u = first; u < pl.units; u += 2 * warps) {
    if (u + warps < pl.units) load_unit<V>(pl, u + warps, nxt);
    sum_unit<V>(pl, u, cur, xs, acc);
    if (u + 2 * warps < pl.units) load_unit<V>(pl, u + 2 * warps, cur);
    if (u + warps < pl.units) sum_unit<V>(pl, u + warps, nxt, xs, acc);
  }
}

template <int V>
__global__ void __launch_bounds__(V >= 16 ? 256 : V >= 8 ? 512 : 1024, 1)
    unit_chain_kernel(Chain c) {
  __shared__ __align__(16) float xs[kMaxK];
  __shared__ float acc[kMaxRows];
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, layers = c.layers;
  uint4 a[V], b[V];
  unsigned arrivals = 0;
  auto stage = [&](int layer, int s) { return stage_of(c, layer, s); };
  auto plan = [&](const Proj& p) { return plan_for(p.w, p.n, p.k, gridDim.x, blockIdx.x, warps, V); };
  {
    const Plan first = plan(stage(0, 0));
    if (warp < first.units) load_unit<V>(first, warp, a);
  }
  for (int layer = 0; layer < layers; ++layer) {
    for (int s = 0; s < 4; ++s) {
      const Proj p = stage(layer, s);
      const Plan pl = plan(p);
      int row0, rows;
      cta_rows(p.n, row0, rows);
      input_to_shared(p, xs);
      for (int i = threadIdx.x; i < rows; i += blockDim.x) acc[i] = 0.f;
      __syncthreads();
      stream_units<V>(pl, warp, a, b, xs, acc);
      __syncthreads();
      for (int i = threadIdx.x; i < rows; i += blockDim.x) p.out[row0 + i] = __float2bfloat16(acc[i]);
      const int next_layer = s == 3 ? layer + 1 : layer;
      if (next_layer < layers) {
        const Plan next = plan(stage(next_layer, (s + 1) % 4));
        if (warp < next.units) load_unit<V>(next, warp, a);
      }
      arrivals += gridDim.x;
      grid_barrier(c.sync, arrivals);
    }
  }
  grid_leave(c.sync);
}

// The unit form with each warp's first M units of a projection copied (cp.async) into shared memory two
// projections ahead, into one of two buffers by the projection's parity: stage k + 2's copies are issued while
// stage k runs, so they have two barriers' time to land. Units past the first M stream through registers as in
// the unit form. Each lane copies and reads back only its own vectors. The input vector is read 8 values per
// 16-byte load, so a projection's input costs one round trip to L2.
template <int V, int M>
__device__ __forceinline__ void copy_units(const Plan& p, uint4* dst) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int u = warp + m * warps;
    if (u < p.units) {
      const int row = u / p.splits, seg = u - row * p.splits;
      const uint4* base = reinterpret_cast<const uint4*>(p.w + static_cast<int64_t>(row) * p.k) +
                          seg * p.per_lane * 32 + lane;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (j < p.per_lane) {
          const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst + (m * V + j) * 32 + lane));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(base + 32 * j) : "memory");
        }
      }
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float* out) {
  const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(v[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <int V, int M>
__global__ void __launch_bounds__(V >= 8 ? 512 : 1024, 1)
    early_chain_kernel(Chain c, int max_k, unsigned long long* trace) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem);                     // [max_k]
  float* acc = xs + max_k;                                         // [kMaxRows]
  uint4* pre = reinterpret_cast<uint4*>(acc + kMaxRows);           // [2][warps][M][V][32]
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  uint4 a[V], b[V];
  unsigned arrivals = 0;
  auto stage = [&](int k) { return stage_of(c, k / 4, k % 4); };
  auto plan = [&](const Proj& p) { return plan_for(p.w, p.n, p.k, gridDim.x, blockIdx.x, warps, V); };
  auto buffer = [&](int k) { return pre + ((k % 2) * warps + warp) * M * V * 32; };
  const int stages = c.layers * 4;
  for (int k = 0; k < 2; ++k) {
    if (k < stages) {
      copy_units<V, M>(plan(stage(k)), buffer(k));
    } else {
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  // With `trace`, thread 0 of each CTA records the GPU clock (ns) at 5 points of each stage: [cta][stage][5].
  auto mark = [&](int k, int point) {
    if (trace != nullptr && threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      trace[(static_cast<int64_t>(blockIdx.x) * stages + k) * 5 + point] = t;
    }
  };
  for (int k = 0; k < stages; ++k) {
    mark(k, 0);  // after the barrier in front of this stage
    const Proj p = stage(k);
    const Plan pl = plan(p);
    int row0, rows;
    cta_rows(p.n, row0, rows);
    const int first_streamed = warp + M * warps;                     // this warp's first unit not copied early
    if (first_streamed < pl.units) load_unit<V>(pl, first_streamed, b);  // from HBM now
    for (int i = threadIdx.x * 8; i < p.k; i += blockDim.x * 8) {
      float v[8];
      bf16x8_to_float(__ldcg(reinterpret_cast<const uint4*>(p.x + i)), v);
      if (p.swiglu) {
        float up[8];
        bf16x8_to_float(__ldcg(reinterpret_cast<const uint4*>(p.x + p.k + i)), up);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = bf16_round(bf16_round(v[j] / (1.f + __expf(-v[j]))) * up[j]);
      }
      *reinterpret_cast<float4*>(xs + i) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(xs + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
    for (int i = threadIdx.x; i < rows; i += blockDim.x) acc[i] = 0.f;
    __syncthreads();
    mark(k, 1);  // the input is in shared memory
    asm volatile("cp.async.wait_group 1;" ::: "memory");  // this stage's copies are in
    const uint4* src = buffer(k);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int u = warp + m * warps;
      if (u < pl.units) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (j < pl.per_lane) a[j] = src[(m * V + j) * 32 + lane];
        }
        sum_unit<V>(pl, u, a, xs, acc);
      }
    }
    mark(k, 2);  // warp 0's early units are summed
    if (k + 2 < stages) {  // the buffer was read into registers above: reuse it two stages ahead
      copy_units<V, M>(plan(stage(k + 2)), buffer(k));
    } else {
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    stream_units<V>(pl, first_streamed, b, a, xs, acc);
    __syncthreads();
    mark(k, 3);  // every unit is summed
    for (int i = threadIdx.x; i < rows; i += blockDim.x) p.out[row0 + i] = __float2bfloat16(acc[i]);
    mark(k, 4);  // the outputs are written; the barrier follows
    arrivals += gridDim.x;
    grid_barrier(c.sync, arrivals);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  grid_leave(c.sync);
}

template <int R>
size_t ring_smem(int threads) {
  return static_cast<size_t>(R) * threads * sizeof(uint4) + (kMaxK + kMaxRows) * sizeof(float);
}

__global__ void barrier_kernel(unsigned* sync, int iters) {
  unsigned arrivals = 0;
  for (int i = 0; i < iters; ++i) {
    arrivals += gridDim.x;
    grid_barrier(sync, arrivals);
  }
  grid_leave(sync);
}

Chain make_chain(void** ptrs, const int* dims) {
  return Chain{static_cast<__nv_bfloat16*>(ptrs[0]), static_cast<__nv_bfloat16*>(ptrs[1]),
               static_cast<__nv_bfloat16*>(ptrs[2]), static_cast<__nv_bfloat16*>(ptrs[3]),
               static_cast<const __nv_bfloat16*>(ptrs[4]), static_cast<const __nv_bfloat16*>(ptrs[5]),
               static_cast<const __nv_bfloat16*>(ptrs[6]), static_cast<const __nv_bfloat16*>(ptrs[7]),
               static_cast<unsigned*>(ptrs[8]), dims[0], dims[1], dims[2], dims[3], dims[4]};
}

// -1 for a shape a kernel does not take (every input a multiple of 256 wide, at most kMaxK; at most kMaxRows
// rows of a projection per CTA), else 0.
int check_shapes(const Chain& c, int blocks) {
  for (int s = 0; s < 4; ++s) {
    const Proj p = stage_of(c, 0, s);
    if (p.k % 256 != 0 || p.k > kMaxK || (p.n + blocks - 1) / blocks > kMaxRows) return -1;
  }
  return 0;
}

// Whether every CTA's unit plan of every projection fits V vectors per lane.
template <int V>
bool plans_fit(const Chain& c, int blocks, int threads) {
  for (int s = 0; s < 4; ++s) {
    const Proj p = stage_of(c, 0, s);
    for (int cta = 0; cta < blocks; ++cta) {
      if (plan_for(nullptr, p.n, p.k, blocks, cta, threads / 32, V).per_lane > V) return false;
    }
  }
  return true;
}

// Before a launch: -1 when a CTA may not have `smem` bytes of dynamic shared memory; -2 when the GPU cannot hold
// all `blocks` CTAs at once (a grid barrier would never open); else 0.
template <class Kernel>
int ready_to_launch(Kernel kernel, int blocks, int threads, size_t smem) {
  if (smem > 0 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  int per_sm = 0, device = 0, sms = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return blocks > per_sm * sms ? -2 : 0;
}

template <int U>
int launch(const Chain& c, int blocks, int threads, cudaStream_t stream) {
  if (const int refused = ready_to_launch(chain_kernel<U>, blocks, threads, 0)) return refused;
  chain_kernel<U><<<blocks, threads, 0, stream>>>(c);
  return static_cast<int>(cudaGetLastError());
}

template <int R>
int launch_ring(const Chain& c, int blocks, int threads, cudaStream_t stream) {
  const size_t smem = ring_smem<R>(threads);
  if (const int refused = ready_to_launch(ring_chain_kernel<R>, blocks, threads, smem)) return refused;
  ring_chain_kernel<R><<<blocks, threads, smem, stream>>>(c);
  return static_cast<int>(cudaGetLastError());
}

template <int V>
int launch_units(const Chain& c, int blocks, int threads, cudaStream_t stream) {
  if (!plans_fit<V>(c, blocks, threads)) return -1;
  if (const int refused = ready_to_launch(unit_chain_kernel<V>, blocks, threads, 0)) return refused;
  unit_chain_kernel<V><<<blocks, threads, 0, stream>>>(c);
  return static_cast<int>(cudaGetLastError());
}

template <int V, int M>
int launch_early(const Chain& c, int blocks, int threads, cudaStream_t stream, unsigned long long* trace) {
  if (!plans_fit<V>(c, blocks, threads)) return -1;
  const int max_k = c.hidden > c.q ? (c.hidden > c.inter ? c.hidden : c.inter) : (c.q > c.inter ? c.q : c.inter);
  const size_t smem =
      (max_k + kMaxRows) * sizeof(float) + 2 * static_cast<size_t>(threads) * M * V * sizeof(uint4);
  if (const int refused = ready_to_launch(early_chain_kernel<V, M>, blocks, threads, smem)) return refused;
  early_chain_kernel<V, M><<<blocks, threads, smem, stream>>>(c, max_k, trace);
  return static_cast<int>(cudaGetLastError());
}

int launch_early_any(const Chain& c, int blocks, int threads, int vectors, int early, cudaStream_t stream,
                     unsigned long long* trace) {
  switch (vectors * 10 + early) {
    case 41: return launch_early<4, 1>(c, blocks, threads, stream, trace);
    case 42: return launch_early<4, 2>(c, blocks, threads, stream, trace);
    case 43: return launch_early<4, 3>(c, blocks, threads, stream, trace);
    case 44: return launch_early<4, 4>(c, blocks, threads, stream, trace);
    case 81: return launch_early<8, 1>(c, blocks, threads, stream, trace);
    case 82: return launch_early<8, 2>(c, blocks, threads, stream, trace);
    default: return -1;
  }
}

}  // namespace

extern "C" {

// ptrs: h, qkv, o, gu, wqkv, wo, wgu, wd, sync (two zeroed uint32); dims: layers, hidden, qkv_n, q, inter.
// Returns a cudaError_t (0: launched); -1 for a shape or setting this kernel does not take, -2 for a grid larger
// than the GPU holds at once.
// units 4/8/16: the unit form, at most that many vectors per lane per unit, with `early` (1-4 with 4 vectors,
// 1-2 with 8) units per warp copied two projections ahead when early > 0; else ring 4/8/12/16: the ring form with
// that many slots; else the register form, `unroll` vectors per chunk.
int mstar_chain_launch(void** ptrs, const int* dims, int blocks, int threads, int unroll, int ring, int units,
                       int early, void* stream) {
  const Chain c = make_chain(ptrs, dims);
  if (check_shapes(c, blocks) != 0) return -1;
  const int max_threads = units >= 16 ? 256 : units >= 8 || (ring == 0 && units == 0 && unroll >= 8) ? 512 : 1024;
  if (threads % 32 != 0 || threads > max_threads) return -1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (units > 0 && early > 0) return launch_early_any(c, blocks, threads, units, early, s, nullptr);
  switch (units) {
    case 0: break;
    case 4: return launch_units<4>(c, blocks, threads, s);
    case 8: return launch_units<8>(c, blocks, threads, s);
    case 16: return launch_units<16>(c, blocks, threads, s);
    default: return -1;
  }
  switch (ring) {  // the ring form, `ring` slots per thread
    case 0: break;
    case 4: return launch_ring<4>(c, blocks, threads, s);
    case 8: return launch_ring<8>(c, blocks, threads, s);
    case 12: return launch_ring<12>(c, blocks, threads, s);
    case 16: return launch_ring<16>(c, blocks, threads, s);
    default: return -1;
  }
  switch (unroll) {
    case 2: return launch<2>(c, blocks, threads, s);
    case 4: return launch<4>(c, blocks, threads, s);
    case 8: return launch<8>(c, blocks, threads, s);
    default: return -1;
  }
}

// The early-copy unit form (4 vectors per lane, `early` units per warp copied ahead) with the per-stage clock
// trace written to `trace` ([blocks][layers x 4][5] uint64 ns).
int mstar_chain_trace(void** ptrs, const int* dims, int blocks, int threads, int early, void* trace,
                      void* stream) {
  const Chain c = make_chain(ptrs, dims);
  if (check_shapes(c, blocks) != 0 || threads % 32 != 0 || threads > 1024) return -1;
  return launch_early_any(c, blocks, threads, 4, early, static_cast<cudaStream_t>(stream),
                          static_cast<unsigned long long*>(trace));
}

int mstar_barrier_launch(void* sync, int iters, int blocks, int threads, void* stream) {
  barrier_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<unsigned*>(sync), iters);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
