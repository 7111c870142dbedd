// Intranode expert-major kernels (docs/design.md, "Expert-major layout"): dispatch, cached dispatch and combine of
// the layout whose rows are (token, local expert) pairs grouped by local expert, each group in (source rank, source
// token) order. Each is one launch in the call protocol of intranode_call.cuh (arrival barrier, the op's work,
// release barrier), in both process models.
//
// Dispatch. A token crosses NVLink once to each rank that holds one of its experts and is written there into the
// row of every pair it has on that rank (local HBM stores).
//  1. Arrival: each rank publishes x (its payloads), topk_idx and topk_weights (copies in its workspace when the
//     group spans processes).
//  2. Counting. Each source's tokens are cut into G consecutive runs, G the grid's warps; warp w takes run w of
//     every source. It reads the runs' top-k rows from the sources and counts per (source, local expert) the
//     tokens naming that expert (once per token); the block's totals go to global scratch.
//  3. A grid barrier of this rank's blocks. Every block reads every block's totals and derives the group sizes
//     and offsets, and for each of its warps' runs the first row of each expert in it: the offset plus the pairs
//     of that expert in the runs before, in (source, token) order.
//  4. Placing. Each warp walks its runs again, 32 / K tokens a round (lane = top-k entry): warp matches find each
//     token's distinct experts (its pairs; a pair's weight is its entries' weights added in top-k order) and rank
//     the round's pairs of each expert; rows below the capacity are kept. The warp writes the handle's rows and
//     copies each token once from its source into every kept pair row. Warps start at different sources, so every
//     link carries traffic at once.
//  5. Rows that pad a group to expert_alignment are zeroed. Rows past the last group are not written (only their
//     4-byte weights and source indices): the work follows the pairs received, not the capacity.
//
// Cached dispatch: the same copies along a dispatch's pair_row, every item read once from its source. Combine's
// backward is a cached dispatch of the cotangent that scales each copy by its pair's weight and computes the
// weight's cotangent on the way.
//
// Combine: each rank computes the partial of every other rank's token it received from its pair rows of y, rounded
// to y's type, and stores it into the token's home rank (slots of (R - 1) * T rows there, one region per sender);
// after a barrier of the ranks each computes its own tokens' partials and adds them to the peers' in rank order.
// (A partial exists only where its pairs are, so it is pushed, whatever Config.combine says.) Pair rows are read
// through shared memory, many in flight per SM (see kMostCombineStages).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "api.h"
#include "call_frame.cuh"
#include "device_common.cuh"
#include "float_rows.cuh"
#include "intranode_call.cuh"
#include "intranode_state.h"
#include "normal_dispatch.cuh"

namespace jax_ep {
namespace {

static_assert(kExpertMajorMaxExperts <= kThreads, "the dispatch's group arithmetic takes a thread per expert");

__device__ __forceinline__ uint32_t lanes_below(int lane) { return (1u << lane) - 1u; }

// The top-k entries lanes [first_lane, first_lane + num_topk) of a round hold (one token's).
__device__ __forceinline__ uint32_t token_lanes(int first_lane, int num_topk) {
  return (num_topk >= 32 ? kFullMask : (1u << num_topk) - 1u) << first_lane;
}

// ---- fan-out copies ----------------------------------------------------------------------------------------------

// A warp copies row `src` of n units into row dst_row of `dst` (rows of row_units units) for every lane set in
// `lanes`, where each such lane holds its dst_row: the source is read once. kUnroll loads in flight per lane, as
// warp_copy_units. Every lane runs every round (the shuffles need the whole warp).
template <int kUnroll, typename Unit>
__device__ __forceinline__ void warp_fanout_units(Unit* dst, int64_t row_units, const Unit* src, int64_t n,
                                                  uint32_t lanes, int32_t dst_row, int lane) {
  const LoadNonCoherent load;
  for (int64_t round = 0; round < n; round += 32 * kUnroll) {
    const int64_t first = round + lane;
    Unit v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = first + 32 * u < n ? load(src + first + 32 * u) : Unit{};
    for (uint32_t todo = lanes; todo; todo &= todo - 1) {
      Unit* row = dst + static_cast<int64_t>(__shfl_sync(kFullMask, dst_row, __ffs(todo) - 1)) * row_units;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (first + 32 * u < n) row[first + 32 * u] = v[u];
    }
  }
}

// warp_fanout_units with the widest unit the row size and both bases allow. Every lane of the warp calls it.
__device__ __forceinline__ void warp_fanout_row(void* dst, const void* src, int64_t bytes, uint32_t lanes,
                                                int32_t dst_row, int lane) {
  switch (unit_bytes(reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes)) {
    case 16:
      return warp_fanout_units<kCopyUnroll>(static_cast<uint4*>(dst), bytes / 16, static_cast<const uint4*>(src),
                                            bytes / 16, lanes, dst_row, lane);
    case 8:
      return warp_fanout_units<kCopyUnroll>(static_cast<uint2*>(dst), bytes / 8, static_cast<const uint2*>(src),
                                            bytes / 8, lanes, dst_row, lane);
    case 4:
      return warp_fanout_units<kCopyUnroll>(static_cast<uint32_t*>(dst), bytes / 4, static_cast<const uint32_t*>(src),
                                            bytes / 4, lanes, dst_row, lane);
    case 2:
      return warp_fanout_units<kCopyUnroll>(static_cast<uint16_t*>(dst), bytes / 2, static_cast<const uint16_t*>(src),
                                            bytes / 2, lanes, dst_row, lane);
    default:
      return warp_fanout_units<kCopyUnroll>(static_cast<uint8_t*>(dst), bytes, static_cast<const uint8_t*>(src),
                                            bytes, lanes, dst_row, lane);
  }
}

// ---- dispatch ----------------------------------------------------------------------------------------------------

// Warp `warp` of G (the grid's) places the tokens [first, end) of every source.
struct Run {
  int64_t first, end;
};

__device__ __forceinline__ Run run_of(int64_t num_tokens, int64_t warp, int64_t num_warps) {
  const int64_t per = (num_tokens + num_warps - 1) / num_warps;
  const int64_t first = min(num_tokens, warp * per);
  return {first, min(num_tokens, first + per)};
}

// Rounds of a run taken at once (their top-k loads in flight together).
constexpr int kRoundsInFlight = 4;

// One round of a run as the lanes see it: lane = top-k entry k of the round's token `token` (32 / K tokens a
// round; lanes past them, and tokens past the run, hold no entry).
struct Entry {
  int64_t token;
  int k;
  bool valid;
  int32_t local;    // the entry's local expert on this rank, -1 when it names none here (or is invalid)
  uint32_t same;    // the lanes of the same token naming the same local expert (this lane alone when local < 0)
  bool first;       // the lowest of `same` with local >= 0: the lane that stands for the (token, expert) pair
};

// The entries of one round (every lane calls it): ids is the lane's entry of topk_idx (-1 if none).
__device__ __forceinline__ Entry entry_of(int64_t round_first, int64_t run_end, int num_topk, int32_t id, int me,
                                          int32_t experts_per_rank, int lane) {
  Entry e;
  const int tokens_per_round = 32 / num_topk;
  e.token = round_first + lane / num_topk;
  e.k = lane % num_topk;
  e.valid = lane < tokens_per_round * num_topk && e.token < run_end;
  const int32_t first_local = me * experts_per_rank;
  e.local = e.valid && id >= first_local && id < first_local + experts_per_rank ? id - first_local : -1;
  const int32_t key = e.local >= 0 ? (lane / num_topk) * experts_per_rank + e.local : -1 - lane;
  e.same = __match_any_sync(kFullMask, key);
  e.first = e.local >= 0 && __ffs(e.same) - 1 == lane;
  return e;
}

// Loads the lane's entry of rounds [round_first, round_first + kRoundsInFlight * 32 / K) of the run (-1 past it).
template <typename T>
__device__ __forceinline__ void load_round_entries(const T* src, int64_t round_first, int64_t run_end, int num_topk,
                                                   T fill, int lane, T (&out)[kRoundsInFlight]) {
  const int tokens_per_round = 32 / num_topk;
#pragma unroll
  for (int r = 0; r < kRoundsInFlight; ++r) {
    const int64_t token = round_first + r * tokens_per_round + lane / num_topk;
    const bool valid = lane < tokens_per_round * num_topk && token < run_end;
    out[r] = valid ? LoadNonCoherent{}(src + token * num_topk + lane % num_topk) : fill;
  }
}

struct DispatchShared {
  // Phase 2: per (warp, source * L + local expert) the pairs of the warp's run; then the row of the warp's next pair.
  int32_t next_row[kWarps][kExpertMajorMaxExperts];
  int32_t grid_total[kExpertMajorMaxExperts];  // per (source, local expert): the pairs of every block
  int32_t group_count[kExpertMajorMaxExperts], group_size[kExpertMajorMaxExperts];
  int32_t group_offset[kExpertMajorMaxExperts];
};

// Block 0: this rank's own routing (is_token_in_rank, invalid_ids), as the rank-major dispatch's.
__device__ __forceinline__ void route_own_tokens(const ExpertMajorDispatchArgs& a, int num_ranks) {
  __shared__ int32_t invalid;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  const int32_t experts_per_rank = static_cast<int32_t>(a.num_experts / num_ranks);
  int32_t own_invalid = 0;
  for (int64_t t = threadIdx.x; t < a.num_tokens; t += kThreads) {
    uint32_t ranks = 0;
    add_token_ranks(a.topk_idx, t, a.num_tokens, static_cast<int>(a.num_topk), static_cast<int32_t>(a.num_experts),
                    experts_per_rank, ranks, own_invalid);
    for (int r = 0; r < num_ranks; ++r) a.is_token_in_rank[t * num_ranks + r] = (ranks >> r) & 1u;
  }
  if (own_invalid) atomicAdd(&invalid, own_invalid);
  __syncthreads();
  if (threadIdx.x == 0) *a.invalid_ids = invalid;
}

__global__ void __launch_bounds__(kThreads, 1)
    expert_major_dispatch_kernel(const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorDispatchArgs a,
                                 const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  __shared__ DispatchShared sh;
  using BlockScan = cub::BlockScan<int32_t, kThreads>;
  using BlockReduce = cub::BlockReduce<int32_t, kThreads>;
  __shared__ union {
    typename BlockScan::TempStorage scan;
    typename BlockReduce::TempStorage reduce;
  } cub_storage;
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int num_topk = static_cast<int>(a.num_topk);
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity;
  const int32_t experts = static_cast<int32_t>(a.num_experts), experts_per_rank = experts / num_ranks;
  const int pair_columns = min(num_topk, static_cast<int>(experts_per_rank));
  const int64_t num_items = num_ranks * num_tokens;
  const int64_t grid_warp = global_warp(), grid_warps = num_global_warps();
  const Run run = run_of(num_tokens, grid_warp, grid_warps);
  const int tokens_per_round = 32 / num_topk;
  const int64_t batch_tokens = static_cast<int64_t>(kRoundsInFlight) * tokens_per_round;

  for (int i = threadIdx.x; i < kWarps * kExpertMajorMaxExperts; i += kThreads) (&sh.next_row[0][0])[i] = 0;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorDispatch, timeout_ns);

  // 2. Counting: the pairs of this warp's run of each source, per (source, local expert).
  for (int step = 0; step < num_ranks; ++step) {
    const int s = static_cast<int>((grid_warp + me + step) % num_ranks);
    const int32_t* src_topk = static_cast<const int32_t*>(ctx.views[s].pointers[2]);
    for (int64_t batch = run.first; batch < run.end; batch += batch_tokens) {
      int32_t ids[kRoundsInFlight];
      load_round_entries(src_topk, batch, run.end, num_topk, -1, lane, ids);
#pragma unroll
      for (int r = 0; r < kRoundsInFlight; ++r) {
        const Entry e = entry_of(batch + r * tokens_per_round, run.end, num_topk, ids[r], me, experts_per_rank, lane);
        if (e.first) atomicAdd(&sh.next_row[warp][s * experts_per_rank + e.local], 1);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < experts) {
    int32_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += sh.next_row[w][threadIdx.x];
    a.block_counts[static_cast<int64_t>(blockIdx.x) * experts + threadIdx.x] = total;
  }
  sync_grid(g, ctx.call, 1, IntranodeOp::kExpertMajorDispatch, timeout_ns);

  // 3. Groups, and the first row of each (warp, source, expert) run of this block.
  int32_t before_block = 0;  // thread q = s * L + j: expert j's pairs of source s in the blocks before this one
  if (threadIdx.x < experts) {
    int32_t total = 0;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
      const int32_t count = __ldcg(a.block_counts + static_cast<int64_t>(b) * experts + threadIdx.x);
      total += count;
      if (b < static_cast<int>(blockIdx.x)) before_block += count;
    }
    sh.grid_total[threadIdx.x] = total;
  }
  __syncthreads();
  int32_t size = 0;
  if (threadIdx.x < experts_per_rank) {
    int32_t count = 0;
    for (int s = 0; s < num_ranks; ++s) count += sh.grid_total[s * experts_per_rank + threadIdx.x];
    size = static_cast<int32_t>((count + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment);
    sh.group_count[threadIdx.x] = count;
    sh.group_size[threadIdx.x] = size;
  }
  int32_t offset;
  BlockScan(cub_storage.scan).ExclusiveSum(size, offset);
  if (threadIdx.x < experts_per_rank) sh.group_offset[threadIdx.x] = offset;
  __syncthreads();
  if (threadIdx.x < experts) {
    const int s = threadIdx.x / experts_per_rank, j = threadIdx.x % experts_per_rank;
    int32_t next = sh.group_offset[j] + before_block;
    for (int earlier = 0; earlier < s; ++earlier) next += sh.grid_total[earlier * experts_per_rank + j];
    for (int w = 0; w < kWarps; ++w) {
      const int32_t count = sh.next_row[w][threadIdx.x];
      sh.next_row[w][threadIdx.x] = next;
      next += count;
    }
  }
  __syncthreads();
  const int64_t groups_end = sh.group_offset[experts_per_rank - 1] + sh.group_size[experts_per_rank - 1];

  if (blockIdx.x == 0) {
    route_own_tokens(a, num_ranks);
    int32_t kept = 0, needed = 0, total = 0;
    for (int j = threadIdx.x; j < experts_per_rank; j += kThreads) {
      const int64_t first = sh.group_offset[j], count = sh.group_count[j];
      a.group_sizes[j] = sh.group_size[j];
      a.group_offsets[j] = static_cast<int32_t>(first);
      kept += static_cast<int32_t>(max(int64_t{0}, min(count, capacity - first)));
      total += static_cast<int32_t>(count);
      if (count > 0) needed = max(needed, static_cast<int32_t>(first + count));
    }
    kept = BlockReduce(cub_storage.reduce).Sum(kept);  // valid in thread 0
    __syncthreads();
    total = BlockReduce(cub_storage.reduce).Sum(total);
    __syncthreads();
    needed = BlockReduce(cub_storage.reduce).Reduce(needed, [](int32_t x, int32_t y) { return max(x, y); });
    if (threadIdx.x == 0) {
      *a.num_kept = kept;
      *a.num_dropped = total - kept;
      *a.rows_needed = needed;
      *a.rows_end = static_cast<int32_t>(min(capacity, groups_end));
    }
  }

  // 4. Placing: rows, handle and copies of this warp's runs, sources in the same order as the counting.
  for (int step = 0; step < num_ranks; ++step) {
    const int s = static_cast<int>((grid_warp + me + step) % num_ranks);
    const IntranodeView& src = ctx.views[s];
    const int32_t* src_topk = static_cast<const int32_t*>(src.pointers[2]);
    const float* src_weights = static_cast<const float*>(src.pointers[3]);
    int32_t* next_row = &sh.next_row[warp][s * experts_per_rank];
    for (int64_t batch = run.first; batch < run.end; batch += batch_tokens) {
      int32_t ids[kRoundsInFlight];
      float weights[kRoundsInFlight] = {};
      load_round_entries(src_topk, batch, run.end, num_topk, -1, lane, ids);
      if (src_weights) load_round_entries(src_weights, batch, run.end, num_topk, 0.f, lane, weights);
#pragma unroll 1
      for (int r = 0; r < kRoundsInFlight; ++r) {
        const int64_t round_first = batch + r * tokens_per_round;
        if (round_first >= run.end) break;
        const Entry e = entry_of(round_first, run.end, num_topk, ids[r], me, experts_per_rank, lane);
        const int first_lane = (lane / num_topk) * num_topk;
        // The round's pairs of each expert, in token order: this pair's rank among them.
        const uint32_t same_expert = __match_any_sync(kFullMask, e.first ? e.local : -1 - lane);
        const int32_t row = e.first ? next_row[e.local] + __popc(same_expert & lanes_below(lane)) : -1;
        __syncwarp();
        if (e.first && (same_expert & lanes_below(lane)) == 0) next_row[e.local] += __popc(same_expert);
        __syncwarp();
        const bool kept = e.first && row < capacity;
        // The pair's weight: its entries' weights added in top-k order, from 0.
        float pair_weight = 0.f;
        uint32_t pairs_before = 0;  // this pair's position among its token's pairs, in ascending local expert
        for (int k = 0; k < num_topk; ++k) {
          const int other = (first_lane + k) & 31;
          const float w = __shfl_sync(kFullMask, src_weights ? weights[r] : 0.f, other);
          const int32_t other_pair = __shfl_sync(kFullMask, e.first ? e.local : INT_MAX, other);
          if (e.first && ((e.same >> other) & 1u)) pair_weight = __fadd_rn(pair_weight, w);
          pairs_before += e.first && other_pair < e.local;
        }
        const uint32_t pair_lanes = __ballot_sync(kFullMask, e.first);
        const uint32_t kept_lanes = __ballot_sync(kFullMask, kept);
        const int64_t item = s * num_tokens + e.token;
        if (e.first) {
          a.pair_row[item * pair_columns + pairs_before] = kept ? row : static_cast<int32_t>(capacity);
          if (kept) {
            a.recv_src_index[row] = static_cast<int32_t>(item);
            if (a.recv_weights) a.recv_weights[row] = pair_weight;
          }
        }
        // Past the token's pairs (a position no pair takes, whichever lane stands for a pair).
        if (e.valid && e.k < pair_columns && e.k >= __popc(pair_lanes & token_lanes(first_lane, num_topk)))
          a.pair_row[item * pair_columns + e.k] = -1;
        const int pair_lane = __ffs(e.same) - 1;  // the lane of this entry's pair (itself when it names none here)
        const int32_t pair_row = __shfl_sync(kFullMask, kept ? row : static_cast<int32_t>(capacity), pair_lane);
        if (e.valid) a.topk_row[item * num_topk + e.k] = e.local >= 0 ? pair_row : static_cast<int32_t>(capacity);
        // Each token with a kept pair: its rows read once from the source, written into every kept pair row.
        for (int token = 0; token < tokens_per_round; ++token) {
          const uint32_t lanes = kept_lanes & token_lanes(token * num_topk, num_topk);
          if (!lanes) continue;
          const int64_t t = round_first + token;
          for (int p = 0; p < a.num_payloads; ++p)
            warp_fanout_row(a.recv_x[p], row_of(src.pointers[p], t, a.x_row_bytes[p]), a.x_row_bytes[p], lanes, row,
                            lane);
        }
      }
    }
  }

  // 5. Rows that pad each group up to the alignment: zero rows, weight 0, no source. Past the groups, only the
  // 4-byte fields.
  for (int64_t j = grid_warp; j < experts_per_rank; j += grid_warps) {
    const int64_t pad_end = min(capacity, static_cast<int64_t>(sh.group_offset[j]) + sh.group_size[j]);
    for (int64_t row = sh.group_offset[j] + sh.group_count[j]; row < pad_end; ++row) {
      for (int p = 0; p < a.num_payloads; ++p)
        warp_zero_row(row_of(a.recv_x[p], row, a.x_row_bytes[p]), a.x_row_bytes[p], lane);
      if (lane == 0) {
        a.recv_src_index[row] = static_cast<int32_t>(num_items);
        if (a.recv_weights) a.recv_weights[row] = 0.f;
      }
    }
  }
  for (int64_t row = min(capacity, groups_end) + blockIdx.x * kThreads + threadIdx.x; row < capacity;
       row += static_cast<int64_t>(gridDim.x) * kThreads) {
    a.recv_src_index[row] = static_cast<int32_t>(num_items);
    if (a.recv_weights) a.recv_weights[row] = 0.f;
  }
  finish_call(g, ctx, IntranodeOp::kExpertMajorDispatch, timeout_ns, [] {});
}

// ---- cached dispatch -----------------------------------------------------------------------------------------------

// Every item with a kept pair (its first pair row below the capacity), sources interleaved as in the rank-major
// dispatch's receive: visit(s, t, row, lanes), every lane of a warp, `row` lane q's pair row of the item (-1 past
// its pairs, C for a dropped one), `lanes` those holding a kept row.
template <typename Visit>
__device__ __forceinline__ void for_each_item_with_kept_pairs(const ExpertMajorCachedDispatchArgs& a, int num_ranks,
                                                              int me, int lane, Visit visit) {
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity, columns = a.num_pair_columns;
  for_each_received_pair(
      num_ranks, num_tokens, me,
      [&](int s, int64_t t) {
        const int32_t first = a.pair_row[(s * num_tokens + t) * columns];
        return first >= 0 && first < capacity ? first : -1;
      },
      [&](int s, int64_t t, int32_t) {
        const int32_t row = lane < columns ? a.pair_row[(s * num_tokens + t) * columns + lane] : -1;
        visit(s, t, row, __ballot_sync(kFullMask, row >= 0 && row < capacity));
      });
}

__global__ void __launch_bounds__(kThreads, 1) expert_major_cached_dispatch_kernel(
    const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorCachedDispatchArgs a,
    const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  const int num_ranks = g.num_ranks, lane = threadIdx.x % 32;
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns);
  for_each_item_with_kept_pairs(a, num_ranks, g.rank, lane, [&](int s, int64_t t, int32_t row, uint32_t lanes) {
    warp_fanout_row(a.recv_x, row_of(ctx.views[s].pointers[0], t, a.row_bytes), a.row_bytes, lanes, row, lane);
  });
  // Rows inside the groups that hold no pair (alignment padding).
  const int64_t rows_end = min(capacity, static_cast<int64_t>(*a.rows_end));
  for (int64_t row = global_warp(); row < rows_end; row += num_global_warps())
    if (a.recv_src_index[row] == num_ranks * num_tokens) warp_zero_row(row_of(a.recv_x, row, a.row_bytes), a.row_bytes, lane);
  finish_call(g, ctx, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns, [] {});
}

// ---- combine's backward ----------------------------------------------------------------------------------------
// The cached dispatch of the cotangent d_out along the pairs, each copy scaled by its pair's weight, and each pair's
// weight cotangent, the dot of d_out[token] and y[row], computed from the same registers: d_out crosses NVLink once
// per item and nothing is materialised in between (in XLA the copies, the products and the dots would each be a
// pass over all C rows).

// Loads in flight per lane: kBackwardUnroll vectors of d_out and as many of the pair's row of y.
constexpr int kBackwardUnroll = 5;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) expert_major_combine_backward_kernel(
    const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorCombineBackwardArgs a,
    const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  constexpr int kVec = 16 / sizeof(T);
  using Vec = Pack<T, kVec>;
  __shared__ CallContext ctx;
  const ExpertMajorCachedDispatchArgs& r = a.rows;
  const int num_ranks = g.num_ranks, lane = threadIdx.x % 32;
  const int64_t num_tokens = r.num_tokens, capacity = r.capacity;
  const int64_t vecs = r.row_bytes / 16;
  const bool weighted = a.weights != nullptr;
  const Vec* y = static_cast<const Vec*>(a.y);
  Vec* d_y = static_cast<Vec*>(r.recv_x);
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns);
  for_each_item_with_kept_pairs(r, num_ranks, g.rank, lane, [&](int s, int64_t t, int32_t row, uint32_t lanes) {
    const bool kept = (lanes >> lane) & 1u;
    const float weight = kept && weighted ? a.weights[row] : 1.f;
    float dot = 0.f;  // lane q: pair q's
    const Vec* src = reinterpret_cast<const Vec*>(row_of(ctx.views[s].pointers[0], t, r.row_bytes));
    for (int64_t round = 0; round < vecs; round += 32 * kBackwardUnroll) {  // every lane: the rounds shuffle
      const int64_t first = round + lane;
      Vec grad[kBackwardUnroll];
#pragma unroll
      for (int u = 0; u < kBackwardUnroll; ++u)
        if (first + 32 * u < vecs) grad[u] = LoadNonCoherent{}(src + first + 32 * u);
      for (uint32_t todo = lanes; todo; todo &= todo - 1) {
        const int q = __ffs(todo) - 1;
        const int64_t pair_row = __shfl_sync(kFullMask, row, q);
        const float pair_weight = __shfl_sync(kFullMask, weight, q);
        Vec value[kBackwardUnroll];
        if (weighted) {
#pragma unroll
          for (int u = 0; u < kBackwardUnroll; ++u)
            if (first + 32 * u < vecs) value[u] = LoadNonCoherent{}(y + pair_row * vecs + first + 32 * u);
        }
        float partial = 0.f;
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
          if (first + 32 * u >= vecs) break;
          Vec out = grad[u];
          if (weighted) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              const float x = to_float(grad[u].v[e]);
              out.v[e] = from_float<T>(__fmul_rn(pair_weight, x));
              partial += x * to_float(value[u].v[e]);
            }
          }
          d_y[pair_row * vecs + first + 32 * u] = out;
        }
        if (weighted) {
          const float total = warp_sum(partial);
          if (lane == q) dot += total;
        }
      }
    }
    if (kept && weighted) a.d_weights[row] = dot;
  });
  // Rows of no pair: d_y zero on the alignment padding inside the groups and on kExpertMajorGradZeroRows rows past
  // them (further rows are not written); d_weights zero on every such row (a word each).
  const int64_t rows_end = min(capacity, static_cast<int64_t>(*r.rows_end));
  const int64_t zeroed_end = min(capacity, rows_end + kExpertMajorGradZeroRows);
  for (int64_t row = global_warp(); row < capacity; row += num_global_warps()) {
    if (row < rows_end && r.recv_src_index[row] != num_ranks * num_tokens) continue;
    if (row < zeroed_end) warp_zero_row(d_y + row * vecs, r.row_bytes, lane);
    if (weighted && lane == 0) a.d_weights[row] = 0.f;
  }
  finish_call(g, ctx, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns, [] {});
}

// ---- combine -------------------------------------------------------------------------------------------------------
// Two passes over jobs, each a row this rank writes, made chunk by chunk from source rows. Pass 1, the partials of
// every item (home rank s, token t) this rank received: its sources the item's kept pair rows; the partial (weights
// * rows summed in float32 from 0, in pair order, rounded to y's type) is stored into s's slots, or for this rank's
// own tokens into out[t] (y's type or float32: either holds it exactly). Own and peers' items interleave, so that
// the local work runs while the stores to the peers cross NVLink. Then every rank tells every rank that its partials
// are out and waits for theirs (exchange_partials). Pass 2, this rank's tokens: a job is a token t, its sources the
// partials of the other ranks that hold t, from the slots; out[t] = the holders' partials (this rank's from out[t])
// added in rank order from 0 + bias, cast. Warps take jobs of home ranks interleaved so that consecutive partials go
// to different ranks.

// Jobs of a pass, per warp: index = its global warp, then every num_global_warps()-th.
struct CombineJob {
  int64_t index;
  bool valid;     // index < the pass's jobs
  int home;       // s
  int64_t token;  // t
  int32_t pair;   // pass 1, lane q < P: pair_row entry q of item (s, t) (a kept row, C, or -1); else -1
  bool held;      // pass 2, lane r < R: rank r received t (holds a partial of it)
};

template <bool kOwnTokens>
__device__ __forceinline__ CombineJob load_job(const ExpertMajorCombineArgs& a, int num_ranks, int me, int64_t index,
                                               int lane) {
  CombineJob j;
  j.index = index;
  const int64_t num_tokens = a.num_tokens;
  if constexpr (kOwnTokens) {
    j.valid = index < num_tokens;
    j.home = me;
    j.token = index;
  } else {
    j.valid = index < num_ranks * num_tokens;
    j.home = static_cast<int>((me + 1 + index % num_ranks) % num_ranks);
    j.token = index / num_ranks;
  }
  const int64_t item = j.home * num_tokens + j.token;
  j.pair = !kOwnTokens && j.valid && lane < a.num_pair_columns ? a.pair_row[item * a.num_pair_columns + lane] : -1;
  j.held = kOwnTokens && j.valid && lane < num_ranks && a.is_token_in_rank[j.token * num_ranks + lane];
  return j;
}

// What a job reads and writes (every lane calls it: ballots).
struct JobShape {
  int pairs;       // pass 1: its kept pairs here (kept pairs come first in pair_row)
  uint32_t peers;  // pass 2: the other ranks that hold a partial of the token
  bool me_holds;   // pass 2: this rank received the token
  bool writes;     // pass 1: this rank received the item; pass 2: a valid token
  __device__ int sources() const { return pairs + __popc(peers); }
};

template <bool kOwnTokens>
__device__ __forceinline__ JobShape shape_of(const CombineJob& j, const ExpertMajorCombineArgs& a, int me) {
  JobShape shape;
  shape.pairs = __popc(__ballot_sync(kFullMask, j.pair >= 0 && j.pair < a.capacity));
  const uint32_t holders = __ballot_sync(kFullMask, j.held);
  shape.peers = holders & ~(1u << me);
  shape.me_holds = (holders >> me) & 1u;
  shape.writes = kOwnTokens ? j.valid : j.valid && __shfl_sync(kFullMask, j.pair, 0) != -1;
  return shape;
}

// The rank of the n-th set bit of `ranks`.
__device__ __forceinline__ int nth_rank(uint32_t ranks, int n) {
  for (; n > 0; --n) ranks &= ranks - 1;
  return __ffs(ranks) - 1;
}

// Source rows are read through shared memory by cp.async: each warp keeps kStages stages of one source row's chunk
// (kChunkVecs 16-byte vectors per lane, 1 KB a warp) in flight. kMostCombineStages = 10 (160 KB of rows per SM, 180
// KB with the weights) is about what one SM needs to read at its full rate (one row per pair: the rank-major combine
// reads a quarter of these bytes at EP2 and DeepSeek's shape); registers would hold a tenth of that beside the
// sums. (On an H200 an SM reads consecutive chunks this way at ~93 GB/s, pair rows scattered over y at ~37 GB/s
// whatever the depth: docs/perf-log.md.) GPUs that give a block less shared memory (A100: 163 KB, sm_86/89: 99 KB)
// take kFewestCombineStages. Each lane reads back only what it copied itself (the chunk's vectors and the pair's
// weight), so the warp needs no barrier.
constexpr int kChunkVecs = 2;
constexpr int kChunkUnits = 32 * kChunkVecs;  // 16-byte units of a chunk
constexpr int kMostCombineStages = 10, kFewestCombineStages = 4;
template <int kStages>
struct CombineStages {  // a warp's
  uint4 rows[kStages][kChunkUnits];
  float weights[kStages][32];
};
template <int kStages>
constexpr int kCombineSmemBytes = kWarps * static_cast<int>(sizeof(CombineStages<kStages>));

__device__ __forceinline__ void cp_async(void* smem, const void* global, bool copy) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n" ::"r"(address),
      "l"(global), "r"(static_cast<int>(copy))
      : "memory");
}
__device__ __forceinline__ void cp_async_word(float* smem, const float* global) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(address), "l"(global) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// What a pass reads and where it writes, per rank.
struct CombineRows {
  const char* y;            // y's rows
  const char* own_slots;    // the partials the peers stored here
  int64_t row_bytes, vecs;  // of y's rows and of the partials (y's type)
  int64_t chunks;           // of kChunkUnits vectors
};

// The warp's stream of copies, in the order the pass consumes them: per job with sources, per chunk, per source.
// issue() copies the next one into a stage and commits a group of cp.async (empty past the end), so that a lane
// always has kStages groups committed ahead of the one it consumes. It keeps the next job's pair_row entries
// loaded one job ahead, so that starting a job does not wait for memory.
template <bool kOwnTokens, int kStages>
struct SourceStream {
  const ExpertMajorCombineArgs& a;
  const CombineRows& rows;
  int num_ranks, me, lane;
  CombineJob job, ahead;
  JobShape shape;
  int64_t chunk = 0;
  int source = 0;
  bool done = false;

  __device__ SourceStream(const ExpertMajorCombineArgs& args, const CombineRows& r, int ranks, int rank, int lane_)
      : a(args), rows(r), num_ranks(ranks), me(rank), lane(lane_) {
    job = load_job<kOwnTokens>(a, num_ranks, me, global_warp(), lane);
    ahead = load_job<kOwnTokens>(a, num_ranks, me, job.index + num_global_warps(), lane);
    skip_jobs_without_sources();
  }

  __device__ void skip_jobs_without_sources() {
    for (;;) {
      if (!job.valid) {
        done = true;
        return;
      }
      shape = shape_of<kOwnTokens>(job, a, me);
      if (shape.sources() > 0) return;
      job = ahead;
      ahead = load_job<kOwnTokens>(a, num_ranks, me, job.index + num_global_warps(), lane);
    }
  }

  __device__ void issue(CombineStages<kStages>& stages, int stage) {
    if (!done) {
      const char* src;
      if (source < shape.pairs) {
        const int32_t row = __shfl_sync(kFullMask, job.pair, source);
        src = rows.y + row * rows.row_bytes;
        if (a.weights) cp_async_word(&stages.weights[stage][lane], a.weights + row);
      } else {  // a peer's partial (pass 2)
        const int peer = nth_rank(shape.peers, source - shape.pairs);
        src = rows.own_slots + (slot_region(peer, me) * a.num_tokens + job.token) * rows.row_bytes;
      }
#pragma unroll
      for (int u = 0; u < kChunkVecs; ++u) {
        const int64_t vec = chunk * kChunkUnits + u * 32 + lane;
        cp_async(&stages.rows[stage][u * 32 + lane], src + vec * 16, vec < rows.vecs);
      }
      if (++source == shape.sources()) {
        source = 0;
        if (++chunk == rows.chunks) {
          chunk = 0;
          job = ahead;
          ahead = load_job<kOwnTokens>(a, num_ranks, me, job.index + num_global_warps(), lane);
          skip_jobs_without_sources();
        }
      }
    }
    cp_async_commit();
  }
};

// sum += weight * value (each product rounded on its own; unweighted: the value), element by element.
template <typename In, int kVec>
__device__ __forceinline__ void add_pair(float (&sum)[kVec], const Pack<In, kVec>& pack, float weight, bool weighted) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float x = to_float(pack.v[e]);
    sum[e] = __fadd_rn(sum[e], weighted ? __fmul_rn(weight, x) : x);
  }
}

template <typename In>
__device__ __forceinline__ float rounded_to(float v) {
  return to_float(from_float<In>(v));
}

// Vector `vec` (kVec elements) of a partial, rounded to In (the type it crosses NVLink in), stored into row as Out
// (In or float32: exact either way).
template <typename In, typename Out, int kVec>
__device__ __forceinline__ void store_partial(const float (&partial)[kVec], Out* row, int64_t vec) {
  Pack<Out, kVec> pack;
#pragma unroll
  for (int e = 0; e < kVec; ++e) pack.v[e] = from_float<Out>(rounded_to<In>(partial[e]));
  reinterpret_cast<Pack<Out, kVec>*>(row)[vec] = pack;
}

// One pass over rows of whole 16-byte vectors (kVec elements of In each).
template <bool kOwnTokens, typename In, typename Bias, typename Out, int kVec, int kStages>
__device__ void combine_pass_staged(const IntranodeRank& g, const CallContext& ctx, const ExpertMajorCombineArgs& a,
                                    const CombineRows& rows, CombineStages<kStages>& stages) {
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32;
  const bool weighted = a.weights != nullptr;
  SourceStream<kOwnTokens, kStages> stream(a, rows, num_ranks, me, lane);
#pragma unroll 1
  for (int k = 0; k < kStages; ++k) stream.issue(stages, k);
  int stage = 0;  // where the next copy consumed is
  // The next stage's data, read back by this lane (the copies it issued), after which the stage takes the stream's
  // next copy.
  auto consume = [&](Pack<In, kVec>(&packs)[kChunkVecs], float& weight) {
    cp_async_wait<kStages - 1>();
#pragma unroll
    for (int u = 0; u < kChunkVecs; ++u) {
      const uint4 bits = stages.rows[stage][u * 32 + lane];
      memcpy(&packs[u], &bits, 16);
    }
    weight = weighted ? stages.weights[stage][lane] : 1.f;
    stream.issue(stages, stage);  // into the stage just read: its copies land after these reads
    stage = stage + 1 == kStages ? 0 : stage + 1;
  };
  CombineJob job = load_job<kOwnTokens>(a, num_ranks, me, global_warp(), lane);
  CombineJob ahead = load_job<kOwnTokens>(a, num_ranks, me, job.index + num_global_warps(), lane);
  for (; job.valid; job = ahead, ahead = load_job<kOwnTokens>(a, num_ranks, me, job.index + num_global_warps(), lane)) {
    const JobShape shape = shape_of<kOwnTokens>(job, a, me);
    if (!shape.writes) continue;
    for (int64_t chunk = 0; chunk < rows.chunks; ++chunk) {
      if constexpr (!kOwnTokens) {  // the item's partial: into its home rank's slot for this rank, or out[t]
        float partial[kChunkVecs][kVec] = {};
        for (int q = 0; q < shape.pairs; ++q) {
          Pack<In, kVec> packs[kChunkVecs];
          float weight;
          consume(packs, weight);
#pragma unroll
          for (int u = 0; u < kChunkVecs; ++u) add_pair<In, kVec>(partial[u], packs[u], weight, weighted);
        }
#pragma unroll
        for (int u = 0; u < kChunkVecs; ++u) {
          const int64_t vec = chunk * kChunkUnits + u * 32 + lane;
          if (vec >= rows.vecs) break;
          if (job.home == me) {
            store_partial<In, Out, kVec>(partial[u], static_cast<Out*>(a.out) + job.token * a.row_elements, vec);
          } else {
            In* slot = static_cast<In*>(const_cast<void*>(ctx.views[job.home].pointers[0])) +
                       (slot_region(me, job.home) * a.num_tokens + job.token) * a.row_elements;
            store_partial<In, In, kVec>(partial[u], slot, vec);
          }
        }
      } else {  // the holders' partials in rank order
        Pack<Out, kVec> mine[kChunkVecs];  // this rank's partial, from pass 1
        if (shape.me_holds) {
#pragma unroll
          for (int u = 0; u < kChunkVecs; ++u) {
            const int64_t vec = chunk * kChunkUnits + u * 32 + lane;
            if (vec < rows.vecs)
              mine[u] = reinterpret_cast<const Pack<Out, kVec>*>(static_cast<const Out*>(a.out) +
                                                                  job.token * a.row_elements)[vec];
          }
        }
        float acc[kChunkVecs][kVec] = {};
        for (int r = 0; r < num_ranks; ++r) {
          if (r == me) {
            if (!shape.me_holds) continue;
#pragma unroll
            for (int u = 0; u < kChunkVecs; ++u)
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[u][e] += to_float(mine[u].v[e]);
          } else if ((shape.peers >> r) & 1u) {
            Pack<In, kVec> packs[kChunkVecs];
            float unused;
            consume(packs, unused);
#pragma unroll
            for (int u = 0; u < kChunkVecs; ++u)
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[u][e] += to_float(packs[u].v[e]);
          }
        }
#pragma unroll
        for (int u = 0; u < kChunkVecs; ++u) {
          const int64_t vec = chunk * kChunkUnits + u * 32 + lane;
          if (vec >= rows.vecs) break;
          add_bias_and_store(acc[u], static_cast<const Bias*>(a.bias), static_cast<Out*>(a.out), a.row_elements,
                             job.token, vec);
        }
      }
    }
  }
  cp_async_wait<0>();
}

// One pass over rows that are not whole 16-byte vectors (a hidden size no multiple of 16 bytes): the same sums, an
// element per lane at a time, read directly.
template <bool kOwnTokens, typename In, typename Bias, typename Out>
__device__ void combine_pass_by_element(const IntranodeRank& g, const CallContext& ctx,
                                        const ExpertMajorCombineArgs& a) {
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32;
  const In* y = static_cast<const In*>(a.y);
  const In* own_slots = static_cast<const In*>(ctx.views[me].pointers[0]);
  for (int64_t index = global_warp();; index += num_global_warps()) {
    const CombineJob job = load_job<kOwnTokens>(a, num_ranks, me, index, lane);
    if (!job.valid) break;
    const JobShape shape = shape_of<kOwnTokens>(job, a, me);
    if (!shape.writes) continue;
    for (int64_t first = 0; first < a.row_elements; first += 32) {  // every lane: the rounds shuffle
      const int64_t e = first + lane;
      if constexpr (!kOwnTokens) {
        float partial[1] = {0.f};
        for (int q = 0; q < shape.pairs; ++q) {
          const int64_t row = __shfl_sync(kFullMask, job.pair, q);
          if (e < a.row_elements)
            add_pair<In, 1>(partial, Pack<In, 1>{{LoadNonCoherent{}(y + row * a.row_elements + e)}},
                            a.weights ? a.weights[row] : 1.f, a.weights);
        }
        if (e >= a.row_elements) continue;
        if (job.home == me) {
          store_partial<In, Out, 1>(partial, static_cast<Out*>(a.out) + job.token * a.row_elements, e);
        } else {
          In* slot = static_cast<In*>(const_cast<void*>(ctx.views[job.home].pointers[0])) +
                     (slot_region(me, job.home) * a.num_tokens + job.token) * a.row_elements;
          store_partial<In, In, 1>(partial, slot, e);
        }
      } else {
        if (e >= a.row_elements) continue;
        float acc[1] = {0.f};
        for (int r = 0; r < num_ranks; ++r) {
          if (r == me && shape.me_holds) acc[0] += to_float(static_cast<const Out*>(a.out)[job.token * a.row_elements + e]);
          if (r != me && ((shape.peers >> r) & 1u))
            acc[0] += to_float(LoadL2{}(own_slots + (slot_region(r, me) * a.num_tokens + job.token) * a.row_elements + e));
        }
        add_bias_and_store(acc, static_cast<const Bias*>(a.bias), static_cast<Out*>(a.out), a.row_elements,
                           job.token, e);
      }
    }
  }
}

// Between the passes (every block): this rank's partials are all stored (grid barrier), then a flag to every rank
// that they are, then every rank's flag.
__device__ __forceinline__ void exchange_partials(const IntranodeRank& g, const CallContext& ctx, int64_t timeout_ns) {
  __threadfence_system();  // this thread's stores into peers' slots, before the flag that block 0 raises for all
  sync_grid(g, ctx.call, 1, IntranodeOp::kExpertMajorCombine, timeout_ns);
  if (threadIdx.x < g.num_ranks) {
    const int peer = threadIdx.x;
    if (blockIdx.x == 0) {
      __threadfence_system();
      store_release_sys(&g.states[peer]->partials_stored[g.rank], ctx.call);
    }
    wait_for_flag(g, &g.states[g.rank]->partials_stored[peer], ctx.call, IntranodeOp::kExpertMajorCombine,
                  IntranodeWait::kCombineRows, peer, timeout_ns);
  }
  __syncthreads();
}

// kStages > 0: rows of whole 16-byte vectors, read through kCombineSmemBytes<kStages> of dynamic shared memory;
// 0: rows read an element at a time.
template <typename In, typename Bias, typename Out, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    expert_major_combine_kernel(const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorCombineArgs a,
                                const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  extern __shared__ uint4 combine_smem[];  // CombineStages<kStages> per warp
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorCombine, timeout_ns);
  if constexpr (kStages > 0) {
    constexpr int kVec = 16 / sizeof(In);
    CombineRows rows;
    rows.y = static_cast<const char*>(a.y);
    rows.own_slots = static_cast<const char*>(ctx.views[g.rank].pointers[0]);
    rows.row_bytes = a.row_elements * static_cast<int64_t>(sizeof(In));
    rows.vecs = rows.row_bytes / 16;
    rows.chunks = (rows.vecs + kChunkUnits - 1) / kChunkUnits;
    CombineStages<kStages>& stages = reinterpret_cast<CombineStages<kStages>*>(combine_smem)[threadIdx.x / 32];
    combine_pass_staged<false, In, Bias, Out, kVec, kStages>(g, ctx, a, rows, stages);
    exchange_partials(g, ctx, timeout_ns);
    combine_pass_staged<true, In, Bias, Out, kVec, kStages>(g, ctx, a, rows, stages);
  } else {
    combine_pass_by_element<false, In, Bias, Out>(g, ctx, a);
    exchange_partials(g, ctx, timeout_ns);
    combine_pass_by_element<true, In, Bias, Out>(g, ctx, a);
  }
  finish_call(g, ctx, IntranodeOp::kExpertMajorCombine, timeout_ns, [] {});
}

// ---- launches ------------------------------------------------------------------------------------------------------

template <typename In, typename Bias, typename Out>
cudaError_t launch_combine(const IntranodeCall& call, const ExpertMajorCombineArgs& args) {
  const int64_t row_bytes = args.row_elements * static_cast<int64_t>(sizeof(In));
  const CombineStaging staging(args.num_tokens, row_bytes, call.group.num_ranks, args.capacity, /*push=*/true);
  StagePlanBuilder builder(call.group);
  builder.publish_scratch(args.slots, staging.rows);  // view: where the peers store their partials for this rank
  StagePlan plan;
  if (!builder.finish(&plan, staging.end)) return cudaErrorMemoryAllocation;
  if (row_bytes % 16 != 0) {  // XLA's buffers are 16-byte aligned: so is every row where the size is
    expert_major_combine_kernel<In, Bias, Out, 0>
        <<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
    return cudaGetLastError();
  }
  auto launch = [&](auto* kernel, int smem_bytes) {
    // Above the default 48 KB of dynamic shared memory. The attribute belongs to the current device's copy of the
    // kernel (one process may drive several GPUs): set at every launch.
    const cudaError_t attribute = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (attribute != cudaSuccess) return attribute;
    kernel<<<grid_size(call), kThreads, smem_bytes, call.stream>>>(call.group, args, plan, call.timeout_ns);
    return cudaGetLastError();
  };
  int device = 0, block_smem = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&block_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  constexpr int kStaticSmemRoom = 1024;  // the kernel's own shared variables (the call context)
  if (kCombineSmemBytes<kMostCombineStages> + kStaticSmemRoom <= block_smem)
    return launch(expert_major_combine_kernel<In, Bias, Out, kMostCombineStages>,
                  kCombineSmemBytes<kMostCombineStages>);
  return launch(expert_major_combine_kernel<In, Bias, Out, kFewestCombineStages>,
                kCombineSmemBytes<kFewestCombineStages>);
}

}  // namespace

cudaError_t intranode_expert_major_dispatch(const IntranodeCall& call, const ExpertMajorDispatchArgs& args) {
  const int ranks = call.group.num_ranks;
  if (args.num_topk < 1 || args.num_topk > kNormalMaxTopk || args.num_payloads < 1 || args.num_payloads > 2 ||
      args.num_experts < ranks || args.num_experts % ranks != 0 || args.num_experts > kExpertMajorMaxExperts ||
      args.expert_alignment < 1 || args.block_count_rows < grid_size(call))
    return cudaErrorInvalidValue;
  // The inputs peers read are the rank-major dispatch's (its send-offset region stays unused here).
  StagePlanBuilder builder(call.group);
  const DispatchStaging staging = publish_dispatch_inputs(builder, args, ranks);
  StagePlan plan;
  if (!builder.finish(&plan, staging.end)) return cudaErrorMemoryAllocation;
  expert_major_dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan,
                                                                              call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t intranode_expert_major_cached_dispatch(const IntranodeCall& call,
                                                   const ExpertMajorCachedDispatchArgs& args) {
  if (args.num_pair_columns < 1 || args.num_pair_columns > kNormalMaxTopk) return cudaErrorInvalidValue;
  StagePlan plan;
  if (!plan_cached_dispatch(call.group, args.x, args.num_tokens, args.row_bytes, &plan)) return cudaErrorMemoryAllocation;
  expert_major_cached_dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan,
                                                                                     call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t intranode_expert_major_combine_backward(const IntranodeCall& call,
                                                    const ExpertMajorCombineBackwardArgs& args) {
  const ExpertMajorCachedDispatchArgs& rows = args.rows;
  if (rows.num_pair_columns < 1 || rows.num_pair_columns > kNormalMaxTopk || rows.row_bytes % 16 != 0 ||
      (args.weights != nullptr) != (args.d_weights != nullptr))
    return cudaErrorInvalidValue;
  StagePlan plan;
  if (!plan_cached_dispatch(call.group, rows.x, rows.num_tokens, rows.row_bytes, &plan)) return cudaErrorMemoryAllocation;
  auto launch = [&](auto type) {
    expert_major_combine_backward_kernel<typename decltype(type)::type>
        <<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
    return cudaGetLastError();
  };
  switch (args.type) {
    case FloatType::kF32: return launch(TypeTag<float>{});
    case FloatType::kBF16: return launch(TypeTag<__nv_bfloat16>{});
    case FloatType::kF16: return launch(TypeTag<__half>{});
  }
  return cudaErrorInvalidValue;
}

cudaError_t intranode_expert_major_combine(const IntranodeCall& call, const ExpertMajorCombineArgs& args) {
  const bool ok = args.num_pair_columns >= 1 && args.num_pair_columns <= kNormalMaxTopk &&
                  (call.group.staged || call.group.num_ranks == 1 || args.slots);
  if (!ok) return cudaErrorInvalidValue;
  return with_combine_types(args, [&](auto in, auto bias, auto out) {
    return launch_combine<typename decltype(in)::type, typename decltype(bias)::type, typename decltype(out)::type>(
        call, args);
  });
}

}  // namespace jax_ep
