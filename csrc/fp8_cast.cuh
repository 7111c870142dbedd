// The FP8 cast of the low-latency dispatch, per lane of a warp (jax_ep/fp8.py bit for bit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstring>

#include "low_latency_protocol.cuh"

namespace jax_ep {
namespace {

// max that propagates NaN, as XLA's reduce-max and jnp.maximum do.
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// 2**ceil(log2(scale)) for a positive normal float: the scale itself when its mantissa is zero, else the next
// power of two (fp8.py's frexp rule).
__device__ __forceinline__ float round_up_to_power_of_two(float scale) {
  const uint32_t bits = __float_as_uint(scale);
  return (bits & 0x7fffffu) ? __uint_as_float((bits & 0x7f800000u) + 0x800000u) : scale;
}

// Casts this lane's 8 channels (group = 16 lanes): returns the e4m3 bytes, sets *scale for the group.
__device__ __forceinline__ uint2 cast_to_fp8(const float (&v)[kLaneChannels], bool round_scale, float* scale) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) amax = nan_max(amax, fabsf(v[i]));
#pragma unroll
  for (int mask = 8; mask >= 1; mask >>= 1) amax = nan_max(amax, __shfl_xor_sync(kFullMask, amax, mask));
  amax = nan_max(amax, kAmaxFloor);
  float s = __fmul_rn(amax, 1.f / kFp8Max);  // amax * float32(1/448), DeepEP's rounding
  if (round_scale) s = round_up_to_power_of_two(s);
  *scale = s;
  // x / s as fp8.py divides; a power-of-two scale has an exact reciprocal, and the product then rounds to the
  // same float as the quotient (both are the exact x * 2^-k rounded once), for a cheaper cast.
  const float inverse = __frcp_rn(s);
  uint8_t q[kLaneChannels];
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i)
    q[i] = __nv_cvt_float_to_fp8(round_scale ? __fmul_rn(v[i], inverse) : __fdiv_rn(v[i], s), __NV_SATFINITE,
                                 __NV_E4M3);
  uint2 out;
  memcpy(&out, q, sizeof(out));
  return out;
}

}  // namespace
}  // namespace jax_ep
