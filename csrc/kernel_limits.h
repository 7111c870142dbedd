// Every limit of the kernels, and every size that the host side needs to know ahead of a call, defined once.
// Plain C++17 (<cstdint> only, no CUDA types): the kernels and runtime (csrc/), the FFI handlers and the nanobind
// module jax_ep._C all include it. _C exports these numbers and sizes in every build, CUDA or not (`limits()`,
// `low_latency_region_bytes`, the staging and internode region sizes), and jax_ep/ calls those instead of keeping
// copies. The CUDA headers tie their structs to the constants here with static_asserts (low_latency_state.h,
// internode_state.h), so a struct that grows fails to compile instead of silently disagreeing with these sizes.
#pragma once
#include <cstdint>

// The layouts below run in the handlers and _C (host compilers) and in the kernels (nvcc).
#if defined(__CUDACC__)
#define JAX_EP_HOST_DEVICE __host__ __device__
#else
#define JAX_EP_HOST_DEVICE
#endif

namespace jax_ep {

// ---- build -------------------------------------------------------------------------------------------------------

// The benchmark's instrumentation, compiled in only by the CMake option JAX_EP_INSTRUMENT (`pip install ...
// --config-settings=cmake.define.JAX_EP_INSTRUMENT=ON`): the normal-mode kernels' timers, the low-latency kernels'
// trace and the store probe. A default build carries none of them: no clock reads in the kernels, no trace in the
// low-latency region, no timer in the states.
#if defined(JAX_EP_INSTRUMENT)
inline constexpr bool kInstrumented = true;
#else
inline constexpr bool kInstrumented = false;
#endif

// ---- normal mode (intranode and internode) -----------------------------------------------------------------------

// Threads of every normal-mode kernel's block (one block per SM).
inline constexpr int kNormalThreads = 512;
// The push combine's pushing warps per block: 1 to every warp of the block.
inline constexpr int kCombineMaxPushWarps = kNormalThreads / 32;

// Top-k entries per token of a normal-mode dispatch (intranode and internode): the kernels give each entry of a
// token one lane of a warp.
inline constexpr int kNormalMaxTopk = 32;

// ---- intranode normal mode ---------------------------------------------------------------------------------------

// Ranks of an intranode group (one NVLink domain): the per-rank tables of the state, views and launches have this
// many entries.
inline constexpr int kMaxIntranodeRanks = 8;

// Experts (E) of the intranode expert-major dispatch kernel: it counts pairs per (warp, source rank, local expert)
// in shared memory (kNormalThreads / 32 * E int32, 32 KB here). Larger E takes the composed expert-major path.
inline constexpr int kExpertMajorMaxExperts = 512;

// Rows past the last expert-major group that the combine's gradient (d y) zeroes: grouped_matmul's dw kernels read
// up to block_k - 1 rows of their rhs (d y in the MoE block's down projection) past a group's end and multiply them
// by zero, so those must be finite (the table's block_k is below this; tests/test_grouped_matmul.py checks it); rows
// further on are left unwritten, so that the gradient's work follows the pairs received, not the capacity.
inline constexpr int kExpertMajorGradZeroRows = 256;

// jax_ep's side streams per CUDA device (xla_ffi/side_streams.cc): the normal-mode ops' *_on_side_stream targets
// take one of 1 to kMaxSideStreams (0 is XLA's stream).
inline constexpr int kMaxSideStreams = 4;

// Groups spanning processes ("staged", api.h): a peer process cannot map XLA's buffers, so each op copies the inputs
// its peers read into its own workspace, one region per input in the order the op publishes them. Regions start at
// kStagingOffset (offset 0 is never a region, so a published 0 still means "no such input") and each is
// kStagingAlign-aligned; an absent input takes no room. The structs below give each op's offsets; `end` is the
// workspace bytes the op needs, which the launch checks and jax_ep.normal_buffer_bytes reports.
inline constexpr int64_t kStagingOffset = 256;
inline constexpr int64_t kStagingAlign = 256;

// Hands out the staged regions of one op, in order.
struct StagingCursor {
  int64_t end = kStagingOffset;

  // Offset of the next region, of `bytes` bytes (0: an absent input, at the current end and taking no room).
  int64_t take(int64_t bytes) {
    const int64_t offset = end;
    end += (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    return offset;
  }
};

// Dispatch: the payload rows (the FP8 pair: values, then scales), topk_idx, topk_weights (when given) and the send
// offsets, scratch that the kernel writes and peers read ([T, R] int32).
struct DispatchStaging {
  int64_t payloads[2] = {}, topk_idx = 0, topk_weights = 0, send_offset = 0;
  int64_t end = 0;

  // payload_row_bytes[1] is 0 without a second payload.
  DispatchStaging(int64_t num_tokens, const int64_t (&payload_row_bytes)[2], int64_t num_topk, bool with_weights,
                  int64_t num_ranks) {
    StagingCursor cursor;
    payloads[0] = cursor.take(num_tokens * payload_row_bytes[0]);
    payloads[1] = cursor.take(num_tokens * payload_row_bytes[1]);
    topk_idx = cursor.take(num_tokens * num_topk * 4);
    topk_weights = cursor.take(with_weights ? num_tokens * num_topk * 4 : 0);
    send_offset = cursor.take(num_tokens * num_ranks * 4);
    end = cursor.end;
  }
};

// Cached dispatch: the new rows x [T, row_bytes].
struct CachedDispatchStaging {
  int64_t x = 0, end = 0;

  CachedDispatchStaging(int64_t num_tokens, int64_t row_bytes) {
    StagingCursor cursor;
    x = cursor.take(num_tokens * row_bytes);
    end = cursor.end;
  }
};

// Combine, one region of rows of y's row bytes. Push: the slots where the peers store their rows for this rank's
// tokens, (R - 1) * T of them. Pull: the copy of y's valid rows that peers read, `capacity` rows.
struct CombineStaging {
  int64_t rows = 0, end = 0;

  CombineStaging(int64_t num_tokens, int64_t row_bytes, int64_t num_ranks, int64_t capacity, bool push) {
    StagingCursor cursor;
    rows = cursor.take(push ? (num_ranks - 1) * num_tokens * row_bytes : capacity * row_bytes);
    end = cursor.end;
  }
};

// ---- low-latency mode (region layout described in low_latency_state.h) --------------------------------------

// Ranks of a low-latency group: the header's credits and the launches' per-rank tables have this many entries.
// Groups above kMaxIntranodeRanks are internode Buffers (NVSHMEM between nodes, stores inside them).
inline constexpr int kMaxLowLatencyRanks = 64;
static_assert(kMaxLowLatencyRanks >= kMaxIntranodeRanks, "an intranode group's LL ops fit");
// Top-k entries a token may have: the combine region keeps one row per (token, top-k entry).
inline constexpr int kLowLatencyMaxTopk = 16;
// Experts of a low-latency Buffer: expert ids travel as int16 in the row headers and the send's shared routing.
inline constexpr int kLowLatencyMaxExperts = 4096;
// Top-k entries of one dispatch (T * K): the send keeps the routing in shared memory as int16 (16 KB at this
// bound, e.g. T = 512 tokens with K = 16).
inline constexpr int64_t kLowLatencyMaxEntries = 8192;
// Alignment of the region's start (its offset in the workspace or symmetric allocation) and of its arrays.
inline constexpr int64_t kLowLatencyAlign = 256;
// The region's first bytes: LowLatencyHeader, call counters, credits and masks (2.5 KB of them at kMaxLowLatencyRanks).
inline constexpr int64_t kLowLatencyHeaderBytes = 4096;
// A masked peer's word in the LL header (LowLatencyHeader::masked): this bit | the dispatches started when masked.
inline constexpr unsigned long long kLowLatencyMaskedBit = 1ull << 32;

// The LL kernels, as indexed in the header's per-kernel fields and in the trace.
enum LowLatencyKernel : int { kDispatchSendKernel = 0, kDispatchRecvKernel, kCombineSendKernel, kCombineRecvKernel,
                              kLowLatencyKernels };

// The trace after the header (instrumented builds only, kInstrumented): a ring of kLowLatencyTraceCalls slots per
// kernel, each a LowLatencyTrace. A default build's region has no trace (0 bytes).
inline constexpr int kLowLatencyTraceCalls = 256;
inline constexpr int64_t kLowLatencyTraceSlotBytes = 88;  // 11 64-bit words
inline constexpr int64_t kLowLatencyTraceOffset = kLowLatencyHeaderBytes;
inline constexpr int64_t kLowLatencyTraceBytes =
    kInstrumented ? static_cast<int64_t>(kLowLatencyKernels) * kLowLatencyTraceCalls * kLowLatencyTraceSlotBytes : 0;

// What precedes each dispatched row: DispatchRowHeader, the token's top-k expert ids as int16, padded so that the
// payload after it stays 16-byte aligned.
inline constexpr int64_t kLowLatencyRowHeaderBytes = 48;

// LogFMT-10, the compressed combine's row format (jax_ep/logfmt.py defines it; csrc/logfmt.cuh codes it): blocks of
// kLogFmtBlock values, kLogFmtCodeBits per value, a block spanning at most kLogFmtMaxOctaves octaves. A row of H
// values is H / kLogFmtBlock blocks of kLogFmtCodeBytes code bytes, then one 4-byte (amax, amin) word per block: it
// fits the combine's BF16 slot.
inline constexpr int kLogFmtBlock = 128;
inline constexpr int kLogFmtCodeBits = 10;
inline constexpr int kLogFmtMaxOctaves = 32;
inline constexpr int64_t kLogFmtCodeBytes = kLogFmtBlock * kLogFmtCodeBits / 8;  // 160: 16-byte aligned blocks
inline constexpr int64_t kLogFmtBlockBytes = kLogFmtCodeBytes + 4;
static_assert(kLogFmtCodeBytes % 16 == 0 && kLogFmtBlockBytes < 2 * kLogFmtBlock, "LogFMT rows fit BF16 slots");

JAX_EP_HOST_DEVICE inline int64_t ll_align(int64_t bytes) {
  return (bytes + kLowLatencyAlign - 1) / kLowLatencyAlign * kLowLatencyAlign;
}

// Byte offsets inside the LL region for M tokens per rank, hidden H, R ranks and E experts (what each array holds:
// low_latency_state.h). The handlers check that a Buffer's region has `total` bytes; jax_ep sizes it with the same.
// `staged_combine`: the region ends with the combine send's staging rows (the NVSHMEM transport, whose puts read
// registered memory only); it changes `total`, no offset.
struct LowLatencyLayout {
  int64_t dispatch_slot_bytes = 0;  // row header + 2H (a BF16 row; FP8 values and scales are smaller)
  int64_t combine_slot_bytes = 0;   // 2H: a BF16 row
  int64_t trace = 0, dispatch_counters = 0, combine_counters = 0, dispatch_staging = 0;  // region offsets
  int64_t sets = 0, set_bytes = 0;
  int64_t dispatch_flags = 0, combine_flags = 0, dispatch_index = 0, dispatch_rows = 0, combine_rows = 0;  // in a set
  int64_t combine_staging = 0;  // region offset, after the sets: E * M combine slots
  int64_t total = 0;

  JAX_EP_HOST_DEVICE LowLatencyLayout(int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts,
                                      bool staged_combine = false) {
    dispatch_slot_bytes = kLowLatencyRowHeaderBytes + 2 * hidden;
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
    combine_staging = sets + 2 * ll_align(set_bytes);
    total = staged_combine ? combine_staging + num_experts * max_tokens * combine_slot_bytes : sets + 2 * set_bytes;
  }

  // Region offset of buffer set `set` (0 or 1).
  JAX_EP_HOST_DEVICE int64_t set_offset(uint32_t set) const { return sets + static_cast<int64_t>(set) * set_bytes; }
  // Region offset of the combine send's staging row for row `item` of y [L, R*M, H] (staged_combine only).
  JAX_EP_HOST_DEVICE int64_t staged_combine_row(int64_t item) const {
    return combine_staging + item * combine_slot_bytes;
  }
};

// ---- internode normal mode (region layouts described in internode_state.h) ---------------------------------

inline constexpr int kMaxInternodeRanks = 64;  // node masks and routing tables are sized for this
static_assert(kMaxInternodeRanks <= kMaxLowLatencyRanks, "an internode Buffer's LL ops fit");
inline constexpr int kMaxRanksPerNode = 8;     // one NVLink domain, as the intranode groups
inline constexpr int64_t kInternodeAlign = 256;
// The region's first bytes: InternodeHeader. The symmetric allocation holds it, then the Buffer's num_rdma_bytes.
inline constexpr int64_t kInternodeHeaderBytes = 4096;

JAX_EP_HOST_DEVICE inline int64_t internode_align(int64_t bytes) {
  return (bytes + kInternodeAlign - 1) / kInternodeAlign * kInternodeAlign;
}

JAX_EP_HOST_DEVICE inline int64_t internode_align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Dispatch (num_topk > 0) and cached dispatch (num_topk == 0) after the header, for N nodes of P ranks and T tokens
// per rank: the slots [N][T], then the meta part of each source node, then this rank's outgoing routing per node.
struct InternodeDispatchLayout {
  int64_t num_tokens = 0, ranks_per_node = 0;
  int64_t payload_bytes = 0, slot_bytes = 0, slots = 0;
  int64_t topk_bytes = 0, weights = 0;  // weights: offset of topk_weights inside the topk part
  int64_t routing_bytes = 0, meta_bytes = 0, meta = 0, outgoing = 0;
  int64_t total = 0;

  JAX_EP_HOST_DEVICE InternodeDispatchLayout(int64_t num_nodes, int64_t ranks_per_node_, int64_t num_tokens_,
                                             int64_t num_topk, int64_t payload_bytes_)
      : num_tokens(num_tokens_), ranks_per_node(ranks_per_node_), payload_bytes(payload_bytes_) {
    slot_bytes = internode_align16(payload_bytes);
    slots = 0;
    if (num_topk > 0) {
      weights = internode_align(num_tokens * num_topk * 4);
      topk_bytes = 2 * weights;
      routing_bytes = kInternodeAlign + internode_align(num_tokens * ranks_per_node * 4);
    }
    meta_bytes = topk_bytes + routing_bytes;
    meta = internode_align(num_nodes * num_tokens * slot_bytes);
    outgoing = meta + num_nodes * meta_bytes;
    total = outgoing + num_nodes * routing_bytes;
  }
  JAX_EP_HOST_DEVICE int64_t slot(int64_t source_node, int64_t token) const {
    return slots + (source_node * num_tokens + token) * slot_bytes;
  }
  JAX_EP_HOST_DEVICE int64_t topk_of(int64_t source_node) const { return meta + source_node * meta_bytes; }
  JAX_EP_HOST_DEVICE int64_t routing_of(int64_t source_node) const { return topk_of(source_node) + topk_bytes; }
  JAX_EP_HOST_DEVICE int64_t outgoing_of(int64_t node) const { return outgoing + node * routing_bytes; }
  // Inside a routing part: counts at 0, offsets from here.
  static constexpr int64_t kOffsets = kInternodeAlign;
};

// Combine after the header, for capacity C and rows of E elements: the staged y rows, then the float32 partials
// received and sent per (node, token).
struct InternodeCombineLayout {
  int64_t num_tokens = 0;
  int64_t staged_row_bytes = 0, staged = 0;
  int64_t partial_bytes = 0, received = 0, sending = 0;
  int64_t total = 0;

  JAX_EP_HOST_DEVICE InternodeCombineLayout(int64_t num_nodes, int64_t num_tokens_, int64_t capacity,
                                            int64_t row_elements, int64_t y_item_bytes)
      : num_tokens(num_tokens_) {
    staged_row_bytes = internode_align16(row_elements * y_item_bytes);
    partial_bytes = internode_align16(row_elements * 4);
    received = internode_align(capacity * staged_row_bytes);
    sending = received + internode_align(num_nodes * num_tokens * partial_bytes);
    total = sending + num_nodes * num_tokens * partial_bytes;
  }
  JAX_EP_HOST_DEVICE int64_t received_row(int64_t node, int64_t token) const {
    return received + (node * num_tokens + token) * partial_bytes;
  }
  JAX_EP_HOST_DEVICE int64_t sending_row(int64_t node, int64_t token) const {
    return sending + (node * num_tokens + token) * partial_bytes;
  }
};

}  // namespace jax_ep
