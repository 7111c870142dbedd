// The low-latency (LL) region of a rank's workspace: where it lies and what it holds. Shared by the kernels
// (low_latency.cu) and the handlers' size check; jax_ep.config.low_latency_buffer_bytes mirrors `total`.
//
// The region starts at byte `ll_offset` of the workspace (256-byte aligned) and holds:
//   header                                   256 bytes: this rank's call counters and credits (below)
//   set 0, set 1                              two buffer sets; call c of an op uses set c % 2
// One set:
//   dispatch_flags  [L][R] uint64             at the receiver: (call tag << 32 | row count) per (local expert,
//                                             source rank), written by the source after its rows
//   combine_flags   [E] uint64                at the source: call tag per global expert, written by the
//                                             expert's rank after it returned that expert's rows
//   dispatch_meta   [L][R][M] int2            at the receiver: (source token, top-k slot) of each slot row
//   dispatch_rows   [L][R][M] x 2H bytes      at the receiver: BF16 rows, or FP8 values (H bytes) + scales
//   combine_rows    [M][kLowLatencyMaxTopk] x 2H bytes  at the source: expert output row of (token, slot)
// A token's position inside its (expert, source rank) slot region is its rank among the source's tokens
// routed to that expert, in token order, so every output is deterministic.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

// Top-k entries a token may have in low-latency mode: the combine region keeps one row per (token, k).
inline constexpr int kLowLatencyMaxTopk = 16;
// Experts of a low-latency Buffer: the receive kernel keeps two int32 per (local expert, source rank) in
// shared memory (32 KB at this bound).
inline constexpr int kLowLatencyMaxExperts = 4096;
inline constexpr int64_t kLowLatencyAlign = 256;

// The LL kernels, as indexed in the header's per-kernel fields and by low_latency_kernel_times.
enum LowLatencyKernel : int { kDispatchRoute = 0, kDispatchSendKernel, kDispatchRecvKernel, kCombineSendKernel,
                              kCombineRecvKernel, kLowLatencyKernels };

// Call numbers are 32-bit and compared modulo 2^32 (see `call_reached`), so they never run out.
struct LowLatencyHeader {
  uint32_t dispatch_calls;            // dispatch send calls this rank completed
  uint32_t combine_calls;             // combine send calls this rank completed
  uint32_t dispatch_consumed[2];      // [set]: latest dispatch call whose rows this rank's receive read
  uint32_t combine_consumed[2];       // [set]: latest combine call whose rows this rank's receive read
  uint32_t blocks_finished[kLowLatencyKernels];  // per LowLatencyKernel: blocks of the running call done
  unsigned error_claimed;             // the first block that fails fills the error record
  // Per LowLatencyKernel, for the benchmark's kernel times: %globaltimer at block 0's start of the running
  // call, and the calls and nanoseconds (block 0's start to the last block's end) summed since a reset.
  uint64_t kernel_start[kLowLatencyKernels];
  uint64_t kernel_calls[kLowLatencyKernels];
  uint64_t kernel_ns[kLowLatencyKernels];
};
static_assert(sizeof(LowLatencyHeader) <= kLowLatencyAlign, "the header has 256 bytes");

__host__ __device__ inline int64_t ll_align(int64_t bytes) {
  return (bytes + kLowLatencyAlign - 1) / kLowLatencyAlign * kLowLatencyAlign;
}

// Byte offsets inside the LL region for M tokens per rank, hidden H and E experts.
struct LowLatencyLayout {
  int64_t set_bytes = 0;
  int64_t dispatch_flags = 0, combine_flags = 0, dispatch_meta = 0, dispatch_rows = 0, combine_rows = 0;
  int64_t slot_bytes = 0;  // one row of either region: 2H
  int64_t total = 0;

  __host__ __device__ LowLatencyLayout(int64_t max_tokens, int64_t hidden, int64_t num_experts) {
    slot_bytes = 2 * hidden;
    dispatch_flags = 0;
    combine_flags = ll_align(num_experts * 8);
    dispatch_meta = combine_flags + ll_align(num_experts * 8);
    dispatch_rows = dispatch_meta + ll_align(num_experts * max_tokens * 8);
    combine_rows = dispatch_rows + num_experts * max_tokens * slot_bytes;
    set_bytes = combine_rows + max_tokens * kLowLatencyMaxTopk * slot_bytes;
    total = kLowLatencyAlign + 2 * set_bytes;
  }

  // Set `set` (0 or 1) of a region that starts at `region`.
  __host__ __device__ char* set_base(char* region, uint32_t set) const {
    return region + kLowLatencyAlign + static_cast<int64_t>(set) * set_bytes;
  }
};

}  // namespace jax_ep
