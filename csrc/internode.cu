// Internode normal-mode kernels (docs/design.md, "Internode kernels"): dispatch, cached dispatch and
// combine over N nodes of P ranks, one kernel launch each, one process per GPU. Network traffic goes through
// NVSHMEM puts and signals between the ranks of one local index ("rails"); inside a node, ranks read each
// other's symmetric regions through NVLink (nvshmem_ptr mappings, never across nodes).
//
// Dispatch on rank (n, l), call c (layout: InternodeDispatchLayout):
//  1. Send. Block 0 routes this rank's tokens (for every destination rank: the token's index among the tokens
//     sent there) and puts the routing and topk_idx/weights into the region of rank (m, l) of every other node
//     m. The other blocks copy each token that goes anywhere into this rank's own slot (n, t) and put it into
//     slot (n, t) of rank (m, l) for every other node m that holds one of its experts: once per (token,
//     destination node). Before the first put to (m, l) in a call, the sender waits for (m, l)'s credit
//     for call c - 1 (its region is free again).
//  2. Relay. After all blocks sent (grid barrier), block 0 completes the puts (nvshmem_quiet) and signals
//     arrived[n] = c to every (m, l); every block waits until every (m, l) signalled this rank; block 0 then
//     tells its node peers that its region is ready (a release store into each peer's header).
//  3. Receive. Every block waits until all P ranks of its node are ready, reads the per-source counts from
//     their regions (the routing of source (s, l') sits in relay (n, l')'s region), and pulls the tokens
//     routed to it over NVLink into its outputs in (source rank, source token) order, as the intranode kernel.
//  4. Finish. The last block: a node barrier (nobody of this node reads this region for call c any more),
//     then credit c to every (m, l), then calls_completed = c.
// Cached dispatch is steps 1, 2, 3 and 4 with the routing of an earlier dispatch (no routing to send).
// Combine on rank (n, l):
//  1. Stage this rank's valid y rows in its region; tell the node peers it is ready.
//  2. Relay: for every token of rank (s, l) that came into this node, sum the rows of the node's ranks that
//     hold it (float32, local index order) into a partial; put it into slot (n, t) of (s, l)'s region (or
//     keep it, s == n). After all blocks: quiet, signal arrived[n] = c to every (s, l).
//  3. Origin: wait for every other node's partials; out[t] = the partials of the nodes that received t summed
//     in node order (float32), plus bias, cast.
//  4. Finish as dispatch.
// Call numbers live in each rank's header (device memory), so CUDA-graph replay keeps them right; flags only
// grow. Blocks wait on each other (grid barriers), so the grid must be co-resident: one block per SM.
// A wait that exceeds timeout_ns fills the rank's host-mapped error record and traps.
#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>

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
// totals per destination into its counts. Also writes is_token_in_rank, invalid_ids, zeroes the per-expert
// counts (before the grid barrier, so before any block adds to them) and copies topk_idx/weights into its meta.
__device__ void route_own_tokens(const InternodeRank& g, const InternodeDispatchArgs& a,
                                 const InternodeDispatchLayout& layout) {
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
  for (int64_t j = threadIdx.x; j < experts_per_rank; j += kThreads) a.num_recv_tokens_per_expert[j] = 0;
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
                            int64_t timeout_ns) {
  const int m = threadIdx.x;
  if (m < g.num_nodes && m != g.node)
    wait_for<uint64_t>(g, ctx, &header_of(g.region)->credit[m], ctx.call - 1, InternodeOp::kDispatch,
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

// A warp receives token t of rank src (relayed by node peer src % P) into `row`: payload rows and the top-k row
// (store_received_topk).
__device__ void receive_token(const InternodeRank& g, const InternodeDispatchArgs& a,
                              const InternodeDispatchLayout& layout, int src, int64_t t, int32_t row, int lane) {
  const char* relay = data_of(g.node_regions[src % g.ranks_per_node]);
  const int source_node = src / g.ranks_per_node;
  const int num_topk = static_cast<int>(a.num_topk);
  const char* topk = relay + layout.topk_of(source_node);
  int32_t expert = -1;
  float weight = 0.f;
  if (lane < num_topk) {  // issued before the row copy so their latency overlaps it
    expert = LoadL2{}(reinterpret_cast<const int32_t*>(topk) + t * num_topk + lane);
    if (a.topk_weights) weight = LoadL2{}(reinterpret_cast<const float*>(topk + layout.weights) + t * num_topk + lane);
  }
  const char* slot = relay + layout.slot(source_node, t);
  warp_copy(row_of(a.recv_x[0], row, a.x_row_bytes[0]), slot, a.x_row_bytes[0], lane);
  if (a.num_payloads == 2)
    warp_copy(row_of(a.recv_x[1], row, a.x_row_bytes[1]), slot + a.x_row_bytes[0], a.x_row_bytes[1], lane);
  store_received_topk(a, g.rank, g.num_ranks, src, t, row, expert, weight, lane);
}

__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(const __grid_constant__ InternodeRank g, const __grid_constant__ InternodeDispatchArgs a,
                    const __grid_constant__ InternodeDispatchLayout layout, int64_t timeout_ns) {
  constexpr InternodeOp kOp = InternodeOp::kDispatch;
  __shared__ CallContext ctx;
  __shared__ int32_t counts[kMaxInternodeRanks][kMaxRanksPerNode];  // [source rank][node rank j]: its tokens for j
  __shared__ int32_t base[kMaxRanksPerNode][kMaxInternodeRanks];    // [j][source rank]: first row on j of its tokens
  __shared__ int32_t num_recv;
  const int num_ranks = g.num_ranks, ranks_per_node = g.ranks_per_node, me = g.rank, lane = threadIdx.x % 32;
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity;

  begin_call([&] { return header_of(g.region); }, ctx);
  if (blockIdx.x == 0) {
    route_own_tokens(g, a, layout);
    put_routing(g, ctx, layout, timeout_ns);
  }
  const SendRows rows{a.num_payloads, {a.x[0], a.x[1]}, {a.x_row_bytes[0], a.x_row_bytes[1]}};
  const NodesOfTopk nodes_of{a.topk_idx, static_cast<int32_t>(a.num_topk), static_cast<int32_t>(a.num_experts),
                             static_cast<int32_t>(a.num_experts / g.num_nodes)};
  send_own_tokens(g, ctx, layout, rows, gridDim.x > 1 ? 1 : 0, nodes_of, kOp, timeout_ns);
  grid_barrier(g, ctx, 0, kOp, timeout_ns);
  relay_when_arrived(g, ctx, kOp, timeout_ns);
  wait_node_ready(g, ctx, kOp, timeout_ns);

  // Counts of every source rank for every rank of this node (from the relays' regions), and their prefix sums
  // in source rank order: where each source's tokens start on each node rank.
  for (int i = threadIdx.x; i < num_ranks * ranks_per_node; i += kThreads) {
    const int src = i / ranks_per_node, j = i % ranks_per_node;
    const char* relay = data_of(g.node_regions[src % ranks_per_node]);
    counts[src][j] = LoadL2{}(reinterpret_cast<const int32_t*>(relay + layout.routing_of(src / ranks_per_node)) + j);
  }
  __syncthreads();
  if (threadIdx.x < ranks_per_node) {
    const int j = threadIdx.x;
    int32_t running = 0;
    for (int src = 0; src < num_ranks; ++src) {
      base[j][src] = running;
      running += counts[src][j];
    }
    if (j == g.local) num_recv = count_received(a, running);
  }
  __syncthreads();

  // Received rows, in (source rank, token) order (see for_each_received_pair), then the padding rows.
  for_each_received_pair(
      num_ranks, num_tokens, me,
      [&](int src, int64_t t) {
        const char* relay = data_of(g.node_regions[src % ranks_per_node]);
        const int32_t* offsets = reinterpret_cast<const int32_t*>(relay + layout.routing_of(src / ranks_per_node) +
                                                                   InternodeDispatchLayout::kOffsets);
        const int32_t offset = LoadL2{}(offsets + t * ranks_per_node + g.local);
        return offset >= 0 && base[g.local][src] + offset < capacity ? base[g.local][src] + offset : -1;
      },
      [&](int src, int64_t t, int32_t row) { receive_token(g, a, layout, src, t, row, lane); });
  write_padding_rows(a, num_ranks, num_recv);

  // Handle, relay part: for the tokens of rank (s, local) in this rank's region, their row on every node rank.
  const char* own = data_of(g.region);
  const int64_t relayed = static_cast<int64_t>(g.num_nodes) * num_tokens;
  for (int64_t i = blockIdx.x * kThreads + threadIdx.x; i < relayed; i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int source_node = static_cast<int>(i / num_tokens);
    const int src = source_node * ranks_per_node + g.local;
    const int32_t* offsets = reinterpret_cast<const int32_t*>(own + layout.routing_of(source_node) +
                                                              InternodeDispatchLayout::kOffsets) +
                             (i % num_tokens) * ranks_per_node;
    bool any = false;
    for (int j = 0; j < ranks_per_node; ++j) {
      const int32_t offset = LoadL2{}(offsets + j);
      const int64_t row = offset >= 0 ? static_cast<int64_t>(base[j][src]) + offset : capacity;
      any |= offset >= 0;
      a.relay_row[i * ranks_per_node + j] = row < capacity ? static_cast<int32_t>(row) : -1;
    }
    a.relay_token[i] = any;
  }

  finish_call(g, ctx, kOp, timeout_ns, [&] { align_expert_counts(a, num_ranks); });
}

// ---- cached dispatch -----------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1)
    cached_dispatch_kernel(const __grid_constant__ InternodeRank g,
                           const __grid_constant__ InternodeCachedDispatchArgs a,
                           const __grid_constant__ InternodeDispatchLayout layout, int64_t timeout_ns) {
  constexpr InternodeOp kOp = InternodeOp::kCachedDispatch;
  __shared__ CallContext ctx;
  const int lane = threadIdx.x % 32;
  begin_call([&] { return header_of(g.region); }, ctx);
  const SendRows rows{1, {a.x, nullptr}, {a.row_bytes, 0}};
  send_own_tokens(g, ctx, layout, rows, 0, NodesOfRanks{a.is_token_in_rank, g.num_ranks, g.ranks_per_node}, kOp,
                  timeout_ns);
  grid_barrier(g, ctx, 0, kOp, timeout_ns);
  relay_when_arrived(g, ctx, kOp, timeout_ns);
  wait_node_ready(g, ctx, kOp, timeout_ns);

  fill_cached_rows(a, g.num_ranks, [&](void* dst, int64_t src, int64_t t) {
    const int src_rank = static_cast<int>(src);
    const char* relay = data_of(g.node_regions[src_rank % g.ranks_per_node]);
    warp_copy(dst, relay + layout.slot(src_rank / g.ranks_per_node, t), a.row_bytes, lane);
  });
  finish_call(g, ctx, kOp, timeout_ns, [] {});
}

// ---- combine -------------------------------------------------------------------------------------------------------

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

// kVec elements of In per load (16 bytes where rows allow; XLA buffers and the region's rows are 16-byte
// aligned). Partials are float32, kVec per lane and step.
template <typename In, typename Bias, typename Out, int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(const __grid_constant__ InternodeRank g, const __grid_constant__ InternodeCombineArgs a,
                   const __grid_constant__ InternodeCombineLayout layout, int64_t timeout_ns) {
  constexpr InternodeOp kOp = InternodeOp::kCombine;
  using InPack = Pack<In, kVec>;
  using FloatPack = Pack<float, kVec>;
  __shared__ CallContext ctx;
  const int lane = threadIdx.x % 32, ranks_per_node = g.ranks_per_node, num_ranks = g.num_ranks;
  const int64_t num_tokens = a.num_tokens, capacity = a.capacity, vecs = a.row_elements / kVec;
  const int64_t row_bytes = a.row_elements * static_cast<int64_t>(sizeof(In));
  char* own = data_of(g.region);
  begin_call([&] { return header_of(g.region); }, ctx);

  // 1. Stage this rank's valid rows, where the node's relays read them.
  const int64_t num_pairs = num_ranks * num_tokens;
  for (int64_t row = global_warp(); row < capacity; row += num_global_warps()) {
    const int32_t src = a.recv_src_index[row];
    if (src < 0 || src >= num_pairs) continue;
    warp_copy_row<kCopyUnroll>(own + layout.staged + row * layout.staged_row_bytes, row_of(a.y, row, row_bytes),
                               row_bytes, lane, LoadNonCoherent{});
  }
  grid_barrier(g, ctx, 0, kOp, timeout_ns);
  if (blockIdx.x == 0) publish_ready(g, ctx);
  wait_node_ready(g, ctx, kOp, timeout_ns);

  // 2. Relay: partial[t] = sum over node ranks j in order of y_j[row of t] (float32 from 0) for every token of
  // rank (s, local) that came into this node; kept for s == this node, else put to (s, local).
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
    wait_for_credit(g, ctx, source_node, credited, kOp, timeout_ns, lane);
    nvshmemx_putmem_nbi_warp(own + layout.received_row(g.node, t), partial, a.row_elements * 4,
                             rail_pe(g, source_node));
  }
  grid_barrier(g, ctx, 1, kOp, timeout_ns);
  if (blockIdx.x == 0) signal_rails(g, ctx);
  wait_rails(g, ctx, kOp, timeout_ns);

  // 3. Origin: out[t] = sum over the nodes m holding t, in node order, of partial_m[t] (float32 from 0) + bias.
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
  finish_call(g, ctx, kOp, timeout_ns, [] {});
}

// ---- launches ------------------------------------------------------------------------------------------------------

template <typename In, typename Bias, typename Out>
cudaError_t launch_combine(const InternodeCall& call, const InternodeCombineArgs& args,
                           const InternodeCombineLayout& layout) {
  constexpr int kWide = 16 / sizeof(In), kNarrow = 4 / sizeof(In);  // 16-byte loads, else 4-byte ones
  if (args.row_elements % kWide == 0)
    combine_kernel<In, Bias, Out, kWide><<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, layout,
                                                                                        call.timeout_ns);
  else if (args.row_elements % kNarrow == 0)
    combine_kernel<In, Bias, Out, kNarrow><<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, layout,
                                                                                          call.timeout_ns);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace

cudaError_t internode_dispatch(const InternodeCall& call, const InternodeDispatchArgs& args) {
  const InternodeRank& g = call.group;
  if (args.num_topk < 1 || args.num_topk > kNormalMaxTopk || args.num_payloads < 1 || args.num_payloads > 2 ||
      args.num_experts % g.num_ranks != 0)
    return cudaErrorInvalidValue;
  const int64_t payload_bytes = args.x_row_bytes[0] + (args.num_payloads == 2 ? args.x_row_bytes[1] : 0);
  const InternodeDispatchLayout layout(g.num_nodes, g.ranks_per_node, args.num_tokens, args.num_topk, payload_bytes);
  if (layout.total > g.region_bytes) return cudaErrorMemoryAllocation;
  dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(g, args, layout, call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t internode_cached_dispatch(const InternodeCall& call, const InternodeCachedDispatchArgs& args) {
  const InternodeRank& g = call.group;
  const InternodeDispatchLayout layout(g.num_nodes, g.ranks_per_node, args.num_tokens, 0, args.row_bytes);
  if (layout.total > g.region_bytes) return cudaErrorMemoryAllocation;
  cached_dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(g, args, layout, call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t internode_combine(const InternodeCall& call, const InternodeCombineArgs& args) {
  return with_combine_types(args, [&](auto in, auto bias, auto out) {
    using In = typename decltype(in)::type;
    const InternodeCombineLayout layout(call.group.num_nodes, args.num_tokens, args.capacity, args.row_elements,
                                        sizeof(In));
    if (layout.total > call.group.region_bytes) return cudaErrorMemoryAllocation;
    return launch_combine<In, typename decltype(bias)::type, typename decltype(out)::type>(call, args, layout);
  });
}

}  // namespace jax_ep
#endif  // JAX_EP_WITH_NVSHMEM
