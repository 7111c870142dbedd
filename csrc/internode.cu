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
#include "internode_call.cuh"

#if defined(JAX_EP_WITH_NVSHMEM)
namespace jax_ep {
namespace {

// ---- dispatch (continued) ------------------------------------------------------------------------------------------

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
    route_own_tokens(g, a, layout, a.num_recv_tokens_per_expert);
    put_routing(g, ctx, layout, timeout_ns, InternodeOp::kDispatch);
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

template <typename In, typename Bias, typename Out, int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(const __grid_constant__ InternodeRank g, const __grid_constant__ InternodeCombineArgs a,
                   const __grid_constant__ InternodeCombineLayout layout, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  const int lane = threadIdx.x % 32;
  const int64_t capacity = a.capacity, row_bytes = a.row_elements * static_cast<int64_t>(sizeof(In));
  char* own = data_of(g.region);
  begin_call([&] { return header_of(g.region); }, ctx);

  // 1. Stage this rank's valid rows, where the node's relays read them.
  const int64_t num_pairs = static_cast<int64_t>(g.num_ranks) * a.num_tokens;
  for (int64_t row = global_warp(); row < capacity; row += num_global_warps()) {
    const int32_t src = a.recv_src_index[row];
    if (src < 0 || src >= num_pairs) continue;
    warp_copy_row<kCopyUnroll>(own + layout.staged + row * layout.staged_row_bytes, row_of(a.y, row, row_bytes),
                               row_bytes, lane, LoadNonCoherent{});
  }
  relay_and_sum_home<In, Bias, Out, kVec>(g, ctx, a, layout, InternodeOp::kCombine, timeout_ns);
}

// ---- launches ------------------------------------------------------------------------------------------------------

template <typename In, typename Bias, typename Out>
cudaError_t launch_combine(const InternodeCall& call, const InternodeCombineArgs& args,
                           const InternodeCombineLayout& layout) {
  return with_row_vector<In>(args.row_elements, [&](auto vec) {
    combine_kernel<In, Bias, Out, decltype(vec)::value>
        <<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, layout, call.timeout_ns);
    return cudaGetLastError();
  });
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
