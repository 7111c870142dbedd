// The call protocol of the intranode normal-mode kernels (intranode.cu: the rank-major ops; expert_major.cu: the
// expert-major ops), described at the top of intranode.cu: the call number, the staging of inputs in a group
// spanning processes, the arrival barrier that publishes each rank's view, a barrier of this rank's blocks, and the
// release barrier that ends a call. Internal linkage, as device_common.cuh.
#pragma once
#include <cstdint>
#include <type_traits>

#include "api.h"
#include "call_frame.cuh"
#include "device_common.cuh"
#include "intranode_state.h"

namespace jax_ep {
namespace {

// ---- memory access ---------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T load_nc(const T* ptr) {
  return LoadNonCoherent{}(ptr);
}

__device__ void warp_copy_row(void* dst, const void* src, int64_t bytes, int lane) {
  warp_copy_row<kCopyUnroll>(dst, src, bytes, lane, LoadNonCoherent{});
}

// ---- call synchronisation ----------------------------------------------------------------------------------

struct CallContext {  // per block, in shared memory
  uint64_t call;
  IntranodeView views[kMaxIntranodeRanks];
  bool last_block;
};

__device__ __forceinline__ void wait_for_flag(const IntranodeRank& g, const uint64_t* flag, uint64_t call,
                                              IntranodeOp op, IntranodeWait wait, int peer, int64_t timeout_ns) {
  wait_at_least(flag, call, timeout_ns, [&](uint64_t seen, int64_t waited) {
    fail_on_timeout(&g.states[g.rank]->error_claimed, g.error, g.rank, static_cast<int32_t>(op),
                    static_cast<int32_t>(wait), peer, call, seen, waited);
  });
}

// Staged groups: one input region copied into this rank's workspace before the arrival, row by row (a row of
// an indexed region is copied only where valid_index[row] is in [0, valid_limit): combine's padding rows).
struct StageRegion {
  const void* src;
  void* dst;
  int64_t rows, row_bytes;
  const int32_t* valid_index;
  int64_t valid_limit;
};

struct StagePlan {
  int32_t num_regions;  // 0 unless the group is staged
  StageRegion regions[kMaxPublishedPointers];
  const void* published[kMaxPublishedPointers];  // what block 0 publishes: pointers, or workspace offsets
};

// Every block, before the arrival: copy this block's share of the staged rows, then count the block staged.
__device__ __forceinline__ void stage_inputs(const IntranodeRank& g, const StagePlan& plan) {
  if (plan.num_regions == 0) return;
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < plan.num_regions; ++i) {
    const StageRegion& region = plan.regions[i];
    for (int64_t row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < region.rows;
         row += gridDim.x * (kThreads / 32)) {
      if (region.valid_index) {
        const int32_t index = region.valid_index[row];
        if (index < 0 || index >= region.valid_limit) continue;
      }
      warp_copy_row(row_of(region.dst, row, region.row_bytes), row_of(region.src, row, region.row_bytes),
                    region.row_bytes, lane);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&g.states[g.rank]->blocks_staged, 1u);
  }
}

// Block 0, before it publishes in a staged group: every block of this rank copied its share.
__device__ __forceinline__ void wait_for_staging(const IntranodeRank& g, const StagePlan& plan, uint64_t call,
                                                 IntranodeOp op, int64_t timeout_ns) {
  if (plan.num_regions == 0 || threadIdx.x != 0) return;
  const unsigned* staged = &g.states[g.rank]->blocks_staged;
  const uint64_t start = now_ns();
  unsigned seen;
  while ((seen = atomicAdd(const_cast<unsigned*>(staged), 0u)) < gridDim.x) {
    const int64_t waited = static_cast<int64_t>(now_ns() - start);
    if (waited > timeout_ns)
      fail_on_timeout(&g.states[g.rank]->error_claimed, g.error, g.rank, static_cast<int32_t>(op),
                      static_cast<int32_t>(IntranodeWait::kStaging), g.rank, call, seen, waited);
  }
  __threadfence();
}

// Step 2 (block 0, once this rank's view is written and every thread of the block passed a barrier).
__device__ __forceinline__ void signal_arrival(const IntranodeRank& g, const CallContext& ctx) {
  if (threadIdx.x < g.num_ranks) {
    __threadfence_system();
    store_release_sys(&g.states[threadIdx.x]->arrived[g.rank], ctx.call);
  }
}

// Step 3 (every block): afterwards ctx.views holds every rank's view.
__device__ __forceinline__ void wait_for_arrivals(const IntranodeRank& g, CallContext& ctx, IntranodeOp op,
                                                  int64_t timeout_ns) {
  if (threadIdx.x < g.num_ranks) {
    const int peer = threadIdx.x;
    wait_for_flag(g, &g.states[g.rank]->arrived[peer], ctx.call, op, IntranodeWait::kArrival, peer, timeout_ns);
    const volatile IntranodeView& view = g.states[peer]->view;
    for (int i = 0; i < kMaxPublishedPointers; ++i) {
      const void* address = view.pointers[i];
      ctx.views[peer].pointers[i] =
          g.staged && address ? g.workspaces[peer] + reinterpret_cast<uintptr_t>(address) : address;
    }
    for (int r = 0; r < kMaxIntranodeRanks; ++r) ctx.views[peer].counts[r] = view.counts[r];
  }
  __syncthreads();
}

// How a call ends. kReleaseBarrier: step 5 as intranode.cu describes it. kPeersDone: no release barrier, for an
// op after whose last wait on the peers none of them touches this rank's memory in the call (the expert-major
// combine: every peer stored its partials here, and each of its blocks read this rank's view, before it raised
// the flag this rank waits for before its second pass). A peer's next call then stores into this rank only after
// this rank arrived for it, so after this call ended; its skew stays bounded the same way.
enum class CallEnd { kReleaseBarrier, kPeersDone };

// Step 5 (every block, after its work). The last block runs `epilogue` (with every other block's writes
// visible) before the release barrier.
template <typename Epilogue>
__device__ __forceinline__ void finish_call(const IntranodeRank& g, CallContext& ctx, IntranodeOp op,
                                            int64_t timeout_ns, Epilogue epilogue,
                                            CallEnd end = CallEnd::kReleaseBarrier) {
  IntranodeState* own = g.states[g.rank];
  const auto release = [&] {
    if (end == CallEnd::kReleaseBarrier && threadIdx.x < g.num_ranks) {
      const int peer = threadIdx.x;
      __threadfence_system();
      store_release_sys(&g.states[peer]->released[g.rank], ctx.call);
      wait_for_flag(g, &own->released[peer], ctx.call, op, IntranodeWait::kRelease, peer, timeout_ns);
    }
    __syncthreads();
  };
  end_call(own, ctx, epilogue, release, [](IntranodeState* state) {
    state->blocks_staged = 0;
    state->blocks_synced = 0;
    state->combine_tickets = 0;
  });
}

// Steps 1-3 of an op whose view is its published input addresses and, where `counts` is given (block 0's shared
// memory, written before this call), counts (cached dispatch, combine).
__device__ __forceinline__ void publish_inputs_and_wait(const IntranodeRank& g, CallContext& ctx, const StagePlan& plan,
                                                        IntranodeOp op, int64_t timeout_ns,
                                                        const int32_t* counts = nullptr) {
  begin_call([&] { return g.states[g.rank]; }, ctx);
  stage_inputs(g, plan);
  if (blockIdx.x == 0) {
    wait_for_staging(g, plan, ctx.call, op, timeout_ns);
    if (threadIdx.x == 0) {
      IntranodeView& view = g.states[g.rank]->view;
      for (int i = 0; i < kMaxPublishedPointers; ++i) view.pointers[i] = plan.published[i];
      if (counts)
        for (int r = 0; r < g.num_ranks; ++r) view.counts[r] = counts[r];
    }
    __syncthreads();
    signal_arrival(g, ctx);
  }
  wait_for_arrivals(g, ctx, op, timeout_ns);
}

// Every block of this rank's grid, between two phases of one call: returns once every block has arrived here, so
// that each block reads what the others wrote before (global memory, fenced). `round` counts the call's grid
// barriers from 1 (the counter is reset with the call's others at its end).
__device__ __forceinline__ void sync_grid(const IntranodeRank& g, uint64_t call, uint32_t round, IntranodeOp op,
                                          int64_t timeout_ns) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* synced = &g.states[g.rank]->blocks_synced;
    __threadfence();
    atomicAdd(synced, 1u);
    const uint32_t target = round * gridDim.x;
    const uint64_t start = now_ns();
    unsigned seen;
    while ((seen = atomicAdd(synced, 0u)) < target) {
      const int64_t waited = static_cast<int64_t>(now_ns() - start);
      if (waited > timeout_ns)
        fail_on_timeout(&g.states[g.rank]->error_claimed, g.error, g.rank, static_cast<int32_t>(op),
                        static_cast<int32_t>(IntranodeWait::kGrid), g.rank, call, seen, waited);
    }
    __threadfence();
  }
  __syncthreads();
}

// Slot region of sender `from` on home rank `to` (from != to): R - 1 regions of T rows each.
__device__ __forceinline__ int64_t slot_region(int from, int to) { return from < to ? from : from - 1; }

// ---- host side ---------------------------------------------------------------------------------------------

// Host side of a StagePlan: in a single-process group every input is published as its pointer; in a staged
// group each input is copied to its region of this rank's workspace (offsets from the op's staging struct in
// kernel_limits.h, which also sizes Buffers for jax_ep) and published as its offset.
class StagePlanBuilder {
 public:
  explicit StagePlanBuilder(const IntranodeRank& group) : group_(group) {}

  // Publishes input `src` ([rows, row_bytes]; null stays null) as the next view address; a staged group copies it
  // to workspace offset `staged_at`.
  void publish(const void* src, int64_t rows, int64_t row_bytes, int64_t staged_at,
               const int32_t* valid_index = nullptr, int64_t valid_limit = 0) {
    if (!group_.staged || src == nullptr) {
      plan_.published[published_++] = src;
      return;
    }
    plan_.regions[plan_.num_regions++] = {src, group_.workspaces[group_.rank] + staged_at, rows, row_bytes,
                                          valid_index, valid_limit};
    plan_.published[published_++] = reinterpret_cast<const void*>(staged_at);
  }

  // Publishes scratch the kernel writes and peers read (dispatch's send offsets), or that peers write (the push
  // combine's slots): a staged group uses its workspace at offset `staged_at` instead.
  template <typename T>
  T* publish_scratch(T* scratch, int64_t staged_at) {
    if (!group_.staged) {
      plan_.published[published_++] = scratch;
      return scratch;
    }
    plan_.published[published_++] = reinterpret_cast<const void*>(staged_at);
    return reinterpret_cast<T*>(group_.workspaces[group_.rank] + staged_at);
  }

  // The plan, or false when a staged group's regions, which end at `staging_end`, do not fit its staging room
  // (the low-latency region follows it).
  bool finish(StagePlan* out, int64_t staging_end) const {
    *out = plan_;
    return !group_.staged || staging_end <= group_.staging_bytes;
  }

 private:
  const IntranodeRank& group_;
  StagePlan plan_ = {};
  int published_ = 0;
};


// The inputs every intranode dispatch publishes, in their view order: payloads 0 and 1 (null without a second),
// topk_idx at 2, topk_weights at 3 (null without weights). Args: DispatchArgs or ExpertMajorDispatchArgs (the same
// input fields). Returns their staging layout (the rank-major dispatch publishes its send offsets after them).
template <typename Args>
DispatchStaging publish_dispatch_inputs(StagePlanBuilder& builder, const Args& a, int num_ranks) {
  const bool two_payloads = a.num_payloads == 2;
  const DispatchStaging staging(a.num_tokens, {a.x_row_bytes[0], two_payloads ? a.x_row_bytes[1] : 0}, a.num_topk,
                                a.topk_weights != nullptr, num_ranks);
  builder.publish(a.x[0], a.num_tokens, a.x_row_bytes[0], staging.payloads[0]);
  builder.publish(two_payloads ? a.x[1] : nullptr, a.num_tokens, a.x_row_bytes[1], staging.payloads[1]);
  builder.publish(a.topk_idx, a.num_tokens, a.num_topk * 4, staging.topk_idx);
  builder.publish(a.topk_weights, a.num_tokens, a.num_topk * 4, staging.topk_weights);
  return staging;
}

// The plan of every cached dispatch (rank-major, expert-major, the expert-major combine's backward): peers read x
// [num_tokens, row_bytes]. False where a staged group's workspace is too small for its copy.
inline bool plan_cached_dispatch(const IntranodeRank& group, const void* x, int64_t num_tokens, int64_t row_bytes,
                                 StagePlan* plan) {
  const CachedDispatchStaging staging(num_tokens, row_bytes);
  StagePlanBuilder builder(group);
  builder.publish(x, num_tokens, row_bytes, staging.x);
  return builder.finish(plan, staging.end);
}

// launch(std::integral_constant<int, kRanks>{}) for the smallest of 2, 4, 8 ranks that holds the group: the combines'
// per-rank arrays are sized by it.
template <typename Launch>
void with_rank_bound(int num_ranks, Launch launch) {
  if (num_ranks <= 2)
    launch(std::integral_constant<int, 2>{});
  else if (num_ranks <= 4)
    launch(std::integral_constant<int, 4>{});
  else
    launch(std::integral_constant<int, 8>{});
}

}  // namespace
}  // namespace jax_ep
