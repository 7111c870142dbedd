// Internode expert-major kernels (docs/design.md, "Internode kernels" and "Expert-major layout"): dispatch, cached
// dispatch, combine and combine's backward of the expert-major layout over N nodes of P ranks, one launch each,
// in the internode protocol (internode_call.cuh) with the expert-major work of expert_major.cuh.
//
// Dispatch: steps 1 and 2 of the rank-major internode dispatch (routing and top-k rows put to every rail peer,
// each token put once per destination node, relayed inside the node), then on every rank the expert-major steps 2
// to 5 (expert_major.cu) over every source rank's tokens as they sit in the node's relays: count the pairs per
// (source, local expert), a grid barrier, groups and offsets, then each token read once from its relay and
// written into all of its kept pair rows. The handle's relay part names, for each token of rank (s, local) that
// came into this node, the node ranks that received it: relay_row [N*T, P] holds the token's item s*T + t on each
// of them (-1 where it has no pair), the row where that rank stages its partial in the combine.
// Cached dispatch and combine's backward: steps 1 and 2 of the rank-major cached dispatch (tokens put to the nodes
// of is_token_in_rank), then expert_major.cuh's fan-out (or gradient) work from the relays.
// Combine: each rank stages the partial of every item it received (its kept pairs, weighted, summed in float32
// in pair order, rounded to y's type) at the item's row of its region; then the rank-major combine's relay and
// origin steps sum them (per node in local-rank order, then over nodes, in float32).
#include "expert_major.cuh"
#include "internode_call.cuh"

#if defined(JAX_EP_WITH_NVSHMEM)
namespace jax_ep {
namespace {

// The slot of token t of source rank s as relayed into this node: relay (s % P)'s slot for node s / P, the token's
// payload rows back to back.
__device__ __forceinline__ const char* relayed_row(const InternodeRank& g, const InternodeDispatchLayout& layout, int s,
                                                  int64_t t) {
  return data_of(g.node_regions[s % g.ranks_per_node]) + layout.slot(s / g.ranks_per_node, t);
}

// The dispatch's sources as relayed into this node: token t of source rank s in relayed_row, its top-k rows in the
// same relay's meta for node s / P.
struct RelayedInputs {
  const InternodeRank* g;
  const InternodeDispatchLayout* layout;
  const int64_t* row_bytes;  // of the payloads
  bool weighted;
  __device__ const char* relay(int s) const { return data_of(g->node_regions[s % g->ranks_per_node]); }
  __device__ const int32_t* topk(int s) const {
    return reinterpret_cast<const int32_t*>(relay(s) + layout->topk_of(s / g->ranks_per_node));
  }
  __device__ const float* weights(int s) const {
    return weighted ? reinterpret_cast<const float*>(relay(s) + layout->topk_of(s / g->ranks_per_node) +
                                                     layout->weights)
                    : nullptr;
  }
  __device__ const void* row(int s, int p, int64_t t) const {
    return relayed_row(*g, *layout, s, t) + (p == 1 ? row_bytes[0] : 0);
  }
};

__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(const __grid_constant__ InternodeRank g, const __grid_constant__ InternodeExpertMajorDispatchArgs a,
                    const __grid_constant__ InternodeDispatchLayout layout, int64_t timeout_ns) {
  constexpr InternodeOp kOp = InternodeOp::kExpertMajorDispatch;
  __shared__ CallContext ctx;
  const ExpertMajorDispatchArgs& em = a.rows;
  const int ranks_per_node = g.ranks_per_node;
  begin_call([&] { return header_of(g.region); }, ctx);
  if (blockIdx.x == 0) {
    route_own_tokens(g, em, layout, nullptr);
    put_routing(g, ctx, layout, timeout_ns, InternodeOp::kExpertMajorDispatch);
  }
  const SendRows rows{em.num_payloads, {em.x[0], em.x[1]}, {em.x_row_bytes[0], em.x_row_bytes[1]}};
  const NodesOfTopk nodes_of{em.topk_idx, static_cast<int32_t>(em.num_topk), static_cast<int32_t>(em.num_experts),
                             static_cast<int32_t>(em.num_experts / g.num_nodes)};
  send_own_tokens(g, ctx, layout, rows, gridDim.x > 1 ? 1 : 0, nodes_of, kOp, timeout_ns);
  grid_barrier(g, ctx, 0, kOp, timeout_ns);
  relay_when_arrived(g, ctx, kOp, timeout_ns);
  wait_node_ready(g, ctx, kOp, timeout_ns);

  place_pairs<LoadL2>(em, g.num_ranks, g.rank, RelayedInputs{&g, &layout, em.x_row_bytes, em.topk_weights != nullptr},
                      [&] { grid_barrier(g, ctx, 1, kOp, timeout_ns); }, [] {});

  // Handle, relay part: for each token of rank (s, local) in this rank's region, its item on every node rank that
  // received it (from the routing's offsets: the rank-major rows it would have there).
  const char* own = data_of(g.region);
  const int64_t num_tokens = em.num_tokens, relayed = static_cast<int64_t>(g.num_nodes) * num_tokens;
  for (int64_t i = blockIdx.x * kThreads + threadIdx.x; i < relayed; i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int source_node = static_cast<int>(i / num_tokens);
    const int64_t t = i % num_tokens;
    const int64_t item = (static_cast<int64_t>(source_node) * ranks_per_node + g.local) * num_tokens + t;
    const int32_t* offsets = reinterpret_cast<const int32_t*>(own + layout.routing_of(source_node) +
                                                              InternodeDispatchLayout::kOffsets) +
                             t * ranks_per_node;
    bool any = false;
    for (int j = 0; j < ranks_per_node; ++j) {
      const bool received = LoadL2{}(offsets + j) >= 0;
      any |= received;
      a.relay_row[i * ranks_per_node + j] = received ? static_cast<int32_t>(item) : -1;
    }
    a.relay_token[i] = any;
  }
  finish_call(g, ctx, kOp, timeout_ns, [] {});
}

// Steps 1 and 2 of a cached dispatch of x [T, row_bytes] along is_token_in_rank: every rank's tokens readable in
// its node's relays after it.
__device__ void send_and_relay(const InternodeRank& g, CallContext& ctx, const InternodeDispatchLayout& layout,
                               const void* x, int64_t row_bytes, const bool* is_token_in_rank, InternodeOp op,
                               int64_t timeout_ns) {
  begin_call([&] { return header_of(g.region); }, ctx);
  const SendRows rows{1, {x, nullptr}, {row_bytes, 0}};
  send_own_tokens(g, ctx, layout, rows, 0, NodesOfRanks{is_token_in_rank, g.num_ranks, g.ranks_per_node}, op,
                  timeout_ns);
  grid_barrier(g, ctx, 0, op, timeout_ns);
  relay_when_arrived(g, ctx, op, timeout_ns);
  wait_node_ready(g, ctx, op, timeout_ns);
}

__global__ void __launch_bounds__(kThreads, 1)
    cached_dispatch_kernel(const __grid_constant__ InternodeRank g,
                           const __grid_constant__ InternodeExpertMajorCachedDispatchArgs a,
                           const __grid_constant__ InternodeDispatchLayout layout, int64_t timeout_ns) {
  constexpr InternodeOp kOp = InternodeOp::kExpertMajorCachedDispatch;
  __shared__ CallContext ctx;
  send_and_relay(g, ctx, layout, a.rows.x, a.rows.row_bytes, a.is_token_in_rank, kOp, timeout_ns);
  fan_out_cached_rows<LoadL2>(a.rows, g.num_ranks, g.rank,
                              [&](int s, int64_t t) { return relayed_row(g, layout, s, t); });
  finish_call(g, ctx, kOp, timeout_ns, [] {});
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    combine_backward_kernel(const __grid_constant__ InternodeRank g,
                            const __grid_constant__ InternodeExpertMajorCombineBackwardArgs a,
                            const __grid_constant__ InternodeDispatchLayout layout, int64_t timeout_ns) {
  constexpr InternodeOp kOp = InternodeOp::kExpertMajorCachedDispatch;
  __shared__ CallContext ctx;
  send_and_relay(g, ctx, layout, a.gradients.rows.x, a.gradients.rows.row_bytes, a.is_token_in_rank, kOp, timeout_ns);
  write_combine_gradients<T, LoadL2>(a.gradients, g.num_ranks, g.rank,
                                     [&](int s, int64_t t) { return relayed_row(g, layout, s, t); });
  finish_call(g, ctx, kOp, timeout_ns, [] {});
}

// ---- combine -------------------------------------------------------------------------------------------------------

// Step 1: the partial of every item this rank received (pair_row's first entry not -1: a token with only dropped
// pairs has a zero partial) into its staged row (item i at row i), kVec elements of In per lane and step, as the
// intranode combine's first pass makes them (add_source_vectors).
template <typename In, int kVec>
__device__ void stage_partials(const InternodeRank& g, const ExpertMajorCombineArgs& a,
                               const InternodeCombineLayout& layout) {
  using InPack = Pack<In, kVec>;
  const int lane = threadIdx.x % 32;
  const int64_t items = static_cast<int64_t>(g.num_ranks) * a.num_tokens;
  const int vecs = static_cast<int>(a.row_elements / kVec);  // a row's vectors (int: fewer registers)
  const int64_t columns = a.num_pair_columns, capacity = a.capacity;
  const InPack* y = static_cast<const InPack*>(a.y);
  char* staged = data_of(g.region) + layout.staged;
  for (int64_t item = global_warp(); item < items; item += num_global_warps()) {
    const int32_t lane_pair = lane < columns ? a.pair_row[item * columns + lane] : -1;
    if (__shfl_sync(kFullMask, lane_pair, 0) < 0) continue;  // no pair here: nothing staged, none read
    // A dispatch writes kept pairs first, but a handle made by hand may not: the kept lanes wherever they are.
    const uint32_t kept_lanes = __ballot_sync(kFullMask, lane_pair >= 0 && lane_pair < capacity);
    const PairSources<InPack> pairs = pair_sources(kept_lanes, lane_pair, y, vecs, a.weights, lane);
    In* out = reinterpret_cast<In*>(staged + item * layout.staged_row_bytes);
    for (int first = 0; first < vecs; first += kWarpPieceVecs) {
      const int v0 = first + lane;
      float sum[kSourceUnroll][kVec] = {};
      add_source_vectors<kPairsAtOnce, In, kVec, kSourceUnroll, LoadNonCoherent>(
          sum, pairs.lane_row, pairs.lane_weight, a.weights != nullptr, 0, __popc(kept_lanes), vecs, v0);
#pragma unroll
      for (int u = 0; u < kSourceUnroll; ++u)
        if (v0 + 32 * u < vecs) store_partial<In, In, kVec>(sum[u], out, v0 + 32 * u);
    }
  }
}

template <typename In, typename Bias, typename Out, int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(const __grid_constant__ InternodeRank g, const __grid_constant__ InternodeExpertMajorCombineArgs a,
                   const __grid_constant__ InternodeCombineLayout layout, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  begin_call([&] { return header_of(g.region); }, ctx);
  stage_partials<In, kVec>(g, a.partials, layout);
  relay_and_sum_home<In, Bias, Out, kVec>(g, ctx, a.sums, layout, InternodeOp::kExpertMajorCombine, timeout_ns);
}

// ---- launches ------------------------------------------------------------------------------------------------------

template <typename In, typename Bias, typename Out>
cudaError_t launch_combine(const InternodeCall& call, const InternodeExpertMajorCombineArgs& args,
                           const InternodeCombineLayout& layout) {
  return with_row_vector<In>(args.sums.row_elements, [&](auto vec) {
    combine_kernel<In, Bias, Out, decltype(vec)::value>
        <<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, layout, call.timeout_ns);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t internode_expert_major_dispatch(const InternodeCall& call, const InternodeExpertMajorDispatchArgs& args) {
  const InternodeRank& g = call.group;
  const ExpertMajorDispatchArgs& a = args.rows;
  if (!dispatch_args_ok(a, g.num_ranks, grid_size(call))) return cudaErrorInvalidValue;
  const int64_t payload_bytes = a.x_row_bytes[0] + (a.num_payloads == 2 ? a.x_row_bytes[1] : 0);
  const InternodeDispatchLayout layout(g.num_nodes, g.ranks_per_node, a.num_tokens, a.num_topk, payload_bytes);
  if (layout.total > g.region_bytes) return cudaErrorMemoryAllocation;
  dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(g, args, layout, call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t internode_expert_major_cached_dispatch(const InternodeCall& call,
                                                   const InternodeExpertMajorCachedDispatchArgs& args) {
  const InternodeRank& g = call.group;
  if (!pair_columns_ok(args.rows.num_pair_columns)) return cudaErrorInvalidValue;
  const InternodeDispatchLayout layout(g.num_nodes, g.ranks_per_node, args.rows.num_tokens, 0, args.rows.row_bytes);
  if (layout.total > g.region_bytes) return cudaErrorMemoryAllocation;
  cached_dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(g, args, layout, call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t internode_expert_major_combine_backward(const InternodeCall& call,
                                                    const InternodeExpertMajorCombineBackwardArgs& args) {
  const InternodeRank& g = call.group;
  const ExpertMajorCachedDispatchArgs& rows = args.gradients.rows;
  if (!combine_backward_args_ok(args.gradients)) return cudaErrorInvalidValue;
  const InternodeDispatchLayout layout(g.num_nodes, g.ranks_per_node, rows.num_tokens, 0, rows.row_bytes);
  if (layout.total > g.region_bytes) return cudaErrorMemoryAllocation;
  auto launch = [&](auto type) {
    combine_backward_kernel<typename decltype(type)::type>
        <<<grid_size(call), kThreads, 0, call.stream>>>(g, args, layout, call.timeout_ns);
    return cudaGetLastError();
  };
  return with_float_type(args.gradients.type, launch);
}

cudaError_t internode_expert_major_combine(const InternodeCall& call, const InternodeExpertMajorCombineArgs& args) {
  const InternodeRank& g = call.group;
  const ExpertMajorCombineArgs& p = args.partials;
  if (!pair_columns_ok(p.num_pair_columns) || args.sums.capacity != static_cast<int64_t>(g.num_ranks) * p.num_tokens)
    return cudaErrorInvalidValue;
  return with_combine_types(args.sums, [&](auto in, auto bias, auto out) {
    using In = typename decltype(in)::type;
    const InternodeCombineLayout layout(g.num_nodes, args.sums.num_tokens, args.sums.capacity, args.sums.row_elements,
                                        sizeof(In));
    if (layout.total > g.region_bytes) return cudaErrorMemoryAllocation;
    return launch_combine<In, typename decltype(bias)::type, typename decltype(out)::type>(call, args, layout);
  });
}

}  // namespace jax_ep
#endif  // JAX_EP_WITH_NVSHMEM
