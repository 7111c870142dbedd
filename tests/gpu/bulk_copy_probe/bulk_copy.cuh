// What the bulk-copy probes share: the CUDA check, rows' random places, and bulk loads into shared memory that
// complete on an mbarrier (one thread issues them; any thread of the CTA may wait).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t err_ = (x);                                                  \
    if (err_ != cudaSuccess) {                                               \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));    \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

// Row i's random place: a bijection of [0, rows) for rows a power of two (an odd multiplier is invertible mod
// 2^k), computed rather than read so that a pipeline's one thread never waits on an index load.
__host__ __device__ __forceinline__ int shuffled_row(int i, int rows, uint32_t salt) {
  return (int)((((uint32_t)i ^ salt) * 2654435761u) & (uint32_t)(rows - 1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// One thread: `count` mbarriers, each completed by one arrival (with its bytes).
__device__ __forceinline__ void init_barriers(uint64_t* bars, int count) {
  for (int s = 0; s < count; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One thread: `bar`'s current phase completes once `bytes` have arrived (by bulk_copy calls) and this one arrival.
__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// `bytes` (a multiple of 16) at global `src` into shared `dst`, counted against `bar`'s expected bytes.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// One thread: `bytes` (a multiple of 16) at global `src` into shared `dst`, completing `bar`'s current phase.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  expect_bytes(bar, bytes);
  bulk_copy(dst, src, bytes, bar);
}

// Until `bar`'s phase of this parity completed; a bounded wait (~2 s at 2 GHz), then a trap.
__device__ __forceinline__ void wait_loaded(uint64_t* bar, uint32_t parity) {
  const long long give_up = clock64() + (1ll << 32);
  uint32_t done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
    if (!done && clock64() > give_up) __trap();
  }
}
