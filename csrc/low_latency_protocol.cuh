// Low-latency (LL) kernels' shared device code: the call numbers and the regions, the bounded waits and the
// credits, the end of a kernel's call, and the constants of the rows. Included by low_latency_dispatch.cu and
// low_latency_combine.cu.
//
// Low-latency (LL) dispatch and combine (docs/design.md, "Low-latency kernels"): each op is a send half
// and a receive half, separate launches joined by a token (the call number) so that XLA can schedule work
// between them. Rows reach the other ranks through a transport policy (low_latency_transport.cuh): plain stores
// through peer pointers (NVLink peer access, or CUDA IPC mappings), or NVSHMEM puts into symmetric memory; the
// LL region of each rank is laid out in low_latency_state.h. Kernels only ever read their own rank's region.
//
// Protocol of call c of one op (dispatch and combine keep separate counters, regions and credits):
//  send:  reads c = (own calls) + 1 from the device (graph replay advances it), waits until every peer's
//         receive of call c - 2 finished reading buffer set c % 2 (a credit: peers may drift, and at most two
//         calls of an op are between send and receive), writes its rows into set c % 2 of the receivers, and
//         raises one flag per (expert, source) carrying the tag c (and for dispatch the row count) as soon as
//         that expert's rows from this source are written, not when the whole grid is done. Flags carry the
//         call number instead of being cleaned between calls, so a stale flag of call c - 2 never reads as
//         ready and no cleaning pass races with a fast peer.
//  recv:  takes c from the send's token and waits (bounded) only for the flags the work at hand needs: the
//         dispatch receive packs an expert once that expert's flags carry c, the combine receive sums a token
//         once its experts' flags do; when every block is done it writes "set c % 2 read up to call c" into the
//         credit words of every sender.
// Every wait is bounded by timeout_ns: on expiry the kernel fills the host-mapped error record (op, rank,
// peer, call) and traps, or under Config(on_timeout="mask") masks that peer and goes on without it (docs/design.md,
// "Masked ranks"). A third send of one op before the receive of the first waits for a credit that
// cannot come: that misuse ends in such a timeout, naming the credit wait.
// Blocks never wait for other blocks of their own kernel, so grids need not be co-resident.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "api.h"
#include "device_common.cuh"
#include "low_latency_state.h"
#include "low_latency_trace.cuh"
#include "low_latency_transport.cuh"

namespace jax_ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kGroup = 128;              // channels per FP8 scale
constexpr int kLaneChannels = 8;         // BF16 channels per lane and step: one 16-byte load
constexpr int kChunk = 32 * kLaneChannels;  // channels per warp step (two FP8 groups)
constexpr float kFp8Max = 448.f;
constexpr float kAmaxFloor = 1e-4f;

// ---- call numbers and regions ------------------------------------------------------------------------------

// Whether call counter `value` reached `call`, modulo 2^32.
__device__ __forceinline__ bool call_reached(uint32_t value, uint32_t call) {
  return static_cast<int32_t>(value - call) >= 0;
}

__device__ __forceinline__ LowLatencyHeader* own_header(const LowLatencyCall& c) {
  return reinterpret_cast<LowLatencyHeader*>(c.region);
}

// Region offset of rank `from`'s credit word for buffer set `set` (in every rank's header).
__host__ __device__ constexpr int64_t credit_offset(bool dispatch, int from, uint32_t set) {
  return (dispatch ? offsetof(LowLatencyHeader, dispatch_credit) : offsetof(LowLatencyHeader, combine_credit)) +
         (static_cast<int64_t>(from) * 2 + set) * static_cast<int64_t>(sizeof(uint64_t));
}

__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) / 32; }
__device__ __forceinline__ int num_global_warps() { return gridDim.x * blockDim.x / 32; }

// ---- masked peers and bounded waits ----------------------------------------------------------------------------

// Whether this rank masks `peer` (Config(on_timeout="mask"), LowLatencyHeader::masked): then no wait, row or flag of
// this rank's kernels involves it. Read at every use: a wait of another block or kernel may mask it meanwhile.
__device__ __forceinline__ bool peer_masked(const LowLatencyCall& c, int peer) {
  return c.mask_on_timeout &&
         *reinterpret_cast<const volatile unsigned long long*>(own_header(c)->masked + peer) != 0;
}

// Masks `peer` from now on (its first masking counts): `started` is the dispatches this rank had started.
__device__ __noinline__ void mask_peer(const LowLatencyCall& c, int peer, uint32_t started) {
  atomicCAS(own_header(c)->masked + peer, 0ull, kLowLatencyMaskedBit | started);
  __threadfence();
}

// The dispatches this rank has started, in a kernel of `op` running call `call` of its op.
__device__ __forceinline__ uint32_t dispatches_started(const LowLatencyCall& c, LowLatencyOp op, uint32_t call) {
  const bool dispatch = op == LowLatencyOp::kDispatchSend || op == LowLatencyOp::kDispatchRecv;
  return dispatch ? call : *reinterpret_cast<const volatile uint32_t*>(&own_header(c)->dispatch_calls);
}

// Spins until done(load()), pausing backoff_ns between loads, with the last value loaded in `seen`; returns true.
// Past c.timeout_ns the kernel fails (fail_on_timeout), or with c.mask_on_timeout masks `peer` and returns false;
// it also returns false at once for a peer masked before or during the wait (its value is not waited for).
template <typename Load, typename Done>
__device__ __forceinline__ bool wait_until(const LowLatencyCall& c, LowLatencyOp op, LowLatencyWait wait, int peer,
                                           uint32_t call, Load load, Done done, uint64_t& seen,
                                           unsigned backoff_ns = 0) {
  if (peer_masked(c, peer)) return false;
  seen = load();
  if (done(seen)) return true;
  const uint64_t start = now_ns();
  while (!done(seen = load())) {
    if (backoff_ns) __nanosleep(backoff_ns);
    if (peer_masked(c, peer)) return false;
    const int64_t waited = static_cast<int64_t>(now_ns() - start);
    if (waited > c.timeout_ns) {
      if (c.mask_on_timeout && peer != c.group.rank) {  // (a wait on itself is a misuse: it traps)
        mask_peer(c, peer, dispatches_started(c, op, call));
        return false;
      }
      fail_on_timeout(&own_header(c)->error_claimed, c.group.error, c.group.rank, static_cast<int32_t>(op),
                      static_cast<int32_t>(wait), peer, call, seen, waited);
    }
  }
  return true;
}

// Send halves, before writing into set call % 2 of the peers: peer `peer`'s receive of call - 2 (the previous
// user of that set) has finished reading it, as the credit word it wrote into this rank's header says. A thread
// waits for one or more peers; a barrier after it holds the block's other threads back. A masked peer is not
// waited for (and gets nothing).
__device__ __forceinline__ void wait_for_credit(const LowLatencyCall& c, LowLatencyOp op, uint32_t call, bool dispatch,
                                                int peer) {
  const uint64_t* credit = reinterpret_cast<const uint64_t*>(c.region + credit_offset(dispatch, peer, call & 1));
  uint64_t seen = 0;
  wait_until(c, op, LowLatencyWait::kCredit, peer, call, [&] { return load_acquire_sys(credit); },
             [&](uint64_t v) { return call_reached(static_cast<uint32_t>(v), call - 2); }, seen);
}

// Receive halves, in the last block once every block finished reading set call % 2: tells every sender
// (a thread each) that it may write into that set again; a masked one is told nothing (its sends then time out).
template <typename Transport>
__device__ __forceinline__ void give_credits(const LowLatencyCall& c, uint32_t call, bool dispatch) {
  for (int peer = threadIdx.x; peer < c.group.num_ranks; peer += blockDim.x)
    if (!peer_masked(c, peer)) Transport::signal(c, peer, credit_offset(dispatch, c.group.rank, call & 1), call);
}

// The call number of a send half: one more than the calls this rank completed. Every thread reads it at its
// start; only the last block of a call advances it, after every block has started.
__device__ __forceinline__ uint32_t next_call(const uint32_t* completed) {
  return *reinterpret_cast<const volatile uint32_t*>(completed) + 1;
}

// ---- end of a kernel's call ------------------------------------------------------------------------------------

// Every block calls this after its work: returns true in the one block that finished last, which then sees every
// other block's writes (and may publish them to peers with release stores). Instrumented builds also add the
// block to the call's trace (its phases over `units`), and the last block closes it.
__device__ bool finish_block(const LowLatencyCall& c, const LowLatencyLayout& layout, LowLatencyKernel kernel,
                             uint32_t call, uint64_t units) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    LowLatencyTrace* trace = trace_block(c, layout, kernel, call, units);
    LowLatencyHeader* own = own_header(c);
    // GPU scope is enough: every block of the kernel is on this GPU; what the last block then publishes to peers
    // (the receives' credits) goes through Transport::signal, a system-scope release cumulative over what it
    // observed here, and what the sends' last block writes (the call counter, the token) is read by later kernels
    // on this stream. (A system-scope fence here would cost every call, docs/perf-log.md.)
    __threadfence();
    last = atomicAdd(&own->blocks_finished[kernel], 1u) == gridDim.x - 1;
    if (last) {
      own->blocks_finished[kernel] = 0;  // every block has counted: ready for the next call
      close_trace(c, layout, kernel, call, trace);
    }
    __threadfence();
  }
  __syncthreads();
  return last;
}

// ---- row copies --------------------------------------------------------------------------------------------

// The dispatch receive's row copies: the values with the FP8 scales (warp_copy_row_pair: one copy for float32
// scales; UE8M0's rows of H/128 bytes are not whole 16-byte units and take a copy of their own), read at L2
// (LoadL2: the rows were written by peers during this call), 14 16-byte loads in flight per lane: an FP8 row of
// 7168 channels in one round trip.
constexpr int kRecvCopyUnroll = 14;

// A 16-byte load of BF16 channels as floats.
__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&v)[kLaneChannels]) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) v[i] = __bfloat162float(h[i]);
}

}  // namespace
}  // namespace jax_ep
