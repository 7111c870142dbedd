// The internode kernels' protocol (docs/design.md, "Internode kernels"), shared by the rank-major kernels
// (internode.cu) and the expert-major ones (internode_expert_major.cu): addressing of the symmetric regions, call
// synchronisation (grid barriers, rail signals and credits, node readiness, the call's end), sending this rank's
// tokens to the nodes that hold their experts, this rank's routing, and the combine's relay and origin sums.
#pragma once
#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <type_traits>

#include "api.h"
#include "call_frame.cuh"
#include "device_common.cuh"
#include "float_rows.cuh"
#include "internode_state.h"
#include "intranode_state.h"
#include "normal_dispatch.cuh"

namespace jax_ep {
namespace {


// Packs per lane summed per step in the combine's relay and origin loops (their loads issued together).
constexpr int kSumUnroll = 4;

// ---- addressing ----------------------------------------------------------------------------------------------

__device__ __forceinline__ InternodeHeader* header_of(char* region) {
  return reinterpret_cast<InternodeHeader*>(region);
}
__device__ __forceinline__ char* data_of(char* region) { return region + kInternodeHeaderBytes; }

// The rank with this rank's local index on node m, and its PE.
__device__ __forceinline__ int rail_rank(const InternodeRank& g, int node) { return node * g.ranks_per_node + g.local; }
__device__ __forceinline__ int rail_pe(const InternodeRank& g, int node) { return g.pe_of_rank[rail_rank(g, node)]; }

// OR of a 64-bit value over the warp.
__device__ __forceinline__ uint64_t warp_or(uint64_t bits) {
  const uint32_t low = __reduce_or_sync(kFullMask, static_cast<uint32_t>(bits));
  const uint32_t high = __reduce_or_sync(kFullMask, static_cast<uint32_t>(bits >> 32));
  return static_cast<uint64_t>(high) << 32 | low;
}

__device__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  warp_copy_row<kCopyUnroll>(dst, src, bytes, lane, LoadL2{});
}

// ---- call synchronisation --------------------------------------------------------------------------------------

struct CallContext {  // per block, in shared memory
  uint64_t call;
  bool last_block;
};

template <typename Word>
__device__ __forceinline__ void wait_for(const InternodeRank& g, const CallContext& ctx, const Word* flag, Word target,
                                         InternodeOp op, InternodeWait wait, int peer, int64_t timeout_ns) {
  wait_at_least(flag, target, timeout_ns, [&](Word seen, int64_t waited) {
    fail_on_timeout(&header_of(g.region)->error_claimed, g.error, g.rank, static_cast<int32_t>(op),
                    static_cast<int32_t>(wait), peer, ctx.call, seen, waited);
  });
}

// Every block of this rank reaches barrier `index` (0, 1, ... within the call) before any passes it. Writes
// before it, local or through NVLink, are visible after it to every block (and, by cumulativity, to whoever a
// later release of this rank reaches).
__device__ void grid_barrier(const InternodeRank& g, const CallContext& ctx, uint32_t index, InternodeOp op,
                             int64_t timeout_ns) {
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* arrivals = &header_of(g.region)->grid_arrivals;
    __threadfence_system();
    atomicAdd(arrivals, 1u);
    wait_for<uint32_t>(g, ctx, arrivals, (index + 1) * gridDim.x, op, InternodeWait::kGrid, g.rank, timeout_ns);
    __threadfence();
  }
  __syncthreads();
}

// Block 0, once every block issued its puts (after a grid barrier): completes them and signals
// arrived[this node] = call to the rank of every other node on this rail.
__device__ void signal_rails(const InternodeRank& g, const CallContext& ctx) {
  if (threadIdx.x == 0) nvshmem_quiet();
  __syncthreads();
  const int m = threadIdx.x;
  if (m < g.num_nodes && m != g.node) {
    __threadfence_system();
    nvshmemx_signal_op(&header_of(g.region)->arrived[g.node], ctx.call, NVSHMEM_SIGNAL_SET, rail_pe(g, m));
  }
}

// Every block: until the rank of every other node on this rail signalled this call.
__device__ void wait_rails(const InternodeRank& g, const CallContext& ctx, InternodeOp op, int64_t timeout_ns) {
  const int m = threadIdx.x;
  if (m < g.num_nodes && m != g.node)
    wait_for<uint64_t>(g, ctx, &header_of(g.region)->arrived[m], ctx.call, op, InternodeWait::kArrival,
                       rail_rank(g, m), timeout_ns);
  __syncthreads();
}

// Block 0: this rank's region is readable for this call; tells every rank of the node (itself included).
__device__ void publish_ready(const InternodeRank& g, const CallContext& ctx) {
  const int j = threadIdx.x;
  if (j < g.ranks_per_node) {
    __threadfence_system();
    store_release_sys(&header_of(g.node_regions[j])->ready[g.local], ctx.call);
  }
  __syncthreads();
}

// Every block: until every rank of the node published its region for this call.
__device__ void wait_node_ready(const InternodeRank& g, const CallContext& ctx, InternodeOp op, int64_t timeout_ns) {
  const int j = threadIdx.x;
  if (j < g.ranks_per_node)
    wait_for<uint64_t>(g, ctx, &header_of(g.region)->ready[j], ctx.call, op, InternodeWait::kReady,
                       g.node * g.ranks_per_node + j, timeout_ns);
  __syncthreads();
}

// A sender, before its first put of the call to the rank of node m on this rail: that rank and its node peers
// read nothing of its region for the previous call any more. `credited` (bit m) remembers nodes already seen.
__device__ __forceinline__ void wait_for_credit(const InternodeRank& g, const CallContext& ctx, int node,
                                                uint64_t& credited, InternodeOp op, int64_t timeout_ns, int lane) {
  if ((credited >> node) & 1u) return;
  if (lane == 0)
    wait_for<uint64_t>(g, ctx, &header_of(g.region)->credit[node], ctx.call - 1, op, InternodeWait::kCredit,
                       rail_rank(g, node), timeout_ns);
  __syncwarp();
  credited |= 1ull << node;
}

// Every block, after its work. The last block runs `epilogue` (every other block's writes visible), then the
// node barrier (nobody of this node reads this rank's region for this call any more), then gives credit for
// this call to the rank of every other node on this rail, then ends the call.
template <typename Epilogue>
__device__ void finish_call(const InternodeRank& g, CallContext& ctx, InternodeOp op, int64_t timeout_ns,
                            Epilogue epilogue) {
  InternodeHeader* own = header_of(g.region);
  const auto release = [&] {
    const int j = threadIdx.x;
    if (j < g.ranks_per_node) {
      __threadfence_system();
      store_release_sys(&header_of(g.node_regions[j])->released[g.local], ctx.call);
      wait_for<uint64_t>(g, ctx, &own->released[j], ctx.call, op, InternodeWait::kRelease,
                         g.node * g.ranks_per_node + j, timeout_ns);
    }
    __syncthreads();
    const int m = threadIdx.x;
    if (m < g.num_nodes && m != g.node) {
      __threadfence_system();
      nvshmemx_signal_op(&own->credit[g.node], ctx.call, NVSHMEM_SIGNAL_SET, rail_pe(g, m));
    }
  };
  end_call(own, ctx, epilogue, release, [](InternodeHeader* header) { header->grid_arrivals = 0; });
}

// ---- sending this rank's tokens ----------------------------------------------------------------------------------

struct SendRows {
  int32_t num_payloads;  // 1, or 2 (the FP8 pair: values then scales, back to back in a slot)
  const void* x[2];
  int64_t row_bytes[2];
};

// The nodes that hold one of token t's experts (warp-uniform): from topk_idx (ids outside [0, E) go nowhere).
struct NodesOfTopk {
  const int32_t* topk_idx;
  int32_t num_topk, num_experts, experts_per_node;
  __device__ uint64_t operator()(int64_t t, int lane) const {
    uint64_t node = 0;
    if (lane < num_topk) {
      const int32_t e = topk_idx[t * num_topk + lane];
      if (e >= 0 && e < num_experts) node = 1ull << (e / experts_per_node);
    }
    return warp_or(node);
  }
};

// The same from an earlier dispatch's is_token_in_rank [T, R].
struct NodesOfRanks {
  const bool* is_token_in_rank;
  int32_t num_ranks, ranks_per_node;
  __device__ uint64_t operator()(int64_t t, int lane) const {
    uint64_t node = 0;
    for (int r = lane; r < num_ranks; r += 32)
      if (is_token_in_rank[t * num_ranks + r]) node |= 1ull << (r / ranks_per_node);
    return warp_or(node);
  }
};

// Warps of blocks first_block.. copy every token that goes to some node into this rank's slot (node, t) and
// put it into slot (node, t) of the rank of every other such node on this rail.
template <typename NodesOf>
__device__ void send_own_tokens(const InternodeRank& g, const CallContext& ctx, const InternodeDispatchLayout& layout,
                                const SendRows& rows, int first_block, NodesOf nodes_of, InternodeOp op,
                                int64_t timeout_ns) {
  if (static_cast<int>(blockIdx.x) < first_block) return;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x - first_block) * kWarps + threadIdx.x / 32;
  const int num_warps = (gridDim.x - first_block) * kWarps;
  char* own = data_of(g.region);
  uint64_t credited = 1ull << g.node;
  for (int64_t t = warp; t < layout.num_tokens; t += num_warps) {
    const uint64_t nodes = nodes_of(t, lane);
    if (nodes == 0) continue;
    char* slot = own + layout.slot(g.node, t);
    warp_copy_row<kCopyUnroll>(slot, row_of(rows.x[0], t, rows.row_bytes[0]), rows.row_bytes[0], lane,
                               LoadNonCoherent{});
    if (rows.num_payloads == 2)
      warp_copy_row<kCopyUnroll>(slot + rows.row_bytes[0], row_of(rows.x[1], t, rows.row_bytes[1]), rows.row_bytes[1],
                                 lane, LoadNonCoherent{});
    uint64_t remote = nodes & ~(1ull << g.node);
    if (remote == 0) continue;
    __syncwarp();
    if (lane == 0) __threadfence_system();  // the slot's bytes before the transport reads them
    __syncwarp();
    for (; remote; remote &= remote - 1) {
      const int m = __ffsll(static_cast<long long>(remote)) - 1;
      wait_for_credit(g, ctx, m, credited, op, timeout_ns, lane);
      nvshmemx_putmem_nbi_warp(slot, slot, layout.payload_bytes, rail_pe(g, m));
    }
  }
}

// Every block, after a grid barrier that follows send_own_tokens: block 0 completes the sends and signals them;
// once every other node's rows for this rank arrived, block 0 lets the node peers read this rank's region.
// Every block waits for the rails itself (not only block 0): otherwise the other blocks, waiting in
// wait_node_ready for this rank's own ready flag, would time out first when a rail peer stalls, and the error
// record would name this rank instead of the stalled peer.
__device__ void relay_when_arrived(const InternodeRank& g, const CallContext& ctx, InternodeOp op, int64_t timeout_ns) {
  if (blockIdx.x == 0) signal_rails(g, ctx);
  wait_rails(g, ctx, op, timeout_ns);
  if (blockIdx.x == 0) publish_ready(g, ctx);
}

// ---- dispatch ----------------------------------------------------------------------------------------------------

// Routing part (counts, then offsets) of the meta that node m receives from this rank: its own meta for this
// node, the outgoing block for the others.
__device__ __forceinline__ int32_t* routing_for(const InternodeRank& g, const InternodeDispatchLayout& layout,
                                                int node) {
  char* own = data_of(g.region);
  return reinterpret_cast<int32_t*>(own + (node == g.node ? layout.routing_of(g.node) : layout.outgoing_of(node)));
}

// Block 0: where this rank's tokens go. For every token t and destination rank r = (m, j): t's index among this
// rank's tokens sent to r, in token order, or -1, into offsets[t][j] of node m's routing part, and this rank's
// totals per destination into its counts. Also writes is_token_in_rank, invalid_ids, zeroes `expert_counts` when
// given (the rank-major dispatch's per-expert counts: before the grid barrier, so before any block adds to them)
// and copies topk_idx/weights into its meta.
template <typename Args>
__device__ void route_own_tokens(const InternodeRank& g, const Args& a, const InternodeDispatchLayout& layout,
                                 int32_t* expert_counts) {
  __shared__ int32_t warp_base[kWarps][kMaxInternodeRanks];
  __shared__ int32_t totals[kMaxInternodeRanks];
  __shared__ int32_t invalid;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int num_ranks = g.num_ranks, ranks_per_node = g.ranks_per_node;
  const int64_t num_tokens = a.num_tokens;
  const int num_topk = static_cast<int>(a.num_topk);
  const int32_t num_experts = static_cast<int32_t>(a.num_experts);
  const int32_t experts_per_rank = num_experts / num_ranks;
  for (int r = threadIdx.x; r < kMaxInternodeRanks; r += kThreads) totals[r] = 0;
  if (threadIdx.x == 0) invalid = 0;
  if (expert_counts)
    for (int64_t j = threadIdx.x; j < experts_per_rank; j += kThreads) expert_counts[j] = 0;
  __syncthreads();
  int32_t own_invalid = 0;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t tile = 0; tile < num_tokens; tile += kThreads) {
    const int64_t t = tile + threadIdx.x;
    uint64_t ranks = 0;  // bit r: the token goes to rank r
    add_token_ranks(a.topk_idx, t, num_tokens, num_topk, num_experts, experts_per_rank, ranks, own_invalid);
    for (int r = 0; r < num_ranks; ++r) {
      const unsigned ballot = __ballot_sync(kFullMask, (ranks >> r) & 1u);
      if (lane == 0) warp_base[warp][r] = __popc(ballot);
    }
    __syncthreads();
    for (int r = threadIdx.x; r < num_ranks; r += kThreads) scan_warp_counts(warp_base, totals, r);
    __syncthreads();
    for (int r = 0; r < num_ranks; ++r) {
      const bool sent = (ranks >> r) & 1u;
      const unsigned ballot = __ballot_sync(kFullMask, sent);
      if (t < num_tokens) {
        routing_for(g, layout, r / ranks_per_node)[InternodeDispatchLayout::kOffsets / 4 + t * ranks_per_node +
                                                   r % ranks_per_node] =
            sent ? warp_base[warp][r] + __popc(ballot & lanes_below) : -1;
        a.is_token_in_rank[t * num_ranks + r] = sent;
      }
    }
    __syncthreads();
  }
  if (own_invalid) atomicAdd(&invalid, own_invalid);
  for (int r = threadIdx.x; r < num_ranks; r += kThreads)
    routing_for(g, layout, r / ranks_per_node)[r % ranks_per_node] = totals[r];
  char* topk = data_of(g.region) + layout.topk_of(g.node);
  for (int64_t i = threadIdx.x; i < num_tokens * num_topk; i += kThreads) {
    reinterpret_cast<int32_t*>(topk)[i] = a.topk_idx[i];
    if (a.topk_weights) reinterpret_cast<float*>(topk + layout.weights)[i] = a.topk_weights[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) *a.invalid_ids = invalid;
}

// Block 0, after route_own_tokens: puts this rank's topk part and node m's routing into the meta of the rank of
// every other node m on this rail.
__device__ void put_routing(const InternodeRank& g, const CallContext& ctx, const InternodeDispatchLayout& layout,
                            int64_t timeout_ns, InternodeOp op) {
  const int m = threadIdx.x;
  if (m < g.num_nodes && m != g.node)
    wait_for<uint64_t>(g, ctx, &header_of(g.region)->credit[m], ctx.call - 1, op,
                       InternodeWait::kCredit, rail_rank(g, m), timeout_ns);
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();  // the block's routing writes before the transport reads them
  __syncthreads();
  char* own = data_of(g.region);
  for (int node = 0; node < g.num_nodes; ++node) {
    if (node == g.node) continue;
    const int pe = rail_pe(g, node);
    nvshmemx_putmem_nbi_block(own + layout.topk_of(g.node), own + layout.topk_of(g.node), layout.topk_bytes, pe);
    nvshmemx_putmem_nbi_block(own + layout.routing_of(g.node), own + layout.outgoing_of(node), layout.routing_bytes,
                              pe);
  }
}

// ---- combine ---------------------------------------------------------------------------------------------------

// One step of a lane's sum over rows (both combine stages): acc[u] += row[v0 + 32 u] for u < kSumUnroll, in
// float32, every load issued before the first addition (loads in flight); packs past `vecs` read as zeros.
template <typename RowPack, int kVec>
__device__ __forceinline__ void add_packs(float (&acc)[kSumUnroll][kVec], const RowPack* row, int64_t v0,
                                          int64_t vecs) {
  RowPack packs[kSumUnroll] = {};
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u)
    if (v0 + 32 * u < vecs) packs[u] = LoadL2{}(row + v0 + 32 * u);
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[u][e] += to_float(packs[u].v[e]);
}

// Steps 2 to 4 of a combine whose rows every rank of the node staged in its region (after step 1, its stores):
// every rank has `a.capacity` staged rows, of which relay_row names the ones of each relayed token.
//  2. Relay: partial[t] = sum over node ranks j in order of staged_j[row of t] (float32 from 0) for every token of
//     rank (s, local) that came into this node; kept for s == this node, else put to (s, local).
//  3. Origin: out[t] = sum over the nodes m holding t, in node order, of partial_m[t] (float32 from 0) + bias.
//  4. Finish the call.
// kVec elements of In per load (16 bytes where rows allow; XLA buffers and the region's rows are 16-byte
// aligned). Partials are float32, kVec per lane and step.
template <typename In, typename Bias, typename Out, int kVec>
__device__ void relay_and_sum_home(const InternodeRank& g, CallContext& ctx, const InternodeCombineArgs& a,
                                   const InternodeCombineLayout& layout, InternodeOp op, int64_t timeout_ns) {
  using InPack = Pack<In, kVec>;
  using FloatPack = Pack<float, kVec>;
  const int lane = threadIdx.x % 32, ranks_per_node = g.ranks_per_node, num_ranks = g.num_ranks;
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity, vecs = a.row_elements / kVec;
  char* own = data_of(g.region);
  grid_barrier(g, ctx, 0, op, timeout_ns);
  if (blockIdx.x == 0) publish_ready(g, ctx);
  wait_node_ready(g, ctx, op, timeout_ns);

  uint64_t credited = 1ull << g.node;
  const int64_t relayed = static_cast<int64_t>(g.num_nodes) * num_tokens;
  for (int64_t i = global_warp(); i < relayed; i += num_global_warps()) {
    if (!a.relay_token[i]) continue;
    const int source_node = static_cast<int>(i / num_tokens);
    const int64_t t = i % num_tokens;
    const int32_t lane_row = lane < ranks_per_node ? a.relay_row[i * ranks_per_node + lane] : -1;
    const InPack* rows[kMaxRanksPerNode];
#pragma unroll
    for (int j = 0; j < kMaxRanksPerNode; ++j) {
      const int32_t row = __shfl_sync(kFullMask, lane_row, j);  // lanes >= P hold -1
      rows[j] = row >= 0 && row < capacity
                    ? reinterpret_cast<const InPack*>(data_of(g.node_regions[j]) + layout.staged +
                                                      row * layout.staged_row_bytes)
                    : nullptr;
    }
    char* partial = own + (source_node == g.node ? layout.received_row(g.node, t) : layout.sending_row(source_node, t));
    for (int64_t v0 = lane; v0 < vecs; v0 += 32 * kSumUnroll) {
      float sum[kSumUnroll][kVec] = {};
#pragma unroll
      for (int j = 0; j < kMaxRanksPerNode; ++j)
        if (rows[j]) add_packs(sum, rows[j], v0, vecs);
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        if (v0 + 32 * u >= vecs) break;
        FloatPack out;
#pragma unroll
        for (int e = 0; e < kVec; ++e) out.v[e] = sum[u][e];
        reinterpret_cast<FloatPack*>(partial)[v0 + 32 * u] = out;
      }
    }
    if (source_node == g.node) continue;
    __syncwarp();
    if (lane == 0) __threadfence_system();  // the partial's bytes before the transport reads them
    __syncwarp();
    wait_for_credit(g, ctx, source_node, credited, op, timeout_ns, lane);
    nvshmemx_putmem_nbi_warp(own + layout.received_row(g.node, t), partial, a.row_elements * 4,
                             rail_pe(g, source_node));
  }
  grid_barrier(g, ctx, 1, op, timeout_ns);
  if (blockIdx.x == 0) signal_rails(g, ctx);
  wait_rails(g, ctx, op, timeout_ns);

  const Bias* bias = static_cast<const Bias*>(a.bias);
  Out* out = static_cast<Out*>(a.out);
  for (int64_t t = global_warp(); t < num_tokens; t += num_global_warps()) {
    const uint64_t nodes = NodesOfRanks{a.is_token_in_rank, num_ranks, ranks_per_node}(t, lane);
    for (int64_t v0 = lane; v0 < vecs; v0 += 32 * kSumUnroll) {
      float acc[kSumUnroll][kVec] = {};
      for (uint64_t todo = nodes; todo; todo &= todo - 1) {
        const int m = __ffsll(static_cast<long long>(todo)) - 1;
        add_packs(acc, reinterpret_cast<const FloatPack*>(own + layout.received_row(m, t)), v0, vecs);
      }
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if (v0 + 32 * u < vecs) add_bias_and_store(acc[u], bias, out, a.row_elements, t, v0 + 32 * u);
    }
  }
  finish_call(g, ctx, op, timeout_ns, [] {});
}

// Calls launch(std::integral_constant<int, kVec>{}) with the elements of In a combine's lanes load at once: 16
// bytes where the rows allow (XLA buffers and the region's rows are 16-byte aligned), else 4;
// cudaErrorInvalidValue when neither divides the row.
template <typename In, typename Launch>
cudaError_t with_row_vector(int64_t row_elements, Launch launch) {
  constexpr int kWide = 16 / sizeof(In), kNarrow = 4 / sizeof(In);
  if (row_elements % kWide == 0) return launch(std::integral_constant<int, kWide>{});
  if (row_elements % kNarrow == 0) return launch(std::integral_constant<int, kNarrow>{});
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace jax_ep
#endif  // JAX_EP_WITH_NVSHMEM
