// LogFMT-10 on the GPU: the compressed low-latency combine's encoder (a warp per 128-value block) and decoder (a
// lane's 8 consecutive values). The format and its error bound are defined in jax_ep/logfmt.py's docstring; the
// sizes are kernel_limits.h's kLogFmt*. Codes of block b of a row lie at bytes [b * 160, b * 160 + 160) (code i in
// bits [10i, 10i + 10) of that little-endian stream), its (amax, amin) word at byte blocks * 160 + 4b.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernel_limits.h"

namespace jax_ep {
namespace {

constexpr int kLogFmtMaxCode = (1 << (kLogFmtCodeBits - 1)) - 1;  // magnitude codes 1 .. 511; 0 is zero
constexpr int kLogFmtCodeWords = static_cast<int>(kLogFmtCodeBytes / 4);  // 40
constexpr int kLogFmtLaneValues = kLogFmtBlock / 32;  // the encoder: 4 values per lane
constexpr float kLogFmtSmallestNormal = 0x1p-126f;  // smaller magnitudes count as zero (GPUs flush them)
constexpr uint16_t kBf16QuietNan = 0x7FC0;

__device__ __forceinline__ uint16_t bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<uint16_t>(bits)));
}

// Octaves between codes, from the block's (amax, amin) as both encoder and decoder see them. Logarithms of ratios to
// amin (at most kLogFmtMaxOctaves) keep float32's rounding small, as in jax_ep/logfmt.py.
__device__ __forceinline__ float logfmt_step(float amax, float amin) {
  return log2f(amax / amin) / static_cast<float>(kLogFmtMaxCode - 1);
}

// Warp-collective: encodes the 128 bfloat16 values at `src` (16-byte aligned; 4 per lane) into `codes`
// (kLogFmtCodeBytes, 16-byte aligned) and `scale` (4 bytes): plain stores, so `codes` and `scale` may be a peer's
// memory. `words` is this warp's kLogFmtCodeWords of shared memory, 16-byte aligned.
__device__ __forceinline__ void logfmt_encode_block(const __nv_bfloat16* src, char* codes, char* scale, uint32_t* words,
                                                    int lane) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src + lane * kLogFmtLaneValues);
  const __nv_bfloat16* pair = reinterpret_cast<const __nv_bfloat16*>(&raw);
  float value[kLogFmtLaneValues], magnitude[kLogFmtLaneValues];
  float amax = 0.f, amin = __int_as_float(0x7f800000);  // +inf: no non-zero magnitude yet
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kLogFmtLaneValues; ++i) {
    value[i] = __bfloat162float(pair[i]);
    finite = finite && isfinite(value[i]);
    const float m = fabsf(value[i]);
    magnitude[i] = m < kLogFmtSmallestNormal ? 0.f : m;
    amax = fmaxf(amax, magnitude[i]);
    if (magnitude[i] > 0.f) amin = fminf(amin, magnitude[i]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, offset));
  }
  finite = __all_sync(0xffffffffu, finite);
  const float floor = fmaxf(__bfloat162float(__float2bfloat16_rn(ldexpf(amax, -kLogFmtMaxOctaves))),
                            kLogFmtSmallestNormal);
  amin = amax > 0.f ? fmaxf(amin, floor) : 0.f;  // both exact bfloat16 values
  const float step = logfmt_step(amax, amin);
  const float flush_below = amin * exp2f(-step / 2);
  uint64_t bits = 0;
#pragma unroll
  for (int i = 0; i < kLogFmtLaneValues; ++i) {
    uint32_t code = 0;
    if (magnitude[i] > 0.f && !(magnitude[i] < flush_below)) {
      const float position = step > 0.f ? log2f(fmaxf(magnitude[i], amin) / amin) / step : 0.f;
      code = static_cast<uint32_t>(fminf(fmaxf(rintf(position), 0.f), kLogFmtMaxCode - 1)) + 1;
      code |= static_cast<uint32_t>(signbit(value[i]) ? 1 : 0) << (kLogFmtCodeBits - 1);
    }
    bits |= static_cast<uint64_t>(code) << (kLogFmtCodeBits * i);
  }
  // Lane l's 40 bits start at bit 40l of the block's stream: within words 40l / 32 and the next.
  for (int w = lane; w < kLogFmtCodeWords; w += 32) words[w] = 0;
  __syncwarp();
  const int first_bit = lane * kLogFmtLaneValues * kLogFmtCodeBits;
  const uint64_t placed = bits << (first_bit % 32);
  atomicOr(words + first_bit / 32, static_cast<uint32_t>(placed));
  if (placed >> 32) atomicOr(words + first_bit / 32 + 1, static_cast<uint32_t>(placed >> 32));
  __syncwarp();
  if (lane < kLogFmtCodeBytes / 16)
    reinterpret_cast<uint4*>(codes)[lane] = reinterpret_cast<const uint4*>(words)[lane];
  if (lane == 0)
    *reinterpret_cast<uint32_t*>(scale) =
        (finite ? bf16_bits(amax) : kBf16QuietNan) | static_cast<uint32_t>(bf16_bits(amin)) << 16;
  __syncwarp();  // `words` is free again
}

// The words a lane decoding the 8 values from value `first` (a multiple of 8) of block b needs: three code words
// from word 5 * (first % 128 / 8) / 2 (its bits start at bit 0 or 16 of the first) and the block's scale word.
__device__ __forceinline__ uint4 logfmt_load8(const char* row, int64_t blocks, int64_t first) {
  const int64_t b = first / kLogFmtBlock, j = first % kLogFmtBlock / 8;
  const uint32_t* code_words = reinterpret_cast<const uint32_t*>(row + b * kLogFmtCodeBytes) + 5 * j / 2;
  return make_uint4(__ldcg(code_words), __ldcg(code_words + 1), __ldcg(code_words + 2),
                    __ldcg(reinterpret_cast<const uint32_t*>(row + blocks * kLogFmtCodeBytes) + b));
}

// The 8 values logfmt_load8 loaded for value `first`, as float32 (NaN for a block that held a non-finite value).
__device__ __forceinline__ void logfmt_decode8(const uint4& words, int64_t first, float (&v)[8]) {
  const float amax = bf16_bits_to_float(words.w & 0xFFFF), amin = bf16_bits_to_float(words.w >> 16);
  const float step = logfmt_step(amax, amin);
  const uint64_t low = words.x | static_cast<uint64_t>(words.y) << 32;
  const int first_bit = (first % kLogFmtBlock / 8) % 2 * 16;  // 80 bits per 8 values: half-word starts
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int bit = first_bit + kLogFmtCodeBits * i;  // < 96
    uint32_t code;
    if (bit + kLogFmtCodeBits <= 64) code = static_cast<uint32_t>(low >> bit);
    else if (bit < 64) code = static_cast<uint32_t>(low >> bit) | (words.z << (64 - bit));
    else code = words.z >> (bit - 64);
    code &= (1u << kLogFmtCodeBits) - 1;
    const uint32_t q = code & kLogFmtMaxCode;
    float magnitude = q == 1 ? amin : q == kLogFmtMaxCode ? amax : amin * exp2f((q - 1.f) * step);
    if (q == 0) magnitude = 0.f;
    v[i] = isnan(amax) ? amax : (code >> (kLogFmtCodeBits - 1) ? -magnitude : magnitude);
  }
}

}  // namespace
}  // namespace jax_ep
