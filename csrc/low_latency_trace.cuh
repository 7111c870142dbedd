// The low-latency kernels' per-call trace (LowLatencyTrace, low_latency_state.h): when each block started, when
// each phase ended and when the last flag was seen, for the benchmark. Compiled in with JAX_EP_INSTRUMENT only;
// without it every function here is an empty inline.
#pragma once

#include <cstdint>

#include "api.h"
#include "device_common.cuh"
#include "low_latency_state.h"

namespace jax_ep {
namespace {

// ---- per-call trace (LowLatencyTrace; instrumented builds only) ------------------------------------------------
// Every function here does nothing in a default build (kInstrumented false): its region has no trace, and the
// kernels read no clock.

__device__ __forceinline__ LowLatencyTrace* trace_slot(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                                       LowLatencyKernel kernel, uint32_t call) {
  return reinterpret_cast<LowLatencyTrace*>(c.region + layout.trace) + kernel * kLowLatencyTraceCalls +
         call % kLowLatencyTraceCalls;
}

__host__ __device__ inline LowLatencyTrace prepared_trace() {
  LowLatencyTrace trace{};
  trace.first_start = trace.first_flag = ~0ull;
  return trace;
}

// A flag raised (sends) or a wait for flags satisfied (receives), at `ns`.
__device__ __forceinline__ void trace_flag(LowLatencyTrace* trace, uint64_t ns) {
  if (!kInstrumented) return;
  atomicMin(reinterpret_cast<unsigned long long*>(&trace->first_flag), static_cast<unsigned long long>(ns));
  atomicMax(reinterpret_cast<unsigned long long*>(&trace->last_flag), static_cast<unsigned long long>(ns));
}

// The same, now, in the trace of call `call` of `kernel`.
__device__ __forceinline__ void trace_flag_now(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                               LowLatencyKernel kernel, uint32_t call) {
  if (kInstrumented) trace_flag(trace_slot(c, layout, kernel, call), now_ns());
}

// A block's start and its time per phase, kept by thread 0 in shared memory (no registers held through the
// kernel); the other threads' calls do nothing, so that a kernel marks the end of a phase right after the
// barrier that ends it, as the block sees it.
struct BlockClock {
  uint64_t start, last;
  uint64_t phase_ns[kLowLatencyPhases];
};

__device__ __forceinline__ BlockClock& block_clock() {
  __shared__ BlockClock clock;
  return clock;
}

__device__ __forceinline__ void clock_begin() {
  if (!kInstrumented || threadIdx.x != 0) return;
  BlockClock& clock = block_clock();
  clock.start = clock.last = now_ns();
  for (int p = 0; p < kLowLatencyPhases; ++p) clock.phase_ns[p] = 0;
}

__device__ __forceinline__ void clock_mark(int phase) {
  if (!kInstrumented || threadIdx.x != 0) return;
  BlockClock& clock = block_clock();
  const uint64_t ns = now_ns();
  clock.phase_ns[phase] += ns - clock.last;
  clock.last = ns;
}

// Thread 0 of every block, at its end: adds the block's start and its phases (over `units`) to the call's trace,
// whose slot it returns (null in a default build).
__device__ __forceinline__ LowLatencyTrace* trace_block(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                                        LowLatencyKernel kernel, uint32_t call, uint64_t units) {
  if (!kInstrumented) return nullptr;
  const BlockClock& clock = block_clock();
  LowLatencyTrace* trace = trace_slot(c, layout, kernel, call);
  atomicMin(reinterpret_cast<unsigned long long*>(&trace->first_start), static_cast<unsigned long long>(clock.start));
  atomicMax(reinterpret_cast<unsigned long long*>(&trace->last_start), static_cast<unsigned long long>(clock.start));
  atomicAdd(reinterpret_cast<unsigned long long*>(&trace->units), static_cast<unsigned long long>(units));
  for (int p = 0; p < kLowLatencyPhases; ++p)
    if (clock.phase_ns[p])
      atomicAdd(reinterpret_cast<unsigned long long*>(&trace->phase_ns[p]),
                static_cast<unsigned long long>(clock.phase_ns[p]));
  return trace;
}

// Thread 0 of the last block of a call: closes the call's trace and prepares the slot of the kernel's next call.
__device__ __forceinline__ void close_trace(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                            LowLatencyKernel kernel, uint32_t call, LowLatencyTrace* trace) {
  if (!kInstrumented) return;
  trace->end = now_ns();
  trace->call = call;
  *trace_slot(c, layout, kernel, call + 1) = prepared_trace();
}

}  // namespace
}  // namespace jax_ep
