// Low-latency combine: the send half (each expert's rows stored back into their tokens' home ranks, BF16 or
// LogFMT) and the receive half (each token's rows weighted and summed). The protocol is in
// low_latency_protocol.cuh.
#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>
#include <thrust/binary_search.h>
#include <thrust/execution_policy.h>

#include <algorithm>
#include <type_traits>

#include "api.h"
#include "logfmt.cuh"
#include "low_latency_protocol.cuh"

namespace jax_ep {
namespace {

// Work items (token, part): a token's channels split into `parts` ranges of `chunks_per_part` whole chunks,
// as few chunks per part as would give every item a warp of its own at once (the rounding up of parts can still
// leave a few items more than warps for some T, e.g. T=212 at 132 SMs; bounding parts by warps / T would not),
// so that small batches still spread over every SM. A warp taking a second item runs it after its
// first, which ends the kernel an item later, which is why parts are sized for the tokens' items to fit the warps
// (docs/perf-log.md has the measurements at DeepEP's decode shape).
struct TokenParts {
  int64_t parts, chunks_per_part;
  __host__ __device__ TokenParts(int64_t num_tokens, int64_t hidden, int64_t warps) {
    const int64_t chunks = (hidden + kChunk - 1) / kChunk;
    chunks_per_part = std::min(chunks, std::max<int64_t>(1, (chunks * num_tokens + warps - 1) / warps));
    parts = (chunks + chunks_per_part - 1) / chunks_per_part;
  }
};

// ---- combine ----------------------------------------------------------------------------------------------

// The send spreads the rows to return evenly over every warp of the grid, whatever the pairs (local expert j,
// source rank s) they belong to: rows are numbered pair by pair (p = j * R + s, each pair's rows in order), each
// row is cut into kCombinePieces pieces, and warp w takes pieces w, w + warps, ... (one each at decode sizes),
// putting each into its part of the source's slot (token, top-k slot). A pair's counter counts its pieces once
// written; the piece that completes it raises the pair's flag on the source (combine_piece_sent), so that the
// source can sum a token as soon as the flags of its experts are in; pairs without rows raise theirs at once.
// Handle values outside their ranges send nothing.
constexpr int kCombineSendThreads = 128;
constexpr int kCombineSendWarps = kCombineSendThreads / 32;
// Half a row per warp: twice the warps, each with half the bytes to move, hide more of NVLink's latency than a row
// per warp, while thirds or quarters spend more on the per-piece counters than they hide (docs/perf-log.md).
constexpr int kCombinePieces = 2;

// Rows of pair p to return, from the handle's layout_range, clamped so that no value reads or writes outside
// the outputs (a dispatch handle's values always are inside).
struct PairRows {
  int64_t begin, count;
  __device__ PairRows(const int32_t* layout_range, int64_t p, int64_t max_tokens, int64_t rows_per_expert) {
    begin = min(static_cast<int64_t>(max(layout_range[2 * p], 0)), rows_per_expert);
    count = min(static_cast<int64_t>(max(layout_range[2 * p + 1], 0)), min(max_tokens, rows_per_expert - begin));
  }
};

// Pair p's flag on its source rank: the call tag, raised once p's rows are written (release: after every write
// the raising thread observed).
template <typename Transport>
__device__ __forceinline__ void raise_combine_flag(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                                   uint32_t call, int64_t p) {
  const int num_ranks = c.group.num_ranks;
  const int64_t experts_per_rank = c.num_experts / num_ranks;
  if (peer_masked(c, static_cast<int>(p % num_ranks))) return;
  Transport::signal(c, static_cast<int>(p % num_ranks),
                    layout.set_offset(call & 1) + layout.combine_flags +
                        (c.group.rank * experts_per_rank + p / num_ranks) * static_cast<int64_t>(sizeof(uint64_t)),
                    call);
  trace_flag_now(c, layout, kCombineSendKernel, call);
}

// One thread, after a piece of a row of pair p is written and published (a barrier after its warp's puts):
// counts it; the addition that completes p's `pieces` raises p's flag and clears the counter for the next call.
template <typename Transport>
__device__ __forceinline__ void combine_piece_sent(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                                   uint32_t call, int64_t p, int64_t pieces) {
  unsigned* counter = reinterpret_cast<unsigned*>(c.region + layout.combine_counters) + p;
  __threadfence();  // release: the piece's stores, which this thread saw finished, before the addition
  if (atomicAdd(counter, 1u) + 1 != pieces) return;
  __threadfence();  // acquire: the other pieces of p before the flag
  atomicExch(counter, 0u);  // every piece of p has counted; the next call's kernel starts after this one
  raise_combine_flag<Transport>(c, layout, call, p);
}

// LogFMT: each piece is a run of whole 128-value blocks, LogFMT-encoded by the warp straight into the source's
// slot where stores reach it, else into the row's staging row, whose codes and scale words are then put.
template <typename Transport, LowLatencyCompression kCompression>
__global__ void __launch_bounds__(kCombineSendThreads) combine_send_kernel(
    const __grid_constant__ LowLatencyCall c, const __grid_constant__ LowLatencyCombineSendArgs a) {
  extern __shared__ int64_t first_row[];  // [pairs + 1]: rows of the pairs before p, in pair order
  constexpr bool kLogFmt = kCompression == LowLatencyCompression::kLogFmt;
  __shared__ alignas(16) uint32_t logfmt_words[kCombineSendWarps][kLogFmtCodeWords];  // LogFMT: a block's codes
  enum { kCredits, kPuts, kFlags };  // phases, as kLowLatencyPhaseNames names them
  clock_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, max_tokens = c.num_max_tokens, rows_per_expert = num_ranks * max_tokens;
  const int64_t pairs = c.num_experts;  // (local expert, source rank) pairs: L * R
  const LowLatencyLayout layout(max_tokens, hidden, num_ranks, c.num_experts);
  LowLatencyHeader* own = own_header(c);
  const uint32_t call = next_call(&own->combine_calls), set = call & 1;
  // The rows are numbered while the credits come: every thread loads the row counts of its run of consecutive
  // pairs (all loads in flight at once), the block scans the runs' totals, and each thread numbers its run.
  const int64_t run = (pairs + kCombineSendThreads - 1) / kCombineSendThreads, run_begin = threadIdx.x * run;
  const int64_t run_end = min(run_begin + run, pairs);
  int64_t run_rows = 0;
  for (int64_t p = run_begin; p < run_end; ++p) {
    first_row[p + 1] = PairRows(a.layout_range, p, max_tokens, rows_per_expert).count;
    run_rows += first_row[p + 1];
  }
  if (threadIdx.x == 0) first_row[0] = 0;
  for (int peer = threadIdx.x; peer < num_ranks; peer += kCombineSendThreads)
    wait_for_credit(c, LowLatencyOp::kCombineSend, call, /*dispatch=*/false, peer);
  __shared__ typename cub::BlockScan<int64_t, kCombineSendThreads>::TempStorage scan;
  int64_t before;
  cub::BlockScan<int64_t, kCombineSendThreads>(scan).ExclusiveSum(run_rows, before);
  for (int64_t p = run_begin; p < run_end; ++p) first_row[p + 1] = before += first_row[p + 1];
  __syncthreads();  // no row is written before every credit is in; the numbering is done
  clock_mark(kCredits);

  const char* y = static_cast<const char*>(a.y);
  const int64_t rows = first_row[pairs];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kCombineSendWarps;
  const int64_t piece_bytes = (layout.combine_slot_bytes / kCombinePieces + 15) / 16 * 16;
  const int64_t blocks = hidden / kLogFmtBlock, piece_blocks = (blocks + kCombinePieces - 1) / kCombinePieces;
  const int64_t piece_size = kLogFmt ? piece_blocks : piece_bytes;  // blocks, or bytes
  const int64_t row_size = kLogFmt ? blocks : static_cast<int64_t>(layout.combine_slot_bytes);
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kCombineSendWarps + warp; unit < rows * kCombinePieces;
       unit += warps) {
    const int64_t row = unit / kCombinePieces, begin = unit % kCombinePieces * piece_size;
    const int64_t end = min(begin + piece_size, row_size);
    // The pair p holding row: first_row[p] <= row < first_row[p + 1] (the last such p: pairs without rows
    // share their first_row with the next pair).
    const int64_t p = thrust::upper_bound(thrust::seq, first_row + 1, first_row + pairs + 1, row) - (first_row + 1);
    const PairRows pair(a.layout_range, p, max_tokens, rows_per_expert);
    const int64_t item = (p / num_ranks) * rows_per_expert + pair.begin + (row - first_row[p]);
    const int32_t t = a.src_token_index[item], k = a.src_topk_index[item];
    const int source = static_cast<int>(p % num_ranks);
    const bool masked = __shfl_sync(kFullMask, peer_masked(c, source), 0);  // one answer for the warp's collectives
    // (Else not from a dispatch handle, an empty last piece, or a source this rank masks.)
    if (t >= 0 && t < max_tokens && k >= 0 && k < kLowLatencyMaxTopk && begin < end && !masked) {
      const int64_t slot = layout.set_offset(set) + layout.combine_rows +
                           (static_cast<int64_t>(t) * kLowLatencyMaxTopk + k) * layout.combine_slot_bytes;
      // A source that stores do not reach gets the piece from its staging row (puts read symmetric memory only).
      const bool stores = Transport::stores_reach(c, source);
      char* staged = c.region + layout.staged_combine_row(item);
      if constexpr (kLogFmt) {
        char* dst = stores ? Transport::address(c, source, slot) : staged;
        const __nv_bfloat16* src = reinterpret_cast<const __nv_bfloat16*>(y) + item * hidden;
        for (int64_t b = begin; b < end; ++b)
          logfmt_encode_block(src + b * kLogFmtBlock, dst + b * kLogFmtCodeBytes,
                              dst + blocks * kLogFmtCodeBytes + b * 4, logfmt_words[warp], lane);
        if (!stores) {  // the piece's codes, then its scale words
          __syncwarp();
          Transport::put_warp(c, source, slot + begin * kLogFmtCodeBytes, staged + begin * kLogFmtCodeBytes,
                              (end - begin) * kLogFmtCodeBytes, lane);
          Transport::put_warp(c, source, slot + blocks * kLogFmtCodeBytes + begin * 4,
                              staged + blocks * kLogFmtCodeBytes + begin * 4, (end - begin) * 4, lane);
        }
      } else {
        const char* src = y + item * layout.combine_slot_bytes + begin;
        if (!stores) {
          warp_copy_row<kCopyUnroll>(staged + begin, src, end - begin, lane, LoadL2{});
          __syncwarp();
          src = staged + begin;
        }
        Transport::put_warp(c, source, slot + begin, src, end - begin, lane);
      }
      Transport::finish_puts(lane);
    }
    clock_mark(kPuts);
    if (lane == 0) combine_piece_sent<Transport>(c, layout, call, p, pair.count * kCombinePieces);
    __syncwarp();
    clock_mark(kFlags);
  }
  // Pairs without rows: nothing to wait for.
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kCombineSendThreads + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * kCombineSendThreads)
    if (first_row[p + 1] == first_row[p]) raise_combine_flag<Transport>(c, layout, call, p);
  clock_mark(kFlags);

  if (finish_block(c, layout, kCombineSendKernel, call, 1) && threadIdx.x == 0) {
    own->combine_calls = call;
    *a.token = call;
  }
}

// Pause between two polls of a combine flag: the receive's thousands of waiting warps (every part of every
// token) otherwise hammer the flag words at the L2 that the peers' rows are arriving through (any pause from 100
// to 2000 ns measured alike, docs/perf-log.md).
constexpr unsigned kCombineFlagPollNs = 100;

// The receive: a warp takes (token, part), waits for the flags of the token's experts (a lane per distinct
// expert), then sums, for k in order, w[t, k] * row of (t, first entry of expert k) in float32 (one rounding per
// product and per sum, as the reference), and writes BF16. Its trace is per (token, part): lane 0 times the
// wait (reading the routing included) and the sum, the block adds them up in shared memory.
constexpr int kCombineRecvBlocksPerSm = 2;  // blocks resident per SM (launch bounds and grid)
// Row loads a lane issues before summing: kEntries (top-k entries the kernel handles: 8, or kLowLatencyMaxTopk)
// for each of kRowLoadsInFlight / kEntries chunks, what the register budget of two blocks per SM holds. ptxas
// follows each predicated load with a predicated move that waits for it, so the SASS keeps at most 2 in flight;
// the K <= 8 kernel is still kept beside the 16-entry one for its fewer shuffles and tests per chunk.
// (Unconditional loads from in-range addresses would keep 15 in flight; docs/perf-log.md has the figures and why
// that version was not kept.)
constexpr int kRowLoadsInFlight = kLowLatencyMaxTopk;

// LogFMT: the rows arrive LogFMT-encoded (combine_send_kernel) and are decoded as they are loaded.
template <typename Transport, int kEntries, LowLatencyCompression kCompression>
__global__ void __launch_bounds__(kThreads, kCombineRecvBlocksPerSm)
    combine_recv_kernel(const __grid_constant__ LowLatencyCall c, const __grid_constant__ LowLatencyCombineRecvArgs a,
                        TokenParts split) {
  enum { kWaiting, kSumming };  // phases, as kLowLatencyPhaseNames names them
  constexpr bool kLogFmt = kCompression == LowLatencyCompression::kLogFmt;
  constexpr int kChunksInFlight = kRowLoadsInFlight / kEntries;
  __shared__ unsigned long long item_ns[2], items, first_ready, last_ready;
  clock_begin();
  const int lane = threadIdx.x % 32;
  const int64_t hidden = c.hidden, num_topk = a.num_topk;
  const int32_t num_experts = static_cast<int32_t>(c.num_experts);
  const int32_t experts_per_rank = static_cast<int32_t>(num_experts / c.group.num_ranks);
  const LowLatencyLayout layout(c.num_max_tokens, hidden, c.group.num_ranks, num_experts);
  const uint32_t call = *a.token, set = call & 1;
  const char* base = c.region + layout.set_offset(set);
  if (kInstrumented) {
    if (threadIdx.x == 0) {
      item_ns[kWaiting] = item_ns[kSumming] = items = last_ready = 0;
      first_ready = ~0ull;
    }
    __syncthreads();
  }

  const uint64_t* flags = reinterpret_cast<const uint64_t*>(base + layout.combine_flags);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  for (int64_t item = global_warp(); item < a.num_tokens * split.parts; item += num_global_warps()) {
    const uint64_t begin = kInstrumented && lane == 0 ? now_ns() : 0;
    const int64_t t = item / split.parts, part = item % split.parts;
    int32_t expert = -1, slot = lane;
    float weight = 0.f;
    if (lane < num_topk) {
      expert = a.topk_idx[t * num_topk + lane];
      if (expert < 0 || expert >= num_experts) expert = -1;
      weight = a.topk_weights[t * num_topk + lane];
    }
    for (int k = 0; k < num_topk; ++k) {  // slot: the first entry naming this lane's expert
      const int32_t other = __shfl_sync(kFullMask, expert, k);
      if (k < lane && other == expert && slot == lane) slot = k;
    }
    bool returned = true;
    if (expert >= 0 && slot == lane) {
      uint64_t seen = 0;
      returned = wait_until(c, LowLatencyOp::kCombineRecv, LowLatencyWait::kFlag, expert / experts_per_rank, call,
                            [&] { return load_acquire_sys(flags + expert); },
                            [&](uint64_t v) { return static_cast<uint32_t>(v) == call; }, seen, kCombineFlagPollNs);
    }
    __syncwarp();  // the lanes' acquires order every lane's row loads below
    // An expert whose rank this rank masks returned nothing: its entries add nothing.
    const unsigned not_returned = __ballot_sync(kFullMask, !returned);
    if (expert >= 0 && (not_returned >> slot & 1u)) expert = -1;
    uint64_t ready = 0;
    if (kInstrumented && lane == 0) {
      ready = now_ns();
      atomicAdd(&item_ns[kWaiting], static_cast<unsigned long long>(ready - begin));
      atomicMin(&first_ready, static_cast<unsigned long long>(ready));
      atomicMax(&last_ready, static_cast<unsigned long long>(ready));
    }
    const int64_t chunk_end = min((part + 1) * split.chunks_per_part * kChunk, hidden);
    for (int64_t first = part * split.chunks_per_part * kChunk; first < chunk_end; first += kChunksInFlight * kChunk) {
      // Every entry's load of kChunksInFlight chunks is issued before the first is used (see kRowLoadsInFlight
      // for how many the SASS keeps in flight); the sum still runs in k order.
      uint4 rows[kChunksInFlight][kEntries];
#pragma unroll
      for (int u = 0; u < kChunksInFlight; ++u) {
        const int64_t ch = first + u * kChunk + lane * kLaneChannels;
#pragma unroll
        for (int k = 0; k < kEntries; ++k) {
          const int32_t e = __shfl_sync(kFullMask, expert, k);
          const int32_t s = __shfl_sync(kFullMask, slot, k);
          if (k < num_topk && e >= 0 && ch < chunk_end) {
            const char* row = base + layout.combine_rows + (t * kLowLatencyMaxTopk + s) * layout.combine_slot_bytes;
            if constexpr (kLogFmt)
              rows[u][k] = logfmt_load8(row, hidden / kLogFmtBlock, ch);
            else
              rows[u][k] = __ldcg(reinterpret_cast<const uint4*>(row + ch * 2));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kChunksInFlight; ++u) {
        const int64_t ch = first + u * kChunk + lane * kLaneChannels;
        float acc[kLaneChannels];
#pragma unroll
        for (int i = 0; i < kLaneChannels; ++i) acc[i] = 0.f;
#pragma unroll
        for (int k = 0; k < kEntries; ++k) {
          const int32_t e = __shfl_sync(kFullMask, expert, k);
          const float w = __shfl_sync(kFullMask, weight, k);
          if (k >= num_topk || e < 0 || ch >= chunk_end) continue;
          float v[kLaneChannels];
          if constexpr (kLogFmt)
            logfmt_decode8(rows[u][k], ch, v);
          else
            bf16x8_to_float(rows[u][k], v);
#pragma unroll
          for (int i = 0; i < kLaneChannels; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
        }
        if (ch >= chunk_end) continue;
        __nv_bfloat16 packed[kLaneChannels];
#pragma unroll
        for (int i = 0; i < kLaneChannels; ++i) packed[i] = __float2bfloat16_rn(acc[i]);
        *reinterpret_cast<uint4*>(out + t * hidden + ch) = *reinterpret_cast<const uint4*>(packed);
      }
    }
    if (kInstrumented && lane == 0) {
      atomicAdd(&item_ns[kSumming], static_cast<unsigned long long>(now_ns() - ready));
      atomicAdd(&items, 1ull);
    }
  }

  if (kInstrumented) {
    __syncthreads();  // the block's items are timed
    if (threadIdx.x == 0) {
      block_clock().phase_ns[kWaiting] = item_ns[kWaiting];
      block_clock().phase_ns[kSumming] = item_ns[kSumming];
      if (items) {
        LowLatencyTrace* trace = trace_slot(c, layout, kCombineRecvKernel, call);
        trace_flag(trace, first_ready);
        trace_flag(trace, last_ready);
      }
    }
  }
  if (finish_block(c, layout, kCombineRecvKernel, call, items)) give_credits<Transport>(c, call, /*dispatch=*/false);
}

// ---- launches ----------------------------------------------------------------------------------------------

// The combine receive's grid: kCombineRecvBlocksPerSm blocks per SM at most, so that enough row loads are in
// flight (the sum is bound by their latency).
int blocks_for_warps(const LowLatencyCall& c, int64_t warps) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(int64_t{c.group.device_sms} * kCombineRecvBlocksPerSm, (warps + kWarps - 1) / kWarps)));
}

// Items (token, part) enough for one wave of warps over the device.
TokenParts token_parts(const LowLatencyCall& c, int64_t num_tokens) {
  return TokenParts(num_tokens, c.hidden, int64_t{c.group.device_sms} * kCombineRecvBlocksPerSm * kWarps);
}

// Runs launch(std::integral_constant<LowLatencyCompression, c>) for the call's compression c, then returns the
// launch's error (an unknown member: invalid value).
template <typename Launch>
cudaError_t with_compression(LowLatencyCompression compression, Launch launch) {
  switch (compression) {
    case LowLatencyCompression::kNone:
      launch(std::integral_constant<LowLatencyCompression, LowLatencyCompression::kNone>{});
      return cudaGetLastError();
    case LowLatencyCompression::kLogFmt:
      launch(std::integral_constant<LowLatencyCompression, LowLatencyCompression::kLogFmt>{});
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t low_latency_combine_send(const LowLatencyCall& call, const LowLatencyCombineSendArgs& args) {
  // Warps for about a piece each at decode sizes (a rank returns T * K rows on average, T <= M, so T * K *
  // kCombinePieces pieces): E * kCombinePieces blocks of 4 warps, at least 2 * kCombinePieces per SM. Shared
  // memory: the row numbering, 8 bytes per pair (32 KB at most).
  const int blocks = static_cast<int>(std::max<int64_t>(call.num_experts, 2 * call.group.device_sms)) * kCombinePieces;
  const size_t shared = sizeof(int64_t) * static_cast<size_t>(call.num_experts + 1);
  return with_transport(call, [&](auto transport) {
    using Transport = decltype(transport);
    return with_compression(args.compression, [&](auto compression) {
      combine_send_kernel<Transport, decltype(compression)::value>
          <<<blocks, kCombineSendThreads, shared, call.stream>>>(call, args);
    });
  });
}

cudaError_t low_latency_combine_recv(const LowLatencyCall& call, const LowLatencyCombineRecvArgs& args) {
  if (args.num_topk > kLowLatencyMaxTopk || args.num_tokens > call.num_max_tokens) return cudaErrorInvalidValue;
  const TokenParts split = token_parts(call, args.num_tokens);
  return with_transport(call, [&](auto transport) {
    using Transport = decltype(transport);
    const int blocks = blocks_for_warps(call, args.num_tokens * split.parts);
    return with_compression(args.compression, [&](auto compression) {
      constexpr LowLatencyCompression kCompression = decltype(compression)::value;
      if (args.num_topk <= 8)  // two chunks per round of loads
        combine_recv_kernel<Transport, 8, kCompression><<<blocks, kThreads, 0, call.stream>>>(call, args, split);
      else
        combine_recv_kernel<Transport, kLowLatencyMaxTopk, kCompression><<<blocks, kThreads, 0, call.stream>>>(
            call, args, split);
    });
  });
}

}  // namespace jax_ep
