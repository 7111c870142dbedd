// Element conversions and packed vectors of the combine kernels (intranode.cu, internode.cu), which read rows of
// float32, bfloat16 or float16 and accumulate in float32. Internal linkage, as device_common.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_ep {
namespace {

// N elements moved as one load or store (16 bytes at most).
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// The tail of every combine's reduction: acc (the float32 sum of element v * kVec.. of token t's row) plus the
// bias row, when there is one, converted to Out and stored as one pack. Shared so that the intranode and
// internode combines round alike.
template <typename Bias, typename Out, int kVec>
__device__ __forceinline__ void add_bias_and_store(float (&acc)[kVec], const Bias* bias, Out* out,
                                                   int64_t row_elements, int64_t t, int64_t v) {
  if (bias) {
    const Pack<Bias, kVec> b = *reinterpret_cast<const Pack<Bias, kVec>*>(bias + t * row_elements + v * kVec);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += to_float(b.v[e]);
  }
  Pack<Out, kVec> result;
#pragma unroll
  for (int e = 0; e < kVec; ++e) result.v[e] = from_float<Out>(acc[e]);
  *reinterpret_cast<Pack<Out, kVec>*>(out + t * row_elements + v * kVec) = result;
}

}  // namespace
}  // namespace jax_ep
