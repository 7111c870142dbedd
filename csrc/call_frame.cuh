// The call frame of the normal-mode kernels, shared by the intranode (intranode.cu) and internode (internode.cu)
// modes: the block shape, the call number that every kernel reads at its start from its rank's device state, the
// last block that ends the call, the optional kernel timer, the grid size and the combine's type dispatch. What
// the two modes differ in (whom a rank waits for before reading and after its work, which counters a call resets)
// they pass in. Internal linkage, as device_common.cuh.
//
// A State (IntranodeState, InternodeHeader) holds at least:
//   uint64_t calls_completed;   the calls this rank completed: the running call is calls_completed + 1
//   uint32_t blocks_finished;   blocks of the running call that finished their work
//   KernelTimer timer;          instrumented builds only (kernel_timer.h)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "api.h"
#include "device_common.cuh"
#include "kernel_timer.h"

namespace jax_ep {
namespace {

// Every normal-mode kernel runs kThreads threads per block, one block per SM: blocks wait for each other, so the
// whole grid must be resident at once.
constexpr int kThreads = kNormalThreads;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kNormalMaxTopk <= 32, "a token's top-k entries are handled one per lane of a warp");

// Loads in flight per lane in row copies: a 7168-wide BF16 row is 28 16-byte units per lane, so 14 cover it
// in 2 round trips over NVLink.
constexpr int kCopyUnroll = 14;

__device__ __forceinline__ int global_warp() { return blockIdx.x * kWarps + threadIdx.x / 32; }
__device__ __forceinline__ int num_global_warps() { return gridDim.x * kWarps; }

// Instrumented builds: block 0 stamps the call's start, the last block adds the time since to the rank's timer.
template <typename OwnState>
__device__ __forceinline__ void start_kernel_timer(OwnState own_state) {
  if constexpr (kInstrumented) own_state()->timer.call_start_ns = now_ns();
}

template <typename State>
__device__ __forceinline__ void stop_kernel_timer(State* own) {
  if constexpr (kInstrumented) {
    own->timer.ns += now_ns() - *reinterpret_cast<volatile uint64_t*>(&own->timer.call_start_ns);
    own->timer.calls += 1;
  }
}

// Start of a call (every block, before anything else): context.call = the running call's number. own_state()
// returns the rank's State* (a callable, evaluated where the state is used, so that only the thread that uses it
// loads its address). A Context (per block, in shared memory) holds at least `uint64_t call` and `bool last_block`.
template <typename OwnState, typename Context>
__device__ __forceinline__ void begin_call(OwnState own_state, Context& context) {
  if (threadIdx.x == 0) {
    context.call = *reinterpret_cast<volatile uint64_t*>(&own_state()->calls_completed) + 1;
    if (blockIdx.x == 0) start_kernel_timer(own_state);
  }
  __syncthreads();
}

// End of a call (every block, after its work). The last block to get here runs `epilogue` (every other block's
// writes visible to it), then `release` (every thread of the block: the mode's barrier with the ranks that read
// this rank's memory in this call), then `reset(own)` and the end of the call on thread 0.
template <typename State, typename Context, typename Epilogue, typename Release, typename Reset>
__device__ __forceinline__ void end_call(State* own, Context& context, Epilogue epilogue, Release release,
                                         Reset reset) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    context.last_block = atomicAdd(&own->blocks_finished, 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (!context.last_block) return;
  epilogue();
  __syncthreads();
  release();
  if (threadIdx.x == 0) {
    stop_kernel_timer(own);
    own->blocks_finished = 0;
    reset(own);
    own->calls_completed = context.call;
  }
}

// ---- host side -----------------------------------------------------------------------------------------------------

// The grid of a launch (Call: IntranodeCall or InternodeCall): the call's SMs, at most the device's, one block each.
template <typename Call>
int grid_size(const Call& call) {
  return std::max(1, std::min(call.num_sms, call.group.device_sms));
}

// A type as a value, so that a generic lambda can take types as arguments.
template <typename T>
struct TypeTag {
  using type = T;
};

// launch(TypeTag<T>{}) for the float type `type` names; cudaErrorInvalidValue for none.
template <typename Launch>
cudaError_t with_float_type(FloatType type, Launch launch) {
  switch (type) {
    case FloatType::kF32: return launch(TypeTag<float>{});
    case FloatType::kBF16: return launch(TypeTag<__nv_bfloat16>{});
    case FloatType::kF16: return launch(TypeTag<__half>{});
  }
  return cudaErrorInvalidValue;
}

// The combines' element types (Args: CombineArgs or InternodeCombineArgs): calls
// launch(TypeTag<In>{}, TypeTag<Bias>{}, TypeTag<Out>{}) for y's type In, where Bias and Out are each In or float32
// as the args say. cudaErrorInvalidValue where the output or bias type is neither.
template <typename Args, typename Launch>
cudaError_t with_combine_types(const Args& args, Launch launch) {
  const bool out_ok = args.out_type == args.y_type || args.out_type == FloatType::kF32;
  const bool bias_ok = args.bias == nullptr || args.bias_type == args.y_type || args.bias_type == FloatType::kF32;
  if (!out_ok || !bias_ok) return cudaErrorInvalidValue;
  auto from = [&](auto in) {
    const bool float_out = args.out_type == FloatType::kF32;
    if (args.bias != nullptr && args.bias_type == FloatType::kF32)
      return float_out ? launch(in, TypeTag<float>{}, TypeTag<float>{}) : launch(in, TypeTag<float>{}, in);
    return float_out ? launch(in, in, TypeTag<float>{}) : launch(in, in, in);
  };
  return with_float_type(args.y_type, from);
}

}  // namespace
}  // namespace jax_ep
