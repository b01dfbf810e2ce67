// Device and launch helpers of scripts/probe_staged_gemv.cu (once shared with a served staged GEMV, measured and
// removed on 2026-12-04: docs/benchmarks.md): PDL's two
// instructions, a bulk asynchronous copy from global into shared memory that completes on an mbarrier, the wait
// for that barrier's first phase, and a launch with the PDL attribute.

#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace mstar {

constexpr uint32_t kBulkChunk = 16384;  // bytes per bulk copy

__device__ __forceinline__ void gdc_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void gdc_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: arm `bar` for `bytes` (a multiple of 16) and copy them from `src` to `dst` (both 16-byte aligned) in
// chunks that all complete on `bar`.
__device__ __forceinline__ void stage(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  for (uint32_t off = 0; off < bytes; off += kBulkChunk) {
    const uint32_t size = bytes - off < kBulkChunk ? bytes - off : kBulkChunk;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(static_cast<char*>(dst) + off)),
        "l"(static_cast<const char*>(src) + off), "r"(size), "r"(smem_addr(bar))
        : "memory");
  }
}

__device__ __forceinline__ void wait_phase0(uint64_t* bar) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar))
        : "memory");
  }
}

// `kernel<<<grid, block, smem, stream>>>(args...)`, with programmatic stream serialization (PDL) when `pdl`.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace mstar
