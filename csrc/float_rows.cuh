// Element conversions and packed vectors of the combine kernels (intranode.cu, internode.cu), which read rows of
// float32, bfloat16 or float16 and accumulate in float32. Internal linkage, as device_common.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

}  // namespace
}  // namespace jax_ep
