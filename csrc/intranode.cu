// Intranode normal-mode kernels: dispatch, cached dispatch and combine, each one kernel launch that pulls
// peers' rows over NVLink, through peer pointers (one process driving the group) or CUDA IPC mappings of the
// peers' workspaces (a group spanning processes, "staged").
//
// Protocol of one call (all three ops share it and the per-rank state in intranode_state.h):
//  1. Every block reads the call number n = calls_completed + 1 from this rank's device state (device
//     resident, so CUDA-graph replay advances it; the handler's host code does not run per call).
//  2. Block 0 writes this rank's view (addresses of its inputs, dispatch's per-rank token counts) and
//     release-stores n into arrived[this rank] on every rank, itself included. In a staged group (ranks in
//     several processes) every block first copies its share of the inputs into this rank's workspace
//     (StagePlan), and block 0 publishes once all blocks did; the view then holds workspace offsets.
//  3. Every block waits (acquire, bounded) until arrived[p] >= n for every p, then reads the views.
//  4. The blocks read peers' rows and write this rank's outputs.
//  5. The last block to finish (a counter) release-stores n into released[this rank] on every rank and
//     waits until released[p] >= n for every p: no peer still reads our inputs when the kernel exits
//     (XLA may reuse them right after). It then advances calls_completed. This also bounds the skew:
//     no rank starts call n+1 before every rank finished reading in call n, so views are never
//     overwritten while being read and flags only grow.
// Kernel parameters are __grid_constant__: indexed by rank at run time without a copy to local memory.
// Blocks wait on block 0 of their own rank, so the grid must be co-resident: at most one block per SM.
// A wait that exceeds timeout_ns fills the rank's host-mapped error record and traps (see api.h).
#include <algorithm>
#include <cstring>

#include "api.h"
#include "call_frame.cuh"
#include "device_common.cuh"
#include "float_rows.cuh"
#include "intranode_call.cuh"
#include "intranode_state.h"
#include "normal_dispatch.cuh"

namespace jax_ep {
namespace {

// ---- dispatch ----------------------------------------------------------------------------------------------

// Block 0 of dispatch, before it publishes: where this rank's tokens go. Writes is_token_in_rank,
// send_offset (token t's index among this rank's tokens sent to r, in token order) and invalid_ids;
// totals[r] = this rank's tokens sent to rank r.
__device__ __forceinline__ void route_own_tokens(const DispatchArgs& a, int num_ranks, int32_t* totals) {
  __shared__ int32_t warp_base[kWarps][kMaxIntranodeRanks];
  __shared__ int32_t invalid;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x < kMaxIntranodeRanks) totals[threadIdx.x] = 0;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  const int64_t num_tokens = a.num_tokens;
  const int num_topk = static_cast<int>(a.num_topk);
  const int32_t num_experts = static_cast<int32_t>(a.num_experts);
  const int32_t experts_per_rank = num_experts / num_ranks;
  int32_t own_invalid = 0;
  for (int64_t tile = 0; tile < num_tokens; tile += kThreads) {
    const int64_t t = tile + threadIdx.x;
    uint32_t ranks = 0;  // bit r: the token goes to rank r
    add_token_ranks(a.topk_idx, t, num_tokens, num_topk, num_experts, experts_per_rank, ranks, own_invalid);
    int32_t lane_offset[kMaxIntranodeRanks];
#pragma unroll
    for (int r = 0; r < kMaxIntranodeRanks; ++r) {
      const uint32_t ballot = __ballot_sync(kFullMask, (ranks >> r) & 1u);
      lane_offset[r] = __popc(ballot & ((1u << lane) - 1u));
      if (lane == 0) warp_base[warp][r] = __popc(ballot);
    }
    __syncthreads();
    if (threadIdx.x < num_ranks) scan_warp_counts(warp_base, totals, threadIdx.x);
    __syncthreads();
    if (t < num_tokens) {
#pragma unroll
      for (int r = 0; r < kMaxIntranodeRanks; ++r) {
        if (r < num_ranks) {
          const bool sent = (ranks >> r) & 1u;
          a.is_token_in_rank[t * num_ranks + r] = sent;
          a.send_offset[t * num_ranks + r] = sent ? warp_base[warp][r] + lane_offset[r] : -1;
        }
      }
    }
    __syncthreads();
  }
  if (own_invalid) atomicAdd(&invalid, own_invalid);
  __syncthreads();
  if (threadIdx.x == 0) *a.invalid_ids = invalid;
}

// A warp receives token t of rank src_rank into `row`: payload rows and the top-k row (store_received_topk).
__device__ __forceinline__ void receive_token(const DispatchArgs& a, const IntranodeView& src, int src_rank, int me,
                                              int num_ranks, int64_t t, int32_t row, int lane) {
  const int num_topk = static_cast<int>(a.num_topk);
  const int32_t* src_idx = static_cast<const int32_t*>(src.pointers[2]);
  const float* src_weights = static_cast<const float*>(src.pointers[3]);
  int32_t expert = -1;
  float weight = 0.f;
  if (lane < num_topk) {  // issued before the row copy so their latency overlaps it
    expert = load_nc(src_idx + t * num_topk + lane);
    if (src_weights) weight = load_nc(src_weights + t * num_topk + lane);
  }
  if (a.num_payloads == 2)
    warp_copy_row_pair<kCopyUnroll>(row_of(a.recv_x[0], row, a.x_row_bytes[0]),
                                    row_of(src.pointers[0], t, a.x_row_bytes[0]), a.x_row_bytes[0],
                                    row_of(a.recv_x[1], row, a.x_row_bytes[1]),
                                    row_of(src.pointers[1], t, a.x_row_bytes[1]), a.x_row_bytes[1], lane,
                                    LoadNonCoherent{});
  else
    warp_copy_row(row_of(a.recv_x[0], row, a.x_row_bytes[0]), row_of(src.pointers[0], t, a.x_row_bytes[0]),
                  a.x_row_bytes[0], lane);
  store_received_topk(a, me, num_ranks, src_rank, t, row, expert, weight, lane);
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ IntranodeRank g,
                                                               const __grid_constant__ DispatchArgs a,
                                                               const __grid_constant__ StagePlan plan,
                                                               int64_t timeout_ns) {
  __shared__ CallContext ctx;
  __shared__ int32_t own_totals[kMaxIntranodeRanks];   // this rank's tokens sent to each rank
  __shared__ int32_t source_base[kMaxIntranodeRanks];  // first row here of each source rank's tokens
  __shared__ int32_t own_base[kMaxIntranodeRanks];     // first row of this rank's tokens on each rank
  __shared__ int32_t num_recv;
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32;
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity;
  const int64_t experts_per_rank = a.num_experts / num_ranks;

  begin_call([&] { return g.states[g.rank]; }, ctx);
  stage_inputs(g, plan);
  if (blockIdx.x == 0) {
    route_own_tokens(a, num_ranks, own_totals);
    for (int64_t j = threadIdx.x; j < experts_per_rank; j += kThreads) a.num_recv_tokens_per_expert[j] = 0;
    wait_for_staging(g, plan, ctx.call, IntranodeOp::kDispatch, timeout_ns);
    if (threadIdx.x == 0) {
      IntranodeView& view = g.states[me]->view;
      for (int i = 0; i < kMaxPublishedPointers; ++i) view.pointers[i] = plan.published[i];
      for (int r = 0; r < kMaxIntranodeRanks; ++r) view.counts[r] = own_totals[r];
    }
    __syncthreads();
    signal_arrival(g, ctx);
  }
  wait_for_arrivals(g, ctx, IntranodeOp::kDispatch, timeout_ns);

  if (threadIdx.x == 0) {
    int32_t need = 0;
    for (int s = 0; s < num_ranks; ++s) {
      source_base[s] = need;
      need += ctx.views[s].counts[me];
    }
    for (int r = 0; r < num_ranks; ++r) {
      own_base[r] = 0;
      for (int s = 0; s < me; ++s) own_base[r] += ctx.views[s].counts[r];
    }
    num_recv = count_received(a, need);
  }
  __syncthreads();

  // Received rows, in (source rank, token) order (see for_each_received_pair), then the padding rows.
  for_each_received_pair(
      num_ranks, num_tokens, me,
      [&](int s, int64_t t) {
        const volatile int32_t* offsets = static_cast<const int32_t*>(ctx.views[s].pointers[4]);
        const int32_t offset = offsets[t * num_ranks + me];
        return offset >= 0 && source_base[s] + offset < capacity ? source_base[s] + offset : -1;
      },
      [&](int src, int64_t t, int32_t row) { receive_token(a, ctx.views[src], src, me, num_ranks, t, row, lane); });
  write_padding_rows(a, num_ranks, num_recv);

  // Handle: the row of each of this rank's tokens on each rank (-1 where not sent or dropped).
  for (int64_t j = blockIdx.x * kThreads + threadIdx.x; j < num_tokens * num_ranks; j += gridDim.x * kThreads) {
    const int32_t offset = __ldcg(a.send_offset + j);  // written by block 0 during this kernel
    const int64_t row = offset >= 0 ? own_base[j % num_ranks] + offset : -1;
    a.send_row[j] = row < capacity ? static_cast<int32_t>(row) : -1;
  }

  finish_call(g, ctx, IntranodeOp::kDispatch, timeout_ns, [&] { align_expert_counts(a, num_ranks); });
}

// ---- cached dispatch ---------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1)
    cached_dispatch_kernel(const __grid_constant__ IntranodeRank g, const __grid_constant__ CachedDispatchArgs a,
                           const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  const int lane = threadIdx.x % 32;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kCachedDispatch, timeout_ns);
  fill_cached_rows(a, g.num_ranks, [&](void* dst, int64_t src_rank, int64_t t) {
    warp_copy_row(dst, row_of(ctx.views[src_rank].pointers[0], t, a.row_bytes), a.row_bytes, lane);
  });
  finish_call(g, ctx, IntranodeOp::kCachedDispatch, timeout_ns, [] {});
}

// ---- combine -----------------------------------------------------------------------------------------------

// out[t] = (acc = 0; acc += rows[r][...] for r = 0..kRanks-1 where rows[r] is set) + bias[t], cast to Out: the
// float32 rank-order sum (docs/design.md, "Normal combine"), by one warp; both pull and push combines reduce here,
// so they agree bit for bit. Lanes take kVec elements each. kRanks (2, 4 or 8) >= the group's ranks sizes the per-lane
// arrays; each lane keeps kRanks * kUnroll = 8 16-byte loads in flight, since latency, not bandwidth, bounds
// one warp. More is slower in the pull combine: the registers spill (docs/perf-log.md).
template <typename In, typename Bias, typename Out, int kVec, int kRanks, typename Load>
__device__ __forceinline__ void reduce_token(const Pack<In, kVec>* const (&rows)[kRanks], const CombineArgs& a,
                                             int64_t t, int lane, Load load) {
  constexpr int kUnroll = 8 / kRanks;
  const int64_t vecs = a.row_elements / kVec;
  const Bias* bias = static_cast<const Bias*>(a.bias);
  Out* out = static_cast<Out*>(a.out);
  for (int64_t first = lane; first < vecs; first += 32 * kUnroll) {
    Pack<In, kVec> packs[kUnroll][kRanks];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRanks; ++r)
        if (rows[r] && first + 32 * u < vecs) packs[u][r] = load(rows[r] + first + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = first + 32 * u;
      if (v >= vecs) break;
      float acc[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
#pragma unroll
      for (int r = 0; r < kRanks; ++r)
        if (rows[r])
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[e] += to_float(packs[u][r].v[e]);
      add_bias_and_store(acc, bias, out, a.row_elements, t, v);
    }
  }
}

// Pull combine: a warp reduces one token at a time, reading rank r's row y_r[send_row[t, r]] through r's
// published y (a peer pointer, or in a staged group the copy r made of its valid rows in its workspace).
template <typename In, typename Bias, typename Out, int kVec, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) combine_pull_kernel(const __grid_constant__ IntranodeRank g,
                                                                const __grid_constant__ CombineArgs a,
                                                                const __grid_constant__ StagePlan plan,
                                                                int64_t timeout_ns) {
  __shared__ CallContext ctx;
  const int num_ranks = g.num_ranks, lane = threadIdx.x % 32;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kCombine, timeout_ns);

  // Lane r < num_ranks holds the row of the warp's token on rank r, loaded one token ahead so that the
  // load's latency hides behind the previous token's reduction.
  auto load_row = [&](int64_t t) {
    int32_t row = -1;
    if (lane < num_ranks && t < a.num_tokens) {
      row = a.send_row[t * num_ranks + lane];
      if (row < 0 || row >= a.capacity) row = -1;
    }
    return row;
  };
  int32_t next_row = load_row(global_warp());
  for (int64_t t = global_warp(); t < a.num_tokens; t += num_global_warps()) {
    const int32_t row = next_row;
    next_row = load_row(t + num_global_warps());
    const Pack<In, kVec>* rows[kRanks];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      const int32_t rank_row = __shfl_sync(kFullMask, row, r);  // lanes >= num_ranks hold -1
      rows[r] = rank_row >= 0 ? reinterpret_cast<const Pack<In, kVec>*>(
                                    static_cast<const In*>(ctx.views[r].pointers[0]) + rank_row * a.row_elements)
                              : nullptr;
    }
    reduce_token<In, Bias, Out, kVec, kRanks>(rows, a, t, lane, LoadNonCoherent{});
  }
  finish_call(g, ctx, IntranodeOp::kCombine, timeout_ns, [] {});
}

// Push combine. Each rank stores its rows of y into the tokens' home ranks, which reduce them from local memory:
// one pass of NVLink stores, no staging copy in a staged group, no NVLink reads.
//  - y's rows are ordered by (source rank, token), so the rows a rank holds for source s are one range of y;
//    block 0 finds the ranges (find_source_ends) and publishes them with the arrival (view counts).
//  - The first push_warps warps of every block (CombineArgs::push_warps) take units of unit_rows rows (units
//    aligned to multiples of unit_rows in y, so that a row's number names its unit) and store each row for
//    home rank s != this rank into s's slots (s's view: a scratch result, or in a staged group s's workspace)
//    at [slot_region(this rank, s)][token]. After a unit the warp fences and raises s's flag
//    combine_ready[this rank][unit] to the call number.
//  - The other warps reduce from the start; the pushing warps join them once their units are out. Pushing
//    takes a few warps per SM (each loads a whole row from local memory per round, then stores it); reducing
//    takes more, since one warp's local reads are bound by latency. Reducing warps take this rank's tokens in
//    order (a ticket counter). For token t, rank r's row is send_row[t, r] (this rank's handle): a peer's row
//    is in the slots once the flag of its unit is raised, this rank's own row is read from y in place.
// No push waits for anything after the arrival barrier, so the reductions, which wait, cannot deadlock. The
// release barrier (finish_call) then also means that no peer still stores into this rank's slots, so XLA may
// reuse a scratch result, and a later call's pushes cannot overwrite slots still being reduced.

// Rows per push unit: about kPushUnitBytes (a unit ends with a fence and a flag store; smaller units let the
// reduction follow the pushes more closely) but at most kPushUnitRows (short rows, e.g. the combined top-k
// weights, still make a unit for every pushing warp), and at most kMaxCombineUnits units in y.
constexpr int64_t kPushUnitBytes = 48 << 10;
constexpr int64_t kPushUnitRows = 64;
// Rows shorter than this are pushed a lane per row (a warp per row would keep a few lanes busy and wait a
// round trip per row), longer ones a warp per row.
constexpr int64_t kPushWarpRowBytes = 32 * 16;
static_assert(kWarps >= kMaxIntranodeRanks);  // find_source_ends: a warp per rank

// First index i in [0, n) with values[i] >= target (n if none) for ascending values, by a whole warp: 32 probes
// per round, so a few rounds of loads. For any other values it returns some index in [0, n] and reads only
// values[0, n).
__device__ int64_t warp_lower_bound(const int32_t* values, int64_t n, int64_t target, int lane) {
  int64_t lo = 0, hi = n;  // the answer is in [lo, hi]: values before lo are below target, values[hi] is not
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t probe = lo + lane * step;
    const uint32_t below = __ballot_sync(kFullMask, probe < hi && values[probe] < target);
    const int k = below == kFullMask ? 32 : __ffs(~below) - 1;  // probes 0..k-1 are below target
    if (k == 0) break;                                          // values[lo] is not below: the answer is lo
    hi = min(hi, lo + k * step);  // probe k (when < hi) is not below
    lo += (k - 1) * step + 1;
  }
  return lo;
}

// Block 0 of a push combine, before it publishes: ends[s] = the first row of y whose source index is at least
// (s + 1) * T. Warp s searches for ends[s].
__device__ __forceinline__ void find_source_ends(const CombineArgs& a, int num_ranks, int32_t* ends) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < num_ranks) {
    const int64_t end = warp_lower_bound(a.recv_src_index, a.capacity, (warp + 1) * a.num_tokens, lane);
    if (lane == 0) ends[warp] = static_cast<int32_t>(end);
  }
}

// Rows of a rank's y that hold tokens of rank s, from the rank's view: [begin, end). Empty where the published
// ends are not ascending (only for a recv_src_index that no dispatch wrote).
__device__ __forceinline__ int64_t source_rows_begin(const IntranodeView& view, int s) {
  return s == 0 ? 0 : view.counts[s - 1];
}

// A lane copies a whole row alone (rows shorter than kPushWarpRowBytes).
template <typename Unit>
__device__ __forceinline__ void lane_copy_units(Unit* dst, const Unit* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_nc(src + i);
}

__device__ void lane_copy_row(void* dst, const void* src, int64_t bytes) {
  switch (unit_bytes(reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes)) {
    case 16: return lane_copy_units(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16);
    case 8: return lane_copy_units(static_cast<uint2*>(dst), static_cast<const uint2*>(src), bytes / 8);
    case 4: return lane_copy_units(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), bytes / 4);
    case 2: return lane_copy_units(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), bytes / 2);
    default: return lane_copy_units(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes);
  }
}

// A push warp's share of this rank's units. Unit u is the (u / (R - 1))-th unit of the rows for peer
// s = (me + 1 + u % (R - 1)) % R: consecutive units go to different peers, so every link carries traffic.
template <typename In>
__device__ void push_rows(const IntranodeRank& g, const CallContext& ctx, const CombineArgs& a, int64_t unit_rows,
                          int push_warp, int num_push_warps) {
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32;
  const int64_t num_tokens = a.num_tokens, row_bytes = a.row_elements * static_cast<int64_t>(sizeof(In));
  const IntranodeView& own = ctx.views[me];
  int64_t most_units = 0;  // units of the peer with the most
  for (int s = 0; s < num_ranks; ++s) {
    const int64_t begin = source_rows_begin(own, s), end = own.counts[s];
    if (s != me && end > begin) most_units = max(most_units, (end - 1) / unit_rows - begin / unit_rows + 1);
  }
  for (int64_t u = push_warp; u < most_units * (num_ranks - 1); u += num_push_warps) {
    const int s = (me + 1 + static_cast<int>(u % (num_ranks - 1))) % num_ranks;
    const int64_t begin = source_rows_begin(own, s), end = own.counts[s];
    const int64_t unit = begin / unit_rows + u / (num_ranks - 1);
    const int64_t first = max(begin, unit * unit_rows), last = min(end, (unit + 1) * unit_rows);
    if (first >= last) continue;  // this peer has fewer units
    char* slots = static_cast<char*>(const_cast<void*>(ctx.views[s].pointers[0])) +
                  slot_region(me, s) * num_tokens * row_bytes;
    for (int64_t base = first; base < last; base += 32) {  // lane i looks up row base + i
      int64_t t = -1;
      if (base + lane < last) {
        t = a.recv_src_index[base + lane] - s * num_tokens;
        if (t < 0 || t >= num_tokens) t = -1;  // not a token of s (only for a recv_src_index no dispatch wrote)
      }
      if (row_bytes < kPushWarpRowBytes) {
        if (t >= 0) lane_copy_row(slots + t * row_bytes, row_of(a.y, base + lane, row_bytes), row_bytes);
        continue;
      }
      for (uint32_t todo = __ballot_sync(kFullMask, t >= 0); todo; todo &= todo - 1) {
        const int src_lane = __ffs(todo) - 1;
        warp_copy_row(slots + __shfl_sync(kFullMask, t, src_lane) * row_bytes, row_of(a.y, base + src_lane, row_bytes),
                      row_bytes, lane);
      }
    }
    __syncwarp();
    if (lane == 0) {  // the unit's stores (every lane's, ordered by the warp barrier) before its flag
      __threadfence_system();
      store_release_sys(&g.states[s]->combine_ready[me][unit], ctx.call);
    }
  }
}

// A warp reduces this rank's tokens, taking them in order from the ticket counter until none is left.
template <typename In, typename Bias, typename Out, int kVec, int kRanks>
__device__ void reduce_pushed_tokens(const IntranodeRank& g, const CallContext& ctx, const CombineArgs& a,
                                     int64_t unit_rows, int64_t timeout_ns) {
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32;
  IntranodeState* own = g.states[me];
  const int64_t num_tokens = a.num_tokens;
  const In* slots = static_cast<const In*>(ctx.views[me].pointers[0]);
  // Lane r < num_ranks: the rows of rank r's y that can hold this rank's tokens, and the last unit of rank r
  // whose flag it saw raised in this call.
  int64_t rows_begin = 0, rows_end = 0, ready_unit = -1;
  if (lane < num_ranks) {
    rows_begin = lane == me ? 0 : source_rows_begin(ctx.views[lane], me);
    rows_end = lane == me ? a.capacity : min(static_cast<int64_t>(ctx.views[lane].counts[me]), a.capacity);
  }
  // Lane 0 holds the next ticket; taking the one after it while reducing hides the atomic's latency.
  uint32_t ticket = lane == 0 ? atomicAdd(&own->combine_tickets, 1u) : 0u;
  for (;;) {
    const int64_t t = __shfl_sync(kFullMask, ticket, 0);
    if (t >= num_tokens) break;
    if (lane == 0) ticket = atomicAdd(&own->combine_tickets, 1u);
    int32_t row = -1;
    if (lane < num_ranks) {
      row = a.send_row[t * num_ranks + lane];
      if (row < rows_begin || row >= rows_end) row = -1;
    }
    if (row >= 0 && lane != me && row / unit_rows != ready_unit) {
      ready_unit = row / unit_rows;
      wait_for_flag(g, &own->combine_ready[lane][ready_unit], ctx.call, IntranodeOp::kCombine,
                    IntranodeWait::kCombineRows, lane, timeout_ns);
    }
    __syncwarp();  // the rows the waiting lanes acquired are visible to the whole warp
    const Pack<In, kVec>* rows[kRanks];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      const int32_t rank_row = __shfl_sync(kFullMask, row, r);  // lanes >= num_ranks hold -1
      rows[r] = rank_row < 0 ? nullptr
                             : reinterpret_cast<const Pack<In, kVec>*>(
                                   r == me ? static_cast<const In*>(a.y) + rank_row * a.row_elements
                                           : slots + (slot_region(r, me) * num_tokens + t) * a.row_elements);
    }
    // At L2: the slots were written by peers during this call (y was not, but is read once either way).
    reduce_token<In, Bias, Out, kVec, kRanks>(rows, a, t, lane, LoadL2{});
  }
}

template <typename In, typename Bias, typename Out, int kVec, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) combine_push_kernel(const __grid_constant__ IntranodeRank g,
                                                                const __grid_constant__ CombineArgs a,
                                                                const __grid_constant__ StagePlan plan,
                                                                int64_t unit_rows, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  __shared__ int32_t source_ends[kMaxIntranodeRanks];  // block 0: what it publishes as its view's counts
  if (blockIdx.x == 0) find_source_ends(a, g.num_ranks, source_ends);
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kCombine, timeout_ns, source_ends);
  const int warp = threadIdx.x / 32;
  if (warp < a.push_warps)
    push_rows<In>(g, ctx, a, unit_rows, blockIdx.x * a.push_warps + warp, gridDim.x * a.push_warps);
  reduce_pushed_tokens<In, Bias, Out, kVec, kRanks>(g, ctx, a, unit_rows, timeout_ns);
  finish_call(g, ctx, IntranodeOp::kCombine, timeout_ns, [] {});
}

// ---- store ceiling probe (benchmark, instrumented builds only) -----------------------------------------------
#if defined(JAX_EP_INSTRUMENT)

// Every block stores 16-byte units into every peer's region for this rank, peers interleaved per unit so
// that all links carry traffic at once.
__global__ void __launch_bounds__(kThreads, 1) store_probe_kernel(const __grid_constant__ IntranodeRank g,
                                                                  const __grid_constant__ StoreProbeArgs a,
                                                                  const __grid_constant__ StagePlan plan,
                                                                  int64_t timeout_ns) {
  __shared__ CallContext ctx;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kStoreProbe, timeout_ns);
  const int64_t units = a.bytes_per_peer / 16;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < units;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint4 value = make_uint4(static_cast<uint32_t>(i), static_cast<uint32_t>(g.rank), 0u, 0u);
    for (int step = 1; step < g.num_ranks; ++step) {
      const int peer = (g.rank + step) % g.num_ranks;
      static_cast<uint4*>(const_cast<void*>(ctx.views[peer].pointers[0]))[g.rank * units + i] = value;
    }
  }
  finish_call(g, ctx, IntranodeOp::kStoreProbe, timeout_ns, [] {});
}
#endif

// ---- launches ----------------------------------------------------------------------------------------------

// Rows per push unit (see kPushUnitBytes); sender and receiver derive it from the same shapes.
int64_t push_unit_rows(int64_t capacity, int64_t row_bytes) {
  const int64_t for_bytes = std::min((kPushUnitBytes + row_bytes - 1) / std::max<int64_t>(row_bytes, 1), kPushUnitRows);
  const int64_t for_flags = (capacity + kMaxCombineUnits - 1) / kMaxCombineUnits;
  return std::max<int64_t>({for_bytes, for_flags, 1});
}

template <typename In, typename Bias, typename Out, int kVec, int kRanks>
void launch_combine_kernel(const IntranodeCall& call, const CombineArgs& args, const StagePlan& plan) {
  if (args.method == CombineMethod::kPush)
    combine_push_kernel<In, Bias, Out, kVec, kRanks><<<grid_size(call), kThreads, 0, call.stream>>>(
        call.group, args, plan, push_unit_rows(args.capacity, args.row_elements * static_cast<int64_t>(sizeof(In))),
        call.timeout_ns);
  else
    combine_pull_kernel<In, Bias, Out, kVec, kRanks>
        <<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
}

template <typename In, typename Bias, typename Out, int kRanks>
void launch_combine_for_ranks(const IntranodeCall& call, const CombineArgs& args, const StagePlan& plan) {
  constexpr int kVec = 16 / sizeof(In);  // 16-byte loads where the row allows (XLA buffers are 16-byte aligned)
  if (args.row_elements % kVec == 0)
    launch_combine_kernel<In, Bias, Out, kVec, kRanks>(call, args, plan);
  else
    launch_combine_kernel<In, Bias, Out, 1, kRanks>(call, args, plan);
}

template <typename In, typename Bias, typename Out>
cudaError_t launch_combine(const IntranodeCall& call, const CombineArgs& args) {
  const int ranks = call.group.num_ranks;
  const int64_t row_bytes = args.row_elements * static_cast<int64_t>(sizeof(In));
  const bool push = args.method == CombineMethod::kPush;
  const CombineStaging staging(args.num_tokens, row_bytes, ranks, args.capacity, push);
  StagePlanBuilder builder(call.group);
  if (push)  // view: the slots where peers store their rows for this rank
    builder.publish_scratch(args.slots, staging.rows);
  else  // view: y (a staged group copies the valid rows: source index below R * T)
    builder.publish(args.y, args.capacity, row_bytes, staging.rows, args.recv_src_index, ranks * args.num_tokens);
  StagePlan plan;
  if (!builder.finish(&plan, staging.end)) return cudaErrorMemoryAllocation;
  with_rank_bound(ranks, [&](auto bound) {
    launch_combine_for_ranks<In, Bias, Out, decltype(bound)::value>(call, args, plan);
  });
  return cudaGetLastError();
}

}  // namespace

cudaError_t intranode_dispatch(const IntranodeCall& call, const DispatchArgs& args) {
  if (args.num_topk > kNormalMaxTopk || args.num_payloads < 1 || args.num_payloads > 2) return cudaErrorInvalidValue;
  DispatchArgs staged_args = args;
  StagePlanBuilder builder(call.group);  // view order: the dispatch inputs, then send_offset at 4
  const DispatchStaging staging = publish_dispatch_inputs(builder, args, call.group.num_ranks);
  staged_args.send_offset = builder.publish_scratch(args.send_offset, staging.send_offset);
  StagePlan plan;
  if (!builder.finish(&plan, staging.end)) return cudaErrorMemoryAllocation;
  dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, staged_args, plan, call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t intranode_cached_dispatch(const IntranodeCall& call, const CachedDispatchArgs& args) {
  StagePlan plan;
  if (!plan_cached_dispatch(call.group, args.x, args.num_tokens, args.row_bytes, &plan)) return cudaErrorMemoryAllocation;
  cached_dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
  return cudaGetLastError();
}

#if defined(JAX_EP_INSTRUMENT)
cudaError_t intranode_store_probe(const IntranodeCall& call, const StoreProbeArgs& args) {
  if (call.group.staged) return cudaErrorNotSupported;  // a peer process cannot map `out`
  if (args.bytes_per_peer % 16 != 0) return cudaErrorInvalidValue;
  StagePlan plan = {};
  plan.published[0] = args.out;
  store_probe_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
  return cudaGetLastError();
}
#endif

cudaError_t intranode_combine(const IntranodeCall& call, const CombineArgs& args) {
  static_assert(kCombineMaxPushWarps == kWarps, "a block's warps may all push");
  // A push in one process stores into the scratch result (the handler checks that it came).
  const bool method_ok =
      args.method == CombineMethod::kPull
          ? args.push_warps == 0
          : args.method == CombineMethod::kPush && args.push_warps >= 1 && args.push_warps <= kCombineMaxPushWarps &&
                (call.group.staged || call.group.num_ranks == 1 || args.slots);
  if (!method_ok) return cudaErrorInvalidValue;
  return with_combine_types(args, [&](auto in, auto bias, auto out) {
    return launch_combine<typename decltype(in)::type, typename decltype(bias)::type, typename decltype(out)::type>(
        call, args);
  });
}

}  // namespace jax_ep
