// Intranode expert-major kernels (docs/design.md, "Expert-major layout"): dispatch, cached dispatch and combine of
// the layout whose rows are (token, local expert) pairs grouped by local expert, each group in (source rank, source
// token) order. Each is one launch in the call protocol of intranode_call.cuh (arrival barrier, the op's work,
// release barrier; the combine needs none: CallEnd::kPeersDone), in both process models.
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
// Combine: each rank computes the partial of every token it received from its pair rows of y, rounded to y's type,
// and stores it into the token's home rank (slots of (R - 1) * T rows there, one region per sender; its own tokens'
// into out); after a barrier of the ranks each adds its tokens' partials in rank order. (A partial exists only
// where its pairs are, so it is pushed, whatever Config.combine says.) Pair rows are read straight into registers,
// many in flight per lane (see kSourceUnroll).
#include "expert_major.cuh"
#include "intranode_call.cuh"
#include "intranode_state.h"

namespace jax_ep {
namespace {

// ---- dispatch ----------------------------------------------------------------------------------------------------

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


// The dispatch's sources: the inputs each rank published (payloads, then topk_idx, then topk_weights).
struct PeerInputs {
  const IntranodeView* views;
  const int64_t* row_bytes;
  __device__ const int32_t* topk(int s) const { return static_cast<const int32_t*>(views[s].pointers[2]); }
  __device__ const float* weights(int s) const { return static_cast<const float*>(views[s].pointers[3]); }
  __device__ const void* row(int s, int p, int64_t t) const { return row_of(views[s].pointers[p], t, row_bytes[p]); }
};

__global__ void __launch_bounds__(kThreads, 1)
    expert_major_dispatch_kernel(const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorDispatchArgs a,
                                 const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorDispatch, timeout_ns);
  place_pairs<LoadNonCoherent>(
      a, g.num_ranks, g.rank, PeerInputs{ctx.views, a.x_row_bytes},
      [&] { sync_grid(g, ctx.call, 1, IntranodeOp::kExpertMajorDispatch, timeout_ns); },
      [&] { route_own_tokens(a, g.num_ranks); });
  finish_call(g, ctx, IntranodeOp::kExpertMajorDispatch, timeout_ns, [] {});
}

// ---- cached dispatch and the combine's backward ---------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1) expert_major_cached_dispatch_kernel(
    const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorCachedDispatchArgs a,
    const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns);
  fan_out_cached_rows<LoadNonCoherent>(a, g.num_ranks, g.rank,
                                       [&](int s, int64_t t) { return row_of(ctx.views[s].pointers[0], t, a.row_bytes); });
  finish_call(g, ctx, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns, [] {});
}

// Combine's backward: write_combine_gradients (expert_major.cuh) from the peers' d_out.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) expert_major_combine_backward_kernel(
    const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorCombineBackwardArgs a,
    const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorCachedDispatch, timeout_ns);
  write_combine_gradients<T, LoadNonCoherent>(
      a, g.num_ranks, g.rank, [&](int s, int64_t t) { return row_of(ctx.views[s].pointers[0], t, a.rows.row_bytes); });
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

// A job of a pass (warps take them from their block's BlockJobs).
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
  uint32_t kept;   // pass 1: the lanes holding its kept pairs here (any columns of pair_row), none if !writes
  int pairs;       // pass 1: how many (popcount of kept)
  uint32_t peers;  // pass 2: the other ranks that hold a partial of the token
  bool me_holds;   // pass 2: this rank received the token
  bool writes;     // pass 1: this rank received the item; pass 2: a valid token
};

template <bool kOwnTokens>
__device__ __forceinline__ JobShape shape_of(const CombineJob& j, const ExpertMajorCombineArgs& a, int me) {
  JobShape shape;
  const uint32_t holders = __ballot_sync(kFullMask, j.held);
  shape.peers = holders & ~(1u << me);
  shape.me_holds = (holders >> me) & 1u;
  shape.writes = kOwnTokens ? j.valid : j.valid && __shfl_sync(kFullMask, j.pair, 0) != -1;
  // A dispatch writes kept pairs first, but a handle made by hand may not: the kept lanes are found wherever they
  // are, and a job that writes nothing reads nothing.
  const uint32_t kept = __ballot_sync(kFullMask, j.pair >= 0 && j.pair < a.capacity);
  shape.kept = shape.writes ? kept : 0u;
  shape.pairs = __popc(shape.kept);
  return shape;
}

// Rows are read straight into registers, kSourceUnroll vectors of each of kPairsAtOnce pair rows (pass 1) or
// kPartialsAtOnce partials (pass 2) in flight per lane (more spill at the 128 registers a thread that one block of
// kThreads per SM leaves: ~400 bytes at 4 partials).
constexpr int kPartialsAtOnce = 2;
// Pieces of a row asked of L2 ahead of the one a warp loads (prefetch_ahead); 2 measured best (docs/perf-log.md).
constexpr int kPrefetchPieces = 2;

// A lane's row: its pieces kPrefetchPieces ahead of the one at `first` into L2 (at the first piece, every piece up
// to there), while the warp waits for this piece's loads, which hold every register it can spare.
template <typename Pack>
__device__ __forceinline__ void prefetch_ahead(const Pack* row, int first, int vecs) {
  for (int ahead = first == 0 ? kWarpPieceVecs : first + kPrefetchPieces * kWarpPieceVecs;
       ahead <= first + kPrefetchPieces * kWarpPieceVecs && ahead < vecs; ahead += kWarpPieceVecs)
    prefetch_to_l2(row + ahead, static_cast<uint32_t>(min(kWarpPieceVecs, vecs - ahead) * sizeof(Pack)));
}

// One pass over rows of whole 16-byte vectors (kVec elements of In each).
template <bool kOwnTokens, typename In, typename Bias, typename Out, int kVec>
__device__ void combine_pass(const IntranodeRank& g, const CallContext& ctx, const ExpertMajorCombineArgs& a) {
  using InPack = Pack<In, kVec>;
  const int num_ranks = g.num_ranks, me = g.rank, lane = threadIdx.x % 32;
  const int vecs = static_cast<int>(a.row_elements / kVec);  // a row's vectors (int: fewer registers)
  const bool weighted = a.weights != nullptr;
  const InPack* y = static_cast<const InPack*>(a.y);
  const InPack* own_slots = static_cast<const InPack*>(ctx.views[me].pointers[0]);
  Out* out = static_cast<Out*>(a.out);
  __shared__ unsigned long long next_job;
  const BlockJobs jobs(kOwnTokens ? a.num_tokens : num_ranks * a.num_tokens, &next_job);
  CombineJob job = load_job<kOwnTokens>(a, num_ranks, me, jobs.take(lane), lane);
  while (job.valid) {
    // The next job's pair_row entries load while this one runs.
    const CombineJob next = load_job<kOwnTokens>(a, num_ranks, me, jobs.take(lane), lane);
    const JobShape shape = shape_of<kOwnTokens>(job, a, me);
    if (!shape.writes) {
    } else if constexpr (!kOwnTokens) {  // the item's partial: into its home rank's slot for this rank, or out[t]
      const PairSources<InPack> pairs = pair_sources(shape.kept, job.pair, y, vecs, a.weights, lane);
      In* slot = job.home == me ? nullptr
                                : static_cast<In*>(const_cast<void*>(ctx.views[job.home].pointers[0])) +
                                      (slot_region(me, job.home) * a.num_tokens + job.token) * a.row_elements;
      for (int first = 0; first < vecs; first += kWarpPieceVecs) {
        const int v0 = first + lane;
        if (lane < shape.pairs) prefetch_ahead(pairs.lane_row, first, vecs);
        float partial[kSourceUnroll][kVec] = {};
        add_source_vectors<kPairsAtOnce, In, kVec, kSourceUnroll, LoadNonCoherent>(
            partial, pairs.lane_row, pairs.lane_weight, weighted, 0, shape.pairs, vecs, v0);
#pragma unroll
        for (int u = 0; u < kSourceUnroll; ++u) {
          if (v0 + 32 * u >= vecs) break;
          if (job.home == me)
            store_partial<In, Out, kVec>(partial[u], out + job.token * a.row_elements, v0 + 32 * u);
          else
            store_partial<In, In, kVec>(partial[u], slot, v0 + 32 * u);
        }
      }
    } else {  // the holders' partials in rank order (this rank's from out[t], the peers' from slots)
      const uint32_t holders = shape.peers | (shape.me_holds ? 1u << me : 0u);
      const int count = __popc(holders), r = lane < count ? nth_set_bit(holders, lane) : me;
      const Pack<Out, kVec>* mine = reinterpret_cast<const Pack<Out, kVec>*>(out + job.token * a.row_elements);
      const InPack* lane_row = r == me ? reinterpret_cast<const InPack*>(mine)
                                       : own_slots + (slot_region(r, me) * a.num_tokens + job.token) * vecs;
      // Where Out is In, this rank's partial is one more source; else (float32 out) it is added between the others.
      constexpr bool kMineIsSource = std::is_same_v<In, Out>;
      const int mine_at = shape.me_holds && !kMineIsSource ? __popc(holders & lanes_below(me)) : count;
      for (int first = 0; first < vecs; first += kWarpPieceVecs) {
        const int v0 = first + lane;
        if (lane < count) prefetch_ahead(lane_row, first, vecs);
        if constexpr (!kMineIsSource)
          if (mine_at < count && lane == 31) prefetch_ahead(mine, first, vecs);  // lane 31: no partial's lane
        float acc[kSourceUnroll][kVec] = {};
        add_source_vectors<kPartialsAtOnce, In, kVec, kSourceUnroll, LoadL2>(acc, lane_row, 1.f, false, 0, mine_at,
                                                                             vecs, v0);
        if constexpr (!kMineIsSource) {
          if (mine_at < count) {  // every lane's `mine` is this rank's partial
            add_sources_at_once<1, Out, kVec, kSourceUnroll, LoadL2>(acc, mine, 1.f, false, 0, vecs, v0);
            add_source_vectors<kPartialsAtOnce, In, kVec, kSourceUnroll, LoadL2>(acc, lane_row, 1.f, false,
                                                                                 mine_at + 1, count, vecs, v0);
          }
        }
#pragma unroll
        for (int u = 0; u < kSourceUnroll; ++u)
          if (v0 + 32 * u < vecs)
            add_bias_and_store(acc[u], static_cast<const Bias*>(a.bias), out, a.row_elements, job.token, v0 + 32 * u);
      }
    }
    job = next;
  }
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
        for (uint32_t todo = shape.kept; todo; todo &= todo - 1) {
          const int64_t row = __shfl_sync(kFullMask, job.pair, __ffs(todo) - 1);
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

// kWholeVectors: rows of whole 16-byte vectors; else rows read an element at a time.
template <typename In, typename Bias, typename Out, bool kWholeVectors>
__global__ void __launch_bounds__(kThreads, 1)
    expert_major_combine_kernel(const __grid_constant__ IntranodeRank g, const __grid_constant__ ExpertMajorCombineArgs a,
                                const __grid_constant__ StagePlan plan, int64_t timeout_ns) {
  __shared__ CallContext ctx;
  publish_inputs_and_wait(g, ctx, plan, IntranodeOp::kExpertMajorCombine, timeout_ns);
  if constexpr (kWholeVectors) {
    constexpr int kVec = 16 / sizeof(In);
    combine_pass<false, In, Bias, Out, kVec>(g, ctx, a);
    exchange_partials(g, ctx, timeout_ns);
    combine_pass<true, In, Bias, Out, kVec>(g, ctx, a);
  } else {
    combine_pass_by_element<false, In, Bias, Out>(g, ctx, a);
    exchange_partials(g, ctx, timeout_ns);
    combine_pass_by_element<true, In, Bias, Out>(g, ctx, a);
  }
  finish_call(g, ctx, IntranodeOp::kExpertMajorCombine, timeout_ns, [] {}, CallEnd::kPeersDone);
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
  auto launch = [&](auto* kernel) {
    kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
    return cudaGetLastError();
  };
  // XLA's buffers are 16-byte aligned: so is every row where the size is.
  return row_bytes % 16 == 0 ? launch(expert_major_combine_kernel<In, Bias, Out, true>)
                             : launch(expert_major_combine_kernel<In, Bias, Out, false>);
}

}  // namespace

cudaError_t intranode_expert_major_dispatch(const IntranodeCall& call, const ExpertMajorDispatchArgs& args) {
  const int ranks = call.group.num_ranks;
  if (!dispatch_args_ok(args, ranks, grid_size(call))) return cudaErrorInvalidValue;
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
  if (!pair_columns_ok(args.num_pair_columns)) return cudaErrorInvalidValue;
  StagePlan plan;
  if (!plan_cached_dispatch(call.group, args.x, args.num_tokens, args.row_bytes, &plan)) return cudaErrorMemoryAllocation;
  expert_major_cached_dispatch_kernel<<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan,
                                                                                     call.timeout_ns);
  return cudaGetLastError();
}

cudaError_t intranode_expert_major_combine_backward(const IntranodeCall& call,
                                                    const ExpertMajorCombineBackwardArgs& args) {
  const ExpertMajorCachedDispatchArgs& rows = args.rows;
  if (!combine_backward_args_ok(args)) return cudaErrorInvalidValue;
  StagePlan plan;
  if (!plan_cached_dispatch(call.group, rows.x, rows.num_tokens, rows.row_bytes, &plan)) return cudaErrorMemoryAllocation;
  auto launch = [&](auto type) {
    expert_major_combine_backward_kernel<typename decltype(type)::type>
        <<<grid_size(call), kThreads, 0, call.stream>>>(call.group, args, plan, call.timeout_ns);
    return cudaGetLastError();
  };
  return with_float_type(args.type, launch);
}

cudaError_t intranode_expert_major_combine(const IntranodeCall& call, const ExpertMajorCombineArgs& args) {
  const bool ok =
      pair_columns_ok(args.num_pair_columns) && (call.group.staged || call.group.num_ranks == 1 || args.slots);
  if (!ok) return cudaErrorInvalidValue;
  return with_combine_types(args, [&](auto in, auto bias, auto out) {
    return launch_combine<typename decltype(in)::type, typename decltype(bias)::type, typename decltype(out)::type>(
        call, args);
  });
}

}  // namespace jax_ep
