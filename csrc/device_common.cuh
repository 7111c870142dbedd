// Device helpers shared by the NVLink kernels (intranode.cu, the low-latency kernels): flag loads and stores at system
// scope, the clock, the timeout record, and warp row copies with many loads in flight. Everything here has
// internal linkage (each kernel file gets its own copy; the device link sees no duplicate symbols).
#pragma once
#include <cstdint>
#include <cstring>

#include "intranode_state.h"

namespace jax_ep {
namespace {

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void store_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void store_release_sys(uint32_t* ptr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// Fills this rank's host-mapped error record (first failing thread only) and traps. Kept out of line (it is
// cold); takes scalars so the caller's kernel parameters stay in constant memory. `op` is written last:
// nonzero marks the record complete.
__device__ __noinline__ void fail_on_timeout(unsigned* error_claimed, TimeoutRecord* error, int rank, int32_t op,
                                             int32_t wait, int peer, uint64_t call, uint64_t seen, int64_t waited_ns) {
  if (atomicCAS(error_claimed, 0u, 1u) == 0u) {
    volatile TimeoutRecord* record = error;
    record->wait = wait;
    record->rank = rank;
    record->peer = peer;
    record->call = call;
    record->seen = seen;
    record->waited_ns = waited_ns;
    __threadfence_system();
    record->op = op;
    __threadfence_system();
  }
  __trap();
}

// Spins until *flag >= target (acquire loads at system scope). Past timeout_ns it calls
// on_timeout(seen, waited_ns), which records the wait and traps (fail_on_timeout): it does not return.
template <typename Word, typename OnTimeout>
__device__ __forceinline__ void wait_at_least(const Word* flag, Word target, int64_t timeout_ns, OnTimeout on_timeout) {
  Word seen = load_acquire_sys(flag);
  if (seen >= target) return;
  const uint64_t start = now_ns();
  while ((seen = load_acquire_sys(flag)) < target) {
    const int64_t waited = static_cast<int64_t>(now_ns() - start);
    if (waited > timeout_ns) on_timeout(seen, waited);
  }
}

// Loads of row data. LoadNonCoherent: inputs a peer published before the arrival barrier this block passed
// (XLA buffers, or rows a staged peer copied earlier in the same call), through the non-coherent path without
// L1 allocation (rows are read once; this block never read those addresses before the barrier, so no stale
// line can be cached). LoadL2: data that peers wrote during the kernel, before a flag this thread acquired:
// read at L2, the coherence point of NVLink writes.
struct LoadNonCoherent {
  template <typename T>
  __device__ __forceinline__ T operator()(const T* ptr) const {
    static_assert(sizeof(T) == 16 || sizeof(T) == 8 || sizeof(T) == 4 || sizeof(T) == 2 || sizeof(T) == 1);
    T out;
    if constexpr (sizeof(T) == 16) {
      uint4 v;
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(ptr));
      memcpy(&out, &v, 16);
    } else if constexpr (sizeof(T) == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(ptr));
      memcpy(&out, &v, 8);
    } else if constexpr (sizeof(T) == 4) {
      const unsigned v = __ldg(reinterpret_cast<const unsigned*>(ptr));
      memcpy(&out, &v, 4);
    } else if constexpr (sizeof(T) == 2) {
      const unsigned short v = __ldg(reinterpret_cast<const unsigned short*>(ptr));
      memcpy(&out, &v, 2);
    } else {
      const unsigned char v = __ldg(reinterpret_cast<const unsigned char*>(ptr));
      memcpy(&out, &v, 1);
    }
    return out;
  }
};

struct LoadL2 {
  template <typename T>
  __device__ __forceinline__ T operator()(const T* ptr) const {
    if constexpr (sizeof(T) > 16 && sizeof(T) % 16 == 0) {  // e.g. eight float32: 16-byte loads
      T out;
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(T) / 16); ++i) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(ptr) + i);
        memcpy(reinterpret_cast<char*>(&out) + 16 * i, &v, 16);
      }
      return out;
    } else if constexpr (sizeof(T) == 16) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(ptr));
      T out;
      memcpy(&out, &v, 16);
      return out;
    } else if constexpr (sizeof(T) == 8) {
      const uint2 v = __ldcg(reinterpret_cast<const uint2*>(ptr));
      T out;
      memcpy(&out, &v, 8);
      return out;
    } else if constexpr (sizeof(T) == 4) {
      const unsigned v = __ldcg(reinterpret_cast<const unsigned*>(ptr));
      T out;
      memcpy(&out, &v, 4);
      return out;
    } else if constexpr (sizeof(T) == 2) {  // also one-element packs of 16-bit floats (no volatile copy)
      const unsigned short v = __ldcg(reinterpret_cast<const unsigned short*>(ptr));
      T out;
      memcpy(&out, &v, 2);
      return out;
    } else {
      return *reinterpret_cast<const volatile T*>(ptr);
    }
  }
};

// A warp copies n units; every lane keeps kUnroll loads in flight (one warp's copy over NVLink is bound by
// latency, not bandwidth). The last batch is predicated rather than copied a unit per round trip, so a row of
// n units costs ceil(n / (32 * kUnroll)) load latencies (a 7 KB FP8 row of values: 2, not 7). Units past the
// end are zeroed rather than left undefined: ptxas then keeps far fewer registers in the callers' row loops.
template <int kUnroll, typename Unit, typename Load>
__device__ __forceinline__ void warp_copy_units(Unit* dst, const Unit* src, int64_t n, int lane, Load load) {
  src += lane;
  dst += lane;
  // Units per lane: n is a row's size (< 2^31 units).
  for (int left = static_cast<int>((n - lane + 31) / 32); left > 0;
       left -= kUnroll, src += 32 * kUnroll, dst += 32 * kUnroll) {
    Unit v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = u < left ? load(src + 32 * u) : Unit{};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < left) dst[32 * u] = v[u];
  }
}

template <typename Unit>
__device__ __forceinline__ void warp_zero_units(Unit* dst, int64_t n, int lane) {
  Unit zero;
  memset(&zero, 0, sizeof(Unit));
  for (int64_t i = lane; i < n; i += 32) dst[i] = zero;
}

// Widest unit (16 bytes down to 1) that divides the row size and both addresses.
__device__ __forceinline__ int unit_bytes(uintptr_t bits) {
  return bits % 16 == 0 ? 16 : bits % 8 == 0 ? 8 : bits % 4 == 0 ? 4 : bits % 2 == 0 ? 2 : 1;
}

// A warp zeroes a row with the widest stores its size and address allow.
__device__ __forceinline__ void warp_zero_row(void* dst, int64_t bytes, int lane) {
  switch (unit_bytes(reinterpret_cast<uintptr_t>(dst) | bytes)) {
    case 16: return warp_zero_units(static_cast<uint4*>(dst), bytes / 16, lane);
    case 8: return warp_zero_units(static_cast<uint2*>(dst), bytes / 8, lane);
    case 4: return warp_zero_units(static_cast<uint32_t*>(dst), bytes / 4, lane);
    case 2: return warp_zero_units(static_cast<uint16_t*>(dst), bytes / 2, lane);
    default: return warp_zero_units(static_cast<uint8_t*>(dst), bytes, lane);
  }
}

template <int kUnroll, typename Load>
__device__ void warp_copy_row(void* dst, const void* src, int64_t bytes, int lane, Load load) {
  switch (unit_bytes(reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes)) {
    case 16:
      return warp_copy_units<kUnroll>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16, lane, load);
    case 8:
      return warp_copy_units<kUnroll>(static_cast<uint2*>(dst), static_cast<const uint2*>(src), bytes / 8, lane, load);
    case 4:
      return warp_copy_units<kUnroll>(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), bytes / 4, lane,
                                      load);
    case 2:
      return warp_copy_units<kUnroll>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), bytes / 2, lane,
                                      load);
    default:
      return warp_copy_units<kUnroll>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes, lane, load);
  }
}

// A row and its short side row (the FP8 pair's values and scales, at most 32 16-byte units) together: the side
// row's loads are issued with the first round of the row's, so that they cost no round trip of their own. Falls
// back to two copies where a row is not 16-byte aligned or the side row is longer or not whole 16-byte units.
// side_bytes may be 0 (the side pointers are then never dereferenced and may be null).
template <int kUnroll, typename Load>
__device__ void warp_copy_row_pair(void* dst, const void* src, int64_t bytes, void* side_dst, const void* side_src,
                                   int64_t side_bytes, int lane, Load load) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         reinterpret_cast<uintptr_t>(side_dst) | reinterpret_cast<uintptr_t>(side_src) |
                         static_cast<uintptr_t>(bytes) | static_cast<uintptr_t>(side_bytes);
  if (bits % 16 != 0 || side_bytes > 32 * 16) {
    warp_copy_row<kUnroll>(dst, src, bytes, lane, load);
    warp_copy_row<kUnroll>(side_dst, side_src, side_bytes, lane, load);
    return;
  }
  const bool has_side = lane < side_bytes / 16;
  uint4 side;
  if (has_side) side = load(static_cast<const uint4*>(side_src) + lane);
  warp_copy_units<kUnroll>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16, lane, load);
  if (has_side) static_cast<uint4*>(side_dst)[lane] = side;
}

// Row `row` of a buffer of row_bytes-byte rows (intranode.cu, internode.cu).
__device__ __forceinline__ const char* row_of(const void* base, int64_t row, int64_t row_bytes) {
  return static_cast<const char*>(base) + row * row_bytes;
}
__device__ __forceinline__ char* row_of(void* base, int64_t row, int64_t row_bytes) {
  return static_cast<char*>(base) + row * row_bytes;
}

}  // namespace
}  // namespace jax_ep
