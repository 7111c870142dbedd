// Parts of the normal-mode dispatch kernels that do not depend on where the rows come from (intranode.cu: peers'
// inputs over NVLink; internode.cu: the node's relays): the routing of this rank's tokens, the warps' walk over
// (source rank, token) pairs, the top-k row of a received token, the received and dropped counts, the padding rows,
// the expert-alignment epilogue and the cached dispatch's rows. `Args` is DispatchArgs or InternodeDispatchArgs
// (the same output fields), or for the cached dispatch CachedDispatchArgs or InternodeCachedDispatchArgs. Internal
// linkage, as device_common.cuh.
#pragma once
#include <cstdint>

#include "call_frame.cuh"
#include "device_common.cuh"

namespace jax_ep {
namespace {

// ---- routing this rank's tokens (block 0, before anything is sent) ------------------------------------------------

// Adds to `ranks` the ranks that token t names, where t < num_tokens (bit r: one of its top-k ids lives on rank r;
// Mask holds a bit per rank). Ids outside [-1, num_experts) name no rank and count in `invalid`.
template <typename Mask>
__device__ __forceinline__ void add_token_ranks(const int32_t* topk_idx, int64_t t, int64_t num_tokens, int num_topk,
                                                int32_t num_experts, int32_t experts_per_rank, Mask& ranks,
                                                int32_t& invalid) {
  if (t < num_tokens) {
    for (int k = 0; k < num_topk; ++k) {
      const int32_t e = topk_idx[t * num_topk + k];
      if (e == -1) continue;
      if (e < -1 || e >= num_experts) {
        ++invalid;
        continue;
      }
      ranks |= Mask{1} << (e / experts_per_rank);
    }
  }
}

// One thread per rank r, once every warp of the block stored its count of a tile's tokens for r in
// warp_counts[w][r]: replaces each count by the warp's first index among this rank's tokens for r (an exclusive
// scan over the warps, from totals[r]), and advances totals[r] past the tile.
template <int kBlockWarps, int kRanks>
__device__ __forceinline__ void scan_warp_counts(int32_t (&warp_counts)[kBlockWarps][kRanks], int32_t* totals, int r) {
  int32_t running = totals[r];
  for (int w = 0; w < kBlockWarps; ++w) {
    const int32_t count = warp_counts[w][r];
    warp_counts[w][r] = running;
    running += count;
  }
  totals[r] = running;
}

// ---- receiving -----------------------------------------------------------------------------------------------------

// The grid's warps take the (source rank, source token) pairs in a strided order, 32 at a time (one lane each
// asks `row_of(src, t)` where its pair lands here, -1 for nowhere), then receive the pairs that land here one
// after another: `receive(src, t, row)`, called by the whole warp. Pair p is token p / R of source
// (p + me) % R: sources interleave, starting at a different rank on every receiver, so all sources' links carry
// traffic at once (source-major order would make every receiver read from rank 0 first, then rank 1, ...).
// Rows still land in (source, token) order: `row_of` says where.
template <typename RowOf, typename Receive>
__device__ __forceinline__ void for_each_received_pair(int num_ranks, int64_t num_tokens, int me, RowOf row_of,
                                                       Receive receive) {
  const int lane = threadIdx.x % 32, warps_per_block = blockDim.x / 32;
  const int warp_id = blockIdx.x * warps_per_block + threadIdx.x / 32, num_warps = gridDim.x * warps_per_block;
  const int64_t num_pairs = num_ranks * num_tokens;
  for (int64_t first = warp_id; first < num_pairs; first += 32LL * num_warps) {
    const int64_t pair = first + static_cast<int64_t>(lane) * num_warps;
    const int src = static_cast<int>((pair + me) % num_ranks);
    const int64_t t = pair / num_ranks;
    const int32_t row = pair < num_pairs ? row_of(src, t) : -1;
    for (uint32_t todo = __ballot_sync(0xffffffffu, row >= 0); todo; todo &= todo - 1) {
      const int src_lane = __ffs(todo) - 1;
      receive(__shfl_sync(0xffffffffu, src, src_lane), __shfl_sync(0xffffffffu, t, src_lane),
              __shfl_sync(0xffffffffu, row, src_lane));
    }
  }
}

// A warp stores the top-k row of token t of rank src_rank, received into `row`: ids remapped to this rank's local
// ids (-1 where the expert is elsewhere or the id is outside [0, E)), the weight where kept, the source index,
// and this row's distinct local experts counted. Lane k holds entry k in `expert` and `weight` (lanes past the
// top-k: -1 and 0).
template <typename Args>
__device__ __forceinline__ void store_received_topk(const Args& a, int me, int num_ranks, int src_rank, int64_t t,
                                                    int32_t row, int32_t expert, float weight, int lane) {
  const int num_topk = static_cast<int>(a.num_topk);
  const int32_t experts_per_rank = static_cast<int32_t>(a.num_experts / num_ranks);
  const bool here = expert >= 0 && expert < a.num_experts && expert / experts_per_rank == me;
  const int32_t local = here ? expert - me * experts_per_rank : -1;
  if (lane < num_topk) {
    a.recv_topk_idx[static_cast<int64_t>(row) * num_topk + lane] = local;
    if (a.recv_topk_weights) a.recv_topk_weights[static_cast<int64_t>(row) * num_topk + lane] = here ? weight : 0.f;
  }
  const uint32_t same = __match_any_sync(0xffffffffu, local);
  if (local >= 0 && lane == __ffs(same) - 1) atomicAdd(&a.num_recv_tokens_per_expert[local], 1);
  if (lane == 0) a.recv_src_index[row] = static_cast<int32_t>(src_rank * a.num_tokens + t);
}

// The rows this rank keeps of the `need` that its sources send it: the capacity at most. Block 0 records them
// and the dropped rest (every block computes the same figure).
template <typename Args>
__device__ __forceinline__ int32_t count_received(const Args& a, int64_t need) {
  const int32_t num_recv = static_cast<int32_t>(min(need, a.capacity));
  if (blockIdx.x == 0) {
    *a.num_recv_tokens = num_recv;
    *a.num_dropped = static_cast<int32_t>(need - num_recv);
  }
  return num_recv;
}

// The grid's warps fill rows num_recv .. capacity - 1: zero payloads, ids -1, weights 0, source index R*T.
template <typename Args>
__device__ __forceinline__ void write_padding_rows(const Args& a, int num_ranks, int64_t num_recv) {
  const int lane = threadIdx.x % 32, warps_per_block = blockDim.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t row = num_recv + blockIdx.x * warps_per_block + threadIdx.x / 32; row < a.capacity; row += num_warps) {
    for (int p = 0; p < a.num_payloads; ++p)
      warp_zero_row(static_cast<char*>(a.recv_x[p]) + row * a.x_row_bytes[p], a.x_row_bytes[p], lane);
    for (int64_t k = lane; k < a.num_topk; k += 32) {
      a.recv_topk_idx[row * a.num_topk + k] = -1;
      if (a.recv_topk_weights) a.recv_topk_weights[row * a.num_topk + k] = 0.f;
    }
    if (lane == 0) a.recv_src_index[row] = static_cast<int32_t>(num_ranks * a.num_tokens);
  }
}

// One block, once every block's counts are in: rounds each local expert's count up to expert_alignment.
template <typename Args>
__device__ __forceinline__ void align_expert_counts(const Args& a, int num_ranks) {
  if (a.expert_alignment <= 1) return;
  for (int64_t j = threadIdx.x; j < a.num_experts / num_ranks; j += blockDim.x) {
    const int64_t count = __ldcg(a.num_recv_tokens_per_expert + j);
    a.num_recv_tokens_per_expert[j] =
        static_cast<int32_t>((count + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment);
  }
}

// ---- cached dispatch ------------------------------------------------------------------------------------------------

// The grid's warps fill the cached dispatch's rows [capacity, row_bytes]: row i is the row of source pair
// recv_src_index[i] = src_rank * T + t, which `copy(dst, src_rank, t)` (int64) copies (a whole warp), or zeros.
template <typename Args, typename Copy>
__device__ __forceinline__ void fill_cached_rows(const Args& a, int num_ranks, Copy copy) {
  const int lane = threadIdx.x % 32;
  const int64_t num_pairs = num_ranks * a.num_tokens;
  for (int64_t row = global_warp(); row < a.capacity; row += num_global_warps()) {
    const int32_t src = a.recv_src_index[row];
    void* dst = row_of(a.recv_x, row, a.row_bytes);
    if (src >= 0 && src < num_pairs)
      copy(dst, src / a.num_tokens, src % a.num_tokens);
    else
      warp_zero_row(dst, a.row_bytes, lane);
  }
}

}  // namespace
}  // namespace jax_ep
