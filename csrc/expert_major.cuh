// What the intranode (expert_major.cu) and internode (internode_expert_major.cu) expert-major kernels share, apart
// from their call protocols: the dispatch's counting and placing of pairs (steps 2 to 5 in expert_major.cu's
// notes), the fan-out copies of the cached dispatch, the combine's backward, and the partials' sums. Each
// takes where the sources' rows are as a function, read with a Load policy: the intranode kernels read the peers'
// inputs, which no one writes during the call, non-coherently; the internode kernels read relayed rows that
// arrived during the call, through L2.
#pragma once
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "api.h"
#include "call_frame.cuh"
#include "device_common.cuh"
#include "float_rows.cuh"
#include "normal_dispatch.cuh"

namespace jax_ep {
namespace {

static_assert(kExpertMajorMaxExperts <= kThreads, "the dispatch's group arithmetic takes a thread per expert");

__device__ __forceinline__ uint32_t lanes_below(int lane) { return (1u << lane) - 1u; }

// A block's jobs in a pass of `count` jobs: block b takes the b-th contiguous share of ceil(count / blocks) jobs,
// and hands them to its warps one at a time, in order, as each asks for its next (a shared-memory counter). Jobs of
// nearby indices touch nearby rows (pair rows lie in (source rank, token) order within each group), so the warps of
// an SM work near one another: on two H200s a block share measured 6-9 % faster for the combine and its backward
// than each warp taking every num_global_warps()-th job of the whole pass. Handing the share out as warps free up,
// rather than every kWarps-th job to each warp, keeps the block's warps busy to its end: a job is 0 to K pair rows,
// and a warp given every kWarps-th job of its share can get half again the mean work. 3-9 % faster on two H200s
// (docs/perf-log.md).
struct BlockJobs {
  int64_t count;  // jobs in the pass: the index past the last
  int64_t end;    // past this block's share
  unsigned long long* next_job;  // shared memory: the share's next job not yet handed out
  // Every thread of the block (barriers): `counter` is the block's shared word for this pass.
  __device__ BlockJobs(int64_t jobs, unsigned long long* counter) : count(jobs), next_job(counter) {
    const int64_t share = (jobs + gridDim.x - 1) / gridDim.x;
    end = min(jobs, (blockIdx.x + 1) * share);
    __syncthreads();  // every warp is past its uses of the counter before
    if (threadIdx.x == 0) *next_job = static_cast<unsigned long long>(min(jobs, blockIdx.x * share));
    __syncthreads();
  }
  // The calling warp's next job (count past the share). Every lane of the warp calls it.
  __device__ int64_t take(int lane) const {
    unsigned long long job = 0;
    if (lane == 0) job = atomicAdd(next_job, 1ull);
    job = __shfl_sync(kFullMask, job, 0);
    return static_cast<int64_t>(job) < end ? static_cast<int64_t>(job) : count;
  }
};

// The top-k entries lanes [first_lane, first_lane + num_topk) of a round hold (one token's).
__device__ __forceinline__ uint32_t token_lanes(int first_lane, int num_topk) {
  return (num_topk >= 32 ? kFullMask : (1u << num_topk) - 1u) << first_lane;
}

// ---- fan-out copies ----------------------------------------------------------------------------------------------

// A warp copies row `src` of n units (read with Load) into row dst_row of `dst` (rows of row_units units) for every lane set in
// `lanes`, where each such lane holds its dst_row: the source is read once. kUnroll loads in flight per lane, as
// warp_copy_units. Every lane runs every round (the shuffles need the whole warp).
template <int kUnroll, typename Load, typename Unit>
__device__ __forceinline__ void warp_fanout_units(Unit* dst, int64_t row_units, const Unit* src, int64_t n,
                                                  uint32_t lanes, int32_t dst_row, int lane) {
  const Load load;
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
template <typename Load>
__device__ __forceinline__ void warp_fanout_row(void* dst, const void* src, int64_t bytes, uint32_t lanes,
                                                int32_t dst_row, int lane) {
  switch (unit_bytes(reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes)) {
    case 16:
      return warp_fanout_units<kCopyUnroll, Load>(static_cast<uint4*>(dst), bytes / 16, static_cast<const uint4*>(src),
                                            bytes / 16, lanes, dst_row, lane);
    case 8:
      return warp_fanout_units<kCopyUnroll, Load>(static_cast<uint2*>(dst), bytes / 8, static_cast<const uint2*>(src),
                                            bytes / 8, lanes, dst_row, lane);
    case 4:
      return warp_fanout_units<kCopyUnroll, Load>(static_cast<uint32_t*>(dst), bytes / 4, static_cast<const uint32_t*>(src),
                                            bytes / 4, lanes, dst_row, lane);
    case 2:
      return warp_fanout_units<kCopyUnroll, Load>(static_cast<uint16_t*>(dst), bytes / 2, static_cast<const uint16_t*>(src),
                                            bytes / 2, lanes, dst_row, lane);
    default:
      return warp_fanout_units<kCopyUnroll, Load>(static_cast<uint8_t*>(dst), bytes, static_cast<const uint8_t*>(src),
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
template <typename Load, typename T>
__device__ __forceinline__ void load_round_entries(const T* src, int64_t round_first, int64_t run_end, int num_topk,
                                                   T fill, int lane, T (&out)[kRoundsInFlight]) {
  const int tokens_per_round = 32 / num_topk;
#pragma unroll
  for (int r = 0; r < kRoundsInFlight; ++r) {
    const int64_t token = round_first + r * tokens_per_round + lane / num_topk;
    const bool valid = lane < tokens_per_round * num_topk && token < run_end;
    out[r] = valid ? Load{}(src + token * num_topk + lane % num_topk) : fill;
  }
}

struct DispatchShared {
  // Phase 2: per (warp, source * L + local expert) the pairs of the warp's run; then the row of the warp's next pair.
  int32_t next_row[kWarps][kExpertMajorMaxExperts];
  int32_t grid_total[kExpertMajorMaxExperts];  // per (source, local expert): the pairs of every block
  int32_t group_count[kExpertMajorMaxExperts], group_size[kExpertMajorMaxExperts];
  int32_t group_offset[kExpertMajorMaxExperts];
};

// Steps 2 to 5 of the dispatch (see above) on rank `me` of num_ranks, once every source's inputs are readable:
// `sources` gives source s's topk_idx rows (topk(s)), topk_weights rows (weights(s), null without weights) and the
// row of payload p of its token t (row(s, p, t)), read with Load; grid_sync() is a barrier of this rank's blocks;
// block 0 runs block0_work() before it writes the group results.
template <typename Load, typename Sources, typename GridSync, typename Block0Work>
__device__ void place_pairs(const ExpertMajorDispatchArgs& a, int num_ranks, int me, const Sources& sources,
                            GridSync grid_sync, Block0Work block0_work) {
  __shared__ DispatchShared sh;
  using BlockScan = cub::BlockScan<int32_t, kThreads>;
  using BlockReduce = cub::BlockReduce<int32_t, kThreads>;
  __shared__ union {
    typename BlockScan::TempStorage scan;
    typename BlockReduce::TempStorage reduce;
  } cub_storage;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
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
  __syncthreads();

  // 2. Counting: the pairs of this warp's run of each source, per (source, local expert).
  for (int step = 0; step < num_ranks; ++step) {
    const int s = static_cast<int>((grid_warp + me + step) % num_ranks);
    const int32_t* src_topk = sources.topk(s);
    for (int64_t batch = run.first; batch < run.end; batch += batch_tokens) {
      int32_t ids[kRoundsInFlight];
      load_round_entries<Load>(src_topk, batch, run.end, num_topk, -1, lane, ids);
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
  grid_sync();

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
    block0_work();
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
    const int32_t* src_topk = sources.topk(s);
    const float* src_weights = sources.weights(s);
    int32_t* next_row = &sh.next_row[warp][s * experts_per_rank];
    for (int64_t batch = run.first; batch < run.end; batch += batch_tokens) {
      int32_t ids[kRoundsInFlight];
      float weights[kRoundsInFlight] = {};
      load_round_entries<Load>(src_topk, batch, run.end, num_topk, -1, lane, ids);
      if (src_weights) load_round_entries<Load>(src_weights, batch, run.end, num_topk, 0.f, lane, weights);
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
            warp_fanout_row<Load>(a.recv_x[p], sources.row(s, p, t), a.x_row_bytes[p], lanes, row, lane);
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
}

// ---- cached dispatch and the combine's backward -----------------------------------------------------------------

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

// The cached dispatch on rank `me` once the sources' rows are readable: each item with a kept pair read once
// (source_row(s, t), with Load) into its kept pair rows; the rows inside the groups that hold no pair (alignment
// padding) zeroed.
template <typename Load, typename SourceRow>
__device__ void fan_out_cached_rows(const ExpertMajorCachedDispatchArgs& a, int num_ranks, int me,
                                    SourceRow source_row) {
  const int lane = threadIdx.x % 32;
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity;
  for_each_item_with_kept_pairs(a, num_ranks, me, lane, [&](int s, int64_t t, int32_t row, uint32_t lanes) {
    warp_fanout_row<Load>(a.recv_x, source_row(s, t), a.row_bytes, lanes, row, lane);
  });
  const int64_t rows_end = min(capacity, static_cast<int64_t>(*a.rows_end));
  for (int64_t row = global_warp(); row < rows_end; row += num_global_warps())
    if (a.recv_src_index[row] == num_ranks * num_tokens) warp_zero_row(row_of(a.recv_x, row, a.row_bytes), a.row_bytes, lane);
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

// An item (s, t) this rank received, a job of the backward: job i is source rank (me + i) % R, token i / R.
struct GradientItem {
  int64_t index;
  bool valid;     // index < R * T
  int source;     // s
  int64_t token;  // t
  int32_t row;    // lane q < the pair columns: pair_row entry q of the item (a kept row, C or -1); else -1
  float weight;   // lane q holding a kept row: its weight (1 without weights)
  uint32_t kept;  // the lanes holding a kept row
};

__device__ __forceinline__ GradientItem load_item(const ExpertMajorCombineBackwardArgs& a, int num_ranks, int me,
                                                  int64_t index, int lane) {
  const ExpertMajorCachedDispatchArgs& r = a.rows;
  GradientItem item;
  item.index = index;
  item.valid = index < num_ranks * r.num_tokens;
  item.source = static_cast<int>((me + index % num_ranks) % num_ranks);
  item.token = index / num_ranks;
  const int64_t entry = (item.source * r.num_tokens + item.token) * r.num_pair_columns + lane;
  item.row = item.valid && lane < r.num_pair_columns ? r.pair_row[entry] : -1;
  const bool kept = item.row >= 0 && item.row < r.capacity;
  item.kept = __ballot_sync(kFullMask, kept);
  item.weight = kept && a.weights ? a.weights[item.row] : 1.f;
  return item;
}

// The combine's backward on rank `me` once the cotangent rows are readable: source_row(s, t) is item (s, t)'s
// row of d_out, read with Load. Warps take the items of the block's BlockJobs; the next item's pair rows and
// weights load while one is copied. d_y's rows are stored evict-first (__stcs): nothing reads them again in this
// kernel.
template <typename T, typename Load, typename SourceRow>
__device__ void write_combine_gradients(const ExpertMajorCombineBackwardArgs& a, int num_ranks, int me,
                                        SourceRow source_row) {
  constexpr int kVec = 16 / sizeof(T);
  using Vec = Pack<T, kVec>;
  const ExpertMajorCachedDispatchArgs& r = a.rows;
  const int lane = threadIdx.x % 32;
  const int64_t num_tokens = r.num_tokens, capacity = r.capacity;
  const int64_t vecs = r.row_bytes / 16;
  const bool weighted = a.weights != nullptr;
  const Vec* y = static_cast<const Vec*>(a.y);
  Vec* d_y = static_cast<Vec*>(r.recv_x);
  __shared__ unsigned long long next_job;
  const BlockJobs jobs(num_ranks * num_tokens, &next_job);
  for (GradientItem item = load_item(a, num_ranks, me, jobs.take(lane), lane); item.valid;) {
    const GradientItem next = load_item(a, num_ranks, me, jobs.take(lane), lane);
    if (item.kept) {
      float dot = 0.f;  // lane q: pair q's
      const Vec* src = reinterpret_cast<const Vec*>(source_row(item.source, item.token));
      for (int64_t round = 0; round < vecs; round += 32 * kBackwardUnroll) {  // every lane: the rounds shuffle
        const int64_t first = round + lane;
        Vec grad[kBackwardUnroll];
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u)
          if (first + 32 * u < vecs) grad[u] = Load{}(src + first + 32 * u);
        for (uint32_t todo = item.kept; todo; todo &= todo - 1) {
          const int q = __ffs(todo) - 1;
          const int64_t pair_row = __shfl_sync(kFullMask, item.row, q);
          const float pair_weight = __shfl_sync(kFullMask, item.weight, q);
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
            uint4 bits;
            memcpy(&bits, &out, 16);
            __stcs(reinterpret_cast<uint4*>(d_y + pair_row * vecs + first + 32 * u), bits);
          }
          if (weighted) {
            const float total = warp_sum(partial);
            if (lane == q) dot += total;
          }
        }
      }
      if (weighted && ((item.kept >> lane) & 1u)) a.d_weights[item.row] = dot;
    }
    item = next;
  }
  // Rows of no pair: d_y zero on the alignment padding inside the groups and on kExpertMajorGradZeroRows rows past
  // them (further rows are not written); d_weights zero on every such row (a word each). A warp looks at 32 rows at
  // once.
  const int64_t rows_end = min(capacity, static_cast<int64_t>(*r.rows_end));
  const int64_t zeroed_end = min(capacity, rows_end + kExpertMajorGradZeroRows);
  for (int64_t base = static_cast<int64_t>(global_warp()) * 32; base < capacity;
       base += static_cast<int64_t>(num_global_warps()) * 32) {
    const int64_t row = base + lane;
    const bool no_pair = row < capacity && (row >= rows_end || r.recv_src_index[row] == num_ranks * num_tokens);
    if (weighted && no_pair) a.d_weights[row] = 0.f;
    for (uint32_t todo = __ballot_sync(kFullMask, no_pair && row < zeroed_end); todo; todo &= todo - 1)
      warp_zero_row(d_y + (base + __ffs(todo) - 1) * vecs, r.row_bytes, lane);
  }
}

// ---- the launches' checks (both modes; cudaErrorInvalidValue where false) ----------------------------------------

// Pair columns of a handle's pair_row: 1 to kNormalMaxTopk.
inline bool pair_columns_ok(int64_t columns) { return columns >= 1 && columns <= kNormalMaxTopk; }

// A dispatch within the kernels' limits (kExpertMajorMaxExperts; a thread per expert) with a scratch row per block.
inline bool dispatch_args_ok(const ExpertMajorDispatchArgs& a, int num_ranks, int grid) {
  return a.num_topk >= 1 && a.num_topk <= kNormalMaxTopk && a.num_payloads >= 1 && a.num_payloads <= 2 &&
         a.num_experts >= num_ranks && a.num_experts % num_ranks == 0 && a.num_experts <= kExpertMajorMaxExperts &&
         a.expert_alignment >= 1 && a.block_count_rows >= grid;
}

// Combine's backward: rows of whole 16-byte vectors, d_weights exactly when weights.
inline bool combine_backward_args_ok(const ExpertMajorCombineBackwardArgs& a) {
  return pair_columns_ok(a.rows.num_pair_columns) && a.rows.row_bytes % 16 == 0 &&
         (a.weights != nullptr) == (a.d_weights != nullptr);
}

// ---- partials ---------------------------------------------------------------------------------------------------

// sum += weight * value (each product rounded on its own; unweighted: the value), element by element.
template <typename In, int kVec>
__device__ __forceinline__ void add_pair(float (&sum)[kVec], const Pack<In, kVec>& pack, float weight, bool weighted) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float x = to_float(pack.v[e]);
    sum[e] = __fadd_rn(sum[e], weighted ? __fmul_rn(weight, x) : x);
  }
}

// The index of the n-th set bit of `bits` (a lane or a rank).
__device__ __forceinline__ int nth_set_bit(uint32_t bits, int n) {
  for (; n > 0; --n) bits &= bits - 1;
  return __ffs(bits) - 1;
}

// A job's pair rows as add_source_vectors takes them: lane i < popc(kept) holds the i-th kept pair's row of y and
// its weight (1 where weights is null), from the lanes set in `kept`, each holding its pair's row in lane_pair.
template <typename InPack>
struct PairSources {
  const InPack* lane_row;
  float lane_weight;
};
template <typename InPack>
__device__ __forceinline__ PairSources<InPack> pair_sources(uint32_t kept, int32_t lane_pair, const InPack* y,
                                                            int64_t vecs, const float* weights, int lane) {
  const int count = __popc(kept);
  const int32_t row = __shfl_sync(kFullMask, lane_pair, lane < count ? nth_set_bit(kept, lane) : 0);
  return {lane < count ? y + row * vecs : y, weights && lane < count ? weights[row] : 1.f};
}

template <typename T>
__device__ __forceinline__ T* shfl_pointer(T* pointer, int lane) {
  return reinterpret_cast<T*>(
      __shfl_sync(kFullMask, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(pointer)), lane));
}

// The combines' partials: kSourceUnroll 16-byte vectors of each of kPairsAtOnce pair rows in flight per lane
// (add_source_vectors), 8 KB a warp on sm_90; sm_80's ptxas spilled kilobytes at 4 vectors, a few hundred bytes
// at 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kSourceUnroll = 2;
#else
constexpr int kSourceUnroll = 4;
#endif
constexpr int kPairsAtOnce = 4;
// The piece of a row one warp reads at once: kSourceUnroll vectors for each of its 32 lanes.
constexpr int kWarpPieceVecs = 32 * kSourceUnroll;

// sum[u] += rows_i[v0 + 32 u] (times weight_i where weighted, as add_pair) for the sources i in [first, first +
// kSources), in that order, u < kUnroll: lane i holds source i's row (`lane_row`, vectors of kVec elements of In)
// and weight. Every lane calls it (shuffles). All kSources * kUnroll loads are issued before the first sum. A
// vector past the row's end (v0 + 32 u >= vecs) loads the row's last one again, for the caller to leave unused:
// predicated loads would keep the packs' old elements, which the compiler then held one per register and spilled.
template <int kSources, typename In, int kVec, int kUnroll, typename Load>
__device__ __forceinline__ void add_sources_at_once(float (&sum)[kUnroll][kVec], const Pack<In, kVec>* lane_row,
                                                    float lane_weight, bool weighted, int first, int vecs, int v0) {
  Pack<In, kVec> packs[kSources][kUnroll];
#pragma unroll
  for (int i = 0; i < kSources; ++i) {
    const Pack<In, kVec>* row = shfl_pointer(lane_row, first + i);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) packs[i][u] = Load{}(row + min(v0 + 32 * u, vecs - 1));
  }
#pragma unroll
  for (int i = 0; i < kSources; ++i) {
    const float weight = __shfl_sync(kFullMask, lane_weight, first + i);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) add_pair<In, kVec>(sum[u], packs[i][u], weight, weighted);
  }
}

// The same for the sources [begin, end), kAtOnce at a time (a token's pair rows lie all over y: on an H200, 24 SMs
// read such rows in 2 KB pieces at ~58 GB/s per SM with 16 loads in flight per lane, against ~30-40 GB/s through
// shared-memory stages of cp.async or bulk copies: tests/gpu/bulk_copy_probe/combine_sums.cu, docs/perf-log.md).
template <int kAtOnce, typename In, int kVec, int kUnroll, typename Load>
__device__ __forceinline__ void add_source_vectors(float (&sum)[kUnroll][kVec], const Pack<In, kVec>* lane_row,
                                                   float lane_weight, bool weighted, int begin, int end, int vecs,
                                                   int v0) {
  int first = begin;
  for (; first + kAtOnce <= end; first += kAtOnce)
    add_sources_at_once<kAtOnce, In, kVec, kUnroll, Load>(sum, lane_row, lane_weight, weighted, first, vecs, v0);
  if constexpr (kAtOnce > 1) {
    if (first < end)  // fewer than kAtOnce left
      add_source_vectors<kAtOnce - 1, In, kVec, kUnroll, Load>(sum, lane_row, lane_weight, weighted, first, end, vecs,
                                                               v0);
  }
}

// `bytes` (a multiple of 16) at `address` (16-byte aligned) into L2, with no registers or shared memory held:
// a warp reading scattered rows in register-sized pieces asks for the next pieces while it waits for these
// (sm_90's bulk prefetch; nothing on older GPUs).
__device__ __forceinline__ void prefetch_to_l2(const void* address, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(bytes) : "memory");
#endif
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

}  // namespace
}  // namespace jax_ep
