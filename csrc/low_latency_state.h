// The low-latency (LL) region of a rank: where it lies and what it holds. Shared by the kernels
// (low_latency.cu) and the handlers' size check; jax_ep.config.low_latency_buffer_bytes mirrors `total`.
//
// The region lives at byte `ll_offset` of the rank's intranode workspace (peer-store transport) or of its
// NVSHMEM symmetric allocation (NVSHMEM transport); either way the layout is the same and every offset below
// is relative to the region's start, so one offset names the same word on every rank. It holds:
//   header                                   512 bytes: this rank's call counters and credits (below)
//   trace [kernel][kLowLatencyTraceCalls]    LowLatencyTrace: %globaltimer instants of each LL kernel's recent
//                                            calls on this rank (the benchmark's breakdown; 88 KB)
//   dispatch_counters [E] uint64             the send's progress per expert, this rank's own (low_latency.cu,
//                                            count_toward_flag); zero between calls
//   combine_counters [E] uint32              the combine send's row pieces written per (local expert,
//                                            source rank), this rank's own (low_latency.cu, combine_piece_sent); zero
//                                            between calls
//   dispatch_staging [M] x dispatch slot     this rank's rows as sent (cast, with their header): the source of
//                                            the NVSHMEM puts into the receivers' slots (with peer stores only
//                                            the header is staged: the cast writes the slots directly)
//   set 0, set 1                              two buffer sets; call c of an op uses set c % 2
// One set:
//   dispatch_flags  [L][R] uint64             at the receiver: (call tag << 32 | row count) per (local expert,
//                                             source rank), written by the source after its rows
//   combine_flags   [E] uint64                at the source: call tag per global expert, written by the
//                                             expert's rank after it returned that expert's rows
//   dispatch_index  [L][R][M] int32           at the receiver: per (local expert, source rank), the source
//                                             token of each slot position
//   dispatch_rows   [R][M] dispatch slots     at the receiver: per (source rank, source token) a
//                                             DispatchRowHeader, then the BF16 row, or the FP8 values (H bytes)
//                                             and scales. A token crosses to a rank once, however many of its
//                                             experts live there; the receive copies it to each of them.
//   combine_rows    [M][kLowLatencyMaxTopk] x 2H bytes  at the source: expert output row of (token, slot)
// A token's position inside its (expert, source rank) range is its rank among the source's tokens routed to
// that expert, in token order, so every output is deterministic.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "api.h"

namespace jax_ep {

// Top-k entries a token may have in low-latency mode: the combine region keeps one row per (token, k).
inline constexpr int kLowLatencyMaxTopk = 16;
// Experts of a low-latency Buffer: expert ids travel as int16 in the row headers and the send's shared routing.
inline constexpr int kLowLatencyMaxExperts = 4096;
// Top-k entries of one dispatch (T * K): the send keeps the routing in shared memory as int16 (16 KB at this
// bound, e.g. T = 512 tokens with K = 16).
inline constexpr int64_t kLowLatencyMaxEntries = 8192;
inline constexpr int64_t kLowLatencyAlign = 256;
inline constexpr int64_t kLowLatencyHeaderBytes = 512;

// The LL kernels, as indexed in the header's per-kernel fields and by low_latency_kernel_times.
enum LowLatencyKernel : int { kDispatchSendKernel = 0, kDispatchRecvKernel, kCombineSendKernel, kCombineRecvKernel,
                              kLowLatencyKernels };

// Call numbers are 32-bit and compared modulo 2^32 (see `call_reached`), so they never run out.
struct LowLatencyHeader {
  uint32_t dispatch_calls;            // dispatch send calls this rank completed
  uint32_t combine_calls;             // combine send calls this rank completed
  uint32_t blocks_finished[kLowLatencyKernels];  // per LowLatencyKernel: blocks of the running call done
  unsigned error_claimed;             // the first block that fails fills the error record
  // Credits, written by the peers (each receive pushes its progress to every sender, so that no rank ever
  // reads another's memory): [p][set] = the latest call whose rows in buffer set `set` rank p finished
  // reading. 64-bit words: NVSHMEM signals are 64-bit. Only the low 32 bits (the call number) count.
  uint64_t dispatch_credit[kMaxIntranodeRanks][2];
  uint64_t combine_credit[kMaxIntranodeRanks][2];
};
static_assert(sizeof(LowLatencyHeader) <= kLowLatencyHeaderBytes, "the header has 512 bytes");

// ---- trace: where one call of an LL kernel spent its time, on this rank (read by low_latency_trace) --------
// Every instant is this GPU's %globaltimer in ns (comparable across the kernels of one GPU, not across GPUs).
// Call c of an op uses slot c % kLowLatencyTraceCalls of each of its kernels (the send and the receive of a
// call share the number). Blocks add their share with atomics as they end; the last block of call c writes
// `end` and `call`, then prepares slot c + 1 (the next call of the same kernel runs after this one, in stream
// order): minima to ~0, everything else to 0. low_latency_trace(reset) prepares every slot; a slot that was
// never prepared (a region used before any reset) holds garbage in first_start and first_flag.
inline constexpr int kLowLatencyTraceCalls = 256;
inline constexpr int kLowLatencyPhases = 4;

struct LowLatencyTrace {
  uint64_t call;          // the call number (set with `end`)
  uint64_t units;         // what phase_ns sums over: blocks, or warps (combine receive); see kPhaseNames
  uint64_t first_start;   // min over blocks of their start
  uint64_t last_start;    // max over blocks of their start: first_start to last_start is the launch spread
  uint64_t first_flag;    // min over the kernel's flags: sends: a flag raised on a receiver; receives: a
                          // wait for flags satisfied (every flag of one expert, or of one token's experts)
  uint64_t last_flag;     // max of the same
  uint64_t end;           // the last block's end; 0 while the call runs
  uint64_t phase_ns[kLowLatencyPhases];  // time per phase (kLowLatencyPhaseNames) summed over the units
};
static_assert(sizeof(LowLatencyTrace) == 11 * sizeof(uint64_t), "the trace reader copies 64-bit words");

// The field names of LowLatencyTrace's words, then per kernel its phases, as the benchmark prints them.
inline constexpr const char* kLowLatencyTraceFields[] = {"call", "units", "first_start", "last_start",
                                                         "first_flag", "last_flag", "end"};
inline constexpr const char* kLowLatencyPhaseNames[kLowLatencyKernels][kLowLatencyPhases] = {
    {"routing", "cast", "puts", "flags"},       // dispatch send, per block (summed over its tokens)
    {"waiting", "copying", "-", "-"},           // dispatch receive, per block (summed over its units)
    {"credits", "puts", "flags", "-"},          // combine send, per block
    {"waiting", "summing", "-", "-"},           // combine receive, per (token, part) a warp took
};
static_assert(sizeof(kLowLatencyTraceFields) / sizeof(kLowLatencyTraceFields[0]) + kLowLatencyPhases ==
                  sizeof(LowLatencyTrace) / sizeof(uint64_t),
              "a name per word");
inline constexpr int64_t kLowLatencyTraceOffset = kLowLatencyHeaderBytes;  // region offset of the trace
inline constexpr int64_t kLowLatencyTraceBytes =
    static_cast<int64_t>(kLowLatencyKernels) * kLowLatencyTraceCalls * sizeof(LowLatencyTrace);

// What precedes each dispatched row: the source token's top-k expert ids, so that the receiver of expert e
// finds the top-k slot of its row (the first entry naming e) without a per-target write: every receiver of a
// token gets the same bytes, which are staged once and copied or put to each.
struct DispatchRowHeader {
  int16_t experts[kLowLatencyMaxTopk];  // the token's top-k ids; -1 past its top-k and for ids outside [0, E)
  int32_t unused[4];                    // keeps the payload 16-byte aligned
};
static_assert(sizeof(DispatchRowHeader) == 48 && sizeof(DispatchRowHeader) % 16 == 0, "row header of 48 bytes");

__host__ __device__ inline int64_t ll_align(int64_t bytes) {
  return (bytes + kLowLatencyAlign - 1) / kLowLatencyAlign * kLowLatencyAlign;
}

// Byte offsets inside the LL region for M tokens per rank, hidden H, R ranks and E experts.
struct LowLatencyLayout {
  int64_t dispatch_slot_bytes = 0;  // DispatchRowHeader + 2H (a BF16 row; FP8 values and scales are smaller)
  int64_t combine_slot_bytes = 0;   // 2H: a BF16 row
  int64_t trace = 0, dispatch_counters = 0, combine_counters = 0, dispatch_staging = 0;  // region offsets
  int64_t sets = 0, set_bytes = 0;
  int64_t dispatch_flags = 0, combine_flags = 0, dispatch_index = 0, dispatch_rows = 0, combine_rows = 0;  // in a set
  int64_t total = 0;

  __host__ __device__ LowLatencyLayout(int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
    dispatch_slot_bytes = static_cast<int64_t>(sizeof(DispatchRowHeader)) + 2 * hidden;
    combine_slot_bytes = 2 * hidden;
    trace = kLowLatencyTraceOffset;
    dispatch_counters = trace + ll_align(kLowLatencyTraceBytes);
    combine_counters = dispatch_counters + ll_align(num_experts * 8);
    dispatch_staging = combine_counters + ll_align(num_experts * 4);
    sets = dispatch_staging + ll_align(max_tokens * dispatch_slot_bytes);
    dispatch_flags = 0;
    combine_flags = ll_align(num_experts * 8);
    dispatch_index = combine_flags + ll_align(num_experts * 8);
    dispatch_rows = dispatch_index + ll_align(num_experts * max_tokens * 4);
    combine_rows = dispatch_rows + ll_align(num_ranks * max_tokens * dispatch_slot_bytes);
    set_bytes = combine_rows + max_tokens * kLowLatencyMaxTopk * combine_slot_bytes;
    total = sets + 2 * set_bytes;
  }

  // Region offset of buffer set `set` (0 or 1).
  __host__ __device__ int64_t set_offset(uint32_t set) const { return sets + static_cast<int64_t>(set) * set_bytes; }
};

}  // namespace jax_ep
