// Low-latency (LL) dispatch and combine kernels (docs/design.md, "Low-latency kernels"): each op is a send half
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
// peer, call) and traps. A third send of one op before the receive of the first waits for a credit that
// cannot come: that misuse ends in such a timeout, naming the credit wait.
// Blocks never wait for other blocks of their own kernel, so grids need not be co-resident.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cub/block/block_scan.cuh>
#include <thrust/binary_search.h>
#include <thrust/execution_policy.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "api.h"
#include "cuda_check.h"
#include "device_common.cuh"
#include "intranode_state.h"
#include "logfmt.cuh"
#include "low_latency_state.h"
#include "low_latency_transport.cuh"
#include "registry.h"

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

// ---- bounded waits -----------------------------------------------------------------------------------------

// Spins until done(load()), pausing backoff_ns between loads, and returns the last value loaded, or fails after
// c.timeout_ns.
template <typename Load, typename Done>
__device__ __forceinline__ uint64_t wait_until(const LowLatencyCall& c, LowLatencyOp op, LowLatencyWait wait,
                                               int peer, uint32_t call, Load load, Done done, unsigned backoff_ns = 0) {
  uint64_t seen = load();
  if (done(seen)) return seen;
  const uint64_t start = now_ns();
  while (!done(seen = load())) {
    if (backoff_ns) __nanosleep(backoff_ns);
    const int64_t waited = static_cast<int64_t>(now_ns() - start);
    if (waited > c.timeout_ns)
      fail_on_timeout(&own_header(c)->error_claimed, c.group.error, c.group.rank, static_cast<int32_t>(op),
                      static_cast<int32_t>(wait), peer, call, seen, waited);
  }
  return seen;
}

// Send halves, before writing into set call % 2 of the peers: peer `peer`'s receive of call - 2 (the previous
// user of that set) has finished reading it, as the credit word it wrote into this rank's header says. A thread
// waits for one or more peers; a barrier after it holds the block's other threads back.
__device__ __forceinline__ void wait_for_credit(const LowLatencyCall& c, LowLatencyOp op, uint32_t call, bool dispatch,
                                                int peer) {
  const uint64_t* credit = reinterpret_cast<const uint64_t*>(c.region + credit_offset(dispatch, peer, call & 1));
  wait_until(c, op, LowLatencyWait::kCredit, peer, call, [&] { return load_acquire_sys(credit); },
             [&](uint64_t seen) { return call_reached(static_cast<uint32_t>(seen), call - 2); });
}

// Receive halves, in the last block once every block finished reading set call % 2: tells every sender
// (a thread each) that it may write into that set again.
template <typename Transport>
__device__ __forceinline__ void give_credits(const LowLatencyCall& c, uint32_t call, bool dispatch) {
  for (int peer = threadIdx.x; peer < c.group.num_ranks; peer += blockDim.x)
    Transport::signal(c, peer, credit_offset(dispatch, c.group.rank, call & 1), call);
}

// The call number of a send half: one more than the calls this rank completed. Every thread reads it at its
// start; only the last block of a call advances it, after every block has started.
__device__ __forceinline__ uint32_t next_call(const uint32_t* completed) {
  return *reinterpret_cast<const volatile uint32_t*>(completed) + 1;
}

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
    // on this stream. (System-scope fences here measured 1.4 us slower for the FP8 dispatch on 4x H200: 29.0
    // against 27.6 us.)
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

// ---- FP8 cast (jax_ep/fp8.py bit for bit) ----------------------------------------------------------------

// max that propagates NaN, as XLA's reduce-max and jnp.maximum do.
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// 2**ceil(log2(scale)) for a positive normal float: the scale itself when its mantissa is zero, else the next
// power of two (fp8.py's frexp rule).
__device__ __forceinline__ float round_up_to_power_of_two(float scale) {
  const uint32_t bits = __float_as_uint(scale);
  return (bits & 0x7fffffu) ? __uint_as_float((bits & 0x7f800000u) + 0x800000u) : scale;
}

// Casts this lane's 8 channels (group = 16 lanes): returns the e4m3 bytes, sets *scale for the group.
__device__ __forceinline__ uint2 cast_to_fp8(const float (&v)[kLaneChannels], bool round_scale, float* scale) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) amax = nan_max(amax, fabsf(v[i]));
#pragma unroll
  for (int mask = 8; mask >= 1; mask >>= 1) amax = nan_max(amax, __shfl_xor_sync(kFullMask, amax, mask));
  amax = nan_max(amax, kAmaxFloor);
  float s = __fmul_rn(amax, 1.f / kFp8Max);  // amax * float32(1/448), DeepEP's rounding
  if (round_scale) s = round_up_to_power_of_two(s);
  *scale = s;
  // x / s as fp8.py divides; a power-of-two scale has an exact reciprocal, and the product then rounds to the
  // same float as the quotient (both are the exact x * 2^-k rounded once), for a cheaper cast.
  const float inverse = __frcp_rn(s);
  uint8_t q[kLaneChannels];
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i)
    q[i] = __nv_cvt_float_to_fp8(round_scale ? __fmul_rn(v[i], inverse) : __fdiv_rn(v[i], s), __NV_SATFINITE,
                                 __NV_E4M3);
  uint2 out;
  memcpy(&out, q, sizeof(out));
  return out;
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&v)[kLaneChannels]) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) v[i] = __bfloat162float(h[i]);
}

// Work items (token, part): a token's channels split into `parts` ranges of `chunks_per_part` whole chunks,
// as few chunks per part as would give every item a warp of its own at once (the rounding up of parts can still
// leave a few items more than warps for some T, e.g. T=212 at 132 SMs; bounding parts by warps / T would not),
// so that small batches still spread over every SM. A warp taking a second item runs it after its
// first, which ends the kernel an item later: with parts sized for the warps alone (17 parts of 2 chunks at
// DeepEP's decode shape, 3 of them empty, 64 warps with two items) the combine took 60.2 us on 4x H200, with 14
// parts 54.0 us.
struct TokenParts {
  int64_t parts, chunks_per_part;
  __host__ __device__ TokenParts(int64_t num_tokens, int64_t hidden, int64_t warps) {
    const int64_t chunks = (hidden + kChunk - 1) / kChunk;
    chunks_per_part = std::min(chunks, std::max<int64_t>(1, (chunks * num_tokens + warps - 1) / warps));
    parts = (chunks + chunks_per_part - 1) / chunks_per_part;
  }
};

// ---- dispatch ---------------------------------------------------------------------------------------------

// The send runs one token per block at a time, its 16 warps casting the token's row together into the slots of
// the ranks of the token's experts (or into the staging row that puts then copy). Enough warps keep many stores
// in flight per SM while T is about the number of SMs.
constexpr int kSendThreads = 512;
constexpr int kSendWarps = kSendThreads / 32;

// The send counter of expert e (LowLatencyLayout::dispatch_counters, uint64): every row sent to e adds 1 once its
// bytes are written, and the warp that counts e's rows adds (rows << 32) + kSentTag - rows. So the low 32 bits read
// kSentTag, and the high 32 bits the row count, exactly when e's rows are all written and counted, in whatever
// order the additions come; the thread whose addition completes it raises e's flag, at once, on e's rank.
constexpr uint32_t kSentTag = 1u << 30;  // above any row count (at most kLowLatencyMaxEntries)

template <typename Transport>
__device__ void count_toward_flag(const LowLatencyCall& c, const LowLatencyLayout& layout, uint32_t call, int32_t e,
                                  uint64_t addition) {
  unsigned long long* counter = reinterpret_cast<unsigned long long*>(c.region + layout.dispatch_counters) + e;
  __threadfence();  // release: the rows this thread saw finished (through a barrier) before its addition
  const uint64_t total = atomicAdd(counter, addition) + addition;
  if (static_cast<uint32_t>(total) != kSentTag) return;
  __threadfence();  // acquire: every other addition's rows before the flag
  atomicExch(counter, 0ull);  // nothing else adds to it in this call; the next call's kernel starts after this one
  const int num_ranks = c.group.num_ranks;
  const int32_t experts_per_rank = static_cast<int32_t>(c.num_experts / num_ranks);
  const int64_t flag = layout.set_offset(call & 1) + layout.dispatch_flags +
                       ((e % experts_per_rank) * num_ranks + c.group.rank) * static_cast<int64_t>(sizeof(uint64_t));
  Transport::signal(c, e / experts_per_rank, flag, (uint64_t{call} << 32) | (total >> 32));
  trace_flag_now(c, layout, kDispatchSendKernel, call);
}

// Byte offsets inside a dispatch slot row: the DispatchRowHeader, the values, then (FP8) the scales.
struct DispatchRowFormat {
  int64_t value_bytes;  // per channel: 2 (BF16) or 1 (FP8)
  int64_t scale_bytes;  // per 128 channels: 0 (BF16), 4 (FP8 float32 scales) or 1 (UE8M0 exponent bytes)
  int64_t scales;       // offset of the scales
  int64_t message;      // bytes a receiver gets: the used part of the row, rounded up to 16 (inside the slot)

  __device__ DispatchRowFormat(LowLatencyPayload payload, int64_t hidden)
      : value_bytes(payload == LowLatencyPayload::kBF16 ? 2 : 1),
        scale_bytes(payload == LowLatencyPayload::kFP8 ? 4 : payload == LowLatencyPayload::kFP8UE8M0 ? 1 : 0),
        scales(static_cast<int64_t>(sizeof(DispatchRowHeader)) + hidden * value_bytes),
        message((scales + hidden / kGroup * scale_bytes + 15) / 16 * 16) {}
  __device__ int64_t value(int64_t channel) const { return sizeof(DispatchRowHeader) + channel * value_bytes; }
  __device__ int64_t scale(int64_t channel) const { return scales + channel / kGroup * scale_bytes; }
};

// Where the send's cast writes a token's row: with a transport of direct stores, straight into the token's slot
// on every rank that takes it (the cast's stores are the puts; such transports have at most kMaxIntranodeRanks
// ranks), else into this rank's staging row, which the puts then copy from.
struct CastRows {
  char* rows[kMaxIntranodeRanks];
  int count;
};

// Casts this lane's 8 channels at `channel` (all lanes call it: FP8 groups reduce across 16 lanes) and stores them
// into every row of `to`; lanes past the row store nothing.
__device__ __forceinline__ void stage_channels(const uint4& raw, int64_t channel, bool inside,
                                               LowLatencyPayload payload, bool round_scale,
                                               const DispatchRowFormat& format, const CastRows& to, int lane) {
  if (payload == LowLatencyPayload::kBF16) {
    if (!inside) return;
#pragma unroll
    for (int i = 0; i < kMaxIntranodeRanks; ++i)
      if (i < to.count) *reinterpret_cast<uint4*>(to.rows[i] + format.value(channel)) = raw;
    return;
  }
  float v[kLaneChannels], scale = 0.f;
  bf16x8_to_float(raw, v);
  const uint2 q = cast_to_fp8(v, round_scale, &scale);
  if (!inside) return;  // hidden is a multiple of 128: whole 16-lane groups are inside or not
  const bool writes_scale = lane % (kGroup / kLaneChannels) == 0;  // the group's first lane writes its scale
#pragma unroll
  for (int i = 0; i < kMaxIntranodeRanks; ++i) {
    if (i >= to.count) break;
    *reinterpret_cast<uint2*>(to.rows[i] + format.value(channel)) = q;
    if (!writes_scale) continue;
    if (payload == LowLatencyPayload::kFP8UE8M0)  // byte i of packed word w is group 4w + i: one byte per group
      *reinterpret_cast<uint8_t*>(to.rows[i] + format.scale(channel)) =
          static_cast<uint8_t>(__float_as_uint(scale) >> 23);
    else
      *reinterpret_cast<float*>(to.rows[i] + format.scale(channel)) = scale;
  }
}

// Where the current token of a send block goes: its distinct valid experts, in top-k order, its slot position
// at each (its rank among this rank's tokens routed to that expert, in token order), and the distinct ranks
// holding them (the row crosses to each once).
struct SendTargets {
  int32_t expert[kLowLatencyMaxTopk];
  int32_t position[kLowLatencyMaxTopk];
  int32_t count;
  int32_t rank[kLowLatencyMaxTopk];  // at most one per top-k entry
  int32_t num_ranks;
};

// Warp 0, before a barrier: token t's targets (positions zeroed for count_positions) and the header of its
// staging row, read from topk_idx itself so that no barrier after the routing's copy is needed first.
__device__ __forceinline__ void prepare_targets(const int32_t* topk_idx, int64_t num_topk, int32_t num_experts,
                                                int32_t experts_per_rank, int64_t t, SendTargets& targets,
                                                DispatchRowHeader* header, int lane) {
  int32_t id = lane < num_topk ? topk_idx[t * num_topk + lane] : -1;
  if (id < 0 || id >= num_experts) id = -1;
  // (Every lane takes part in each match: the warp-wide shuffles must not sit behind a short circuit.)
  const unsigned same_expert = __match_any_sync(kFullMask, id);
  const unsigned first_of_expert = __ballot_sync(kFullMask, id >= 0 && __ffs(same_expert) - 1 == lane);
  if (first_of_expert >> lane & 1u) targets.expert[__popc(first_of_expert & ((1u << lane) - 1u))] = id;
  const int32_t rank = id >= 0 ? id / experts_per_rank : -1;
  const unsigned same_rank = __match_any_sync(kFullMask, rank);
  const unsigned first_of_rank = __ballot_sync(kFullMask, rank >= 0 && __ffs(same_rank) - 1 == lane);
  if (first_of_rank >> lane & 1u) targets.rank[__popc(first_of_rank & ((1u << lane) - 1u))] = rank;
  if (lane < kLowLatencyMaxTopk) {
    targets.position[lane] = 0;
    header->experts[lane] = static_cast<int16_t>(id);
  }
  if (lane == 0) {
    targets.count = __popc(first_of_expert);
    targets.num_ranks = __popc(first_of_rank);
  }
}

// Lane's token u of the shared routing: its top-k ids, -1 past num_topk and for every entry when u >= end.
__device__ __forceinline__ void load_ids(const int16_t* topk, int64_t num_topk, int64_t u, int64_t end,
                                         int32_t (&ids)[kLowLatencyMaxTopk]) {
#pragma unroll
  for (int k = 0; k < kLowLatencyMaxTopk; ++k) ids[k] = u < end && k < num_topk ? topk[u * num_topk + k] : -1;
}

__device__ __forceinline__ bool names(const int32_t (&ids)[kLowLatencyMaxTopk], int32_t expert) {
  bool found = false;
#pragma unroll
  for (int k = 0; k < kLowLatencyMaxTopk; ++k) found |= ids[k] == expert;
  return found;
}

// Token t's slot position at each target: the tokens before t naming the target's expert (a token once, however
// many of its entries name it). Warps take 32 tokens at a time, a ballot per target.
__device__ __forceinline__ void count_positions(const int16_t* topk, int64_t num_topk, int64_t t,
                                                SendTargets& targets, int warp, int lane) {
  const int num_targets = targets.count;
  for (int64_t first = static_cast<int64_t>(warp) * 32; first < t; first += kSendWarps * 32) {
    int32_t ids[kLowLatencyMaxTopk];
    load_ids(topk, num_topk, first + lane, t, ids);
    for (int j = 0; j < num_targets; ++j) {
      const unsigned named = __ballot_sync(kFullMask, names(ids, targets.expert[j]));
      if (lane == 0 && named) atomicAdd(&targets.position[j], __popc(named));
    }
  }
}

// The cast reads a warp's chunks of a row kPrefetch at a time (chunks batch, batch + kSendWarps, ...), every
// load of a batch issued before the first is used.
constexpr int kPrefetch = 4;

__device__ __forceinline__ void load_chunks(uint4 (&raw)[kPrefetch], const __nv_bfloat16* row, int64_t batch,
                                            int64_t hidden, int lane) {
#pragma unroll
  for (int p = 0; p < kPrefetch; ++p) {
    const int64_t ch = (batch + p * kSendWarps) * kChunk + lane * kLaneChannels;
    raw[p] = ch < hidden ? __ldg(reinterpret_cast<const uint4*>(row + ch)) : make_uint4(0, 0, 0, 0);
  }
}

// The send. A block takes tokens t = block, block + blocks, ... (one each at DeepEP's decode shape). Before its
// first barrier, whose latencies thereby overlap: warp 0 finds t's distinct experts (its targets) in topk_idx,
// warp 1 waits for the credits (nothing reaches a peer before that barrier), every warp loads its first chunks of
// x[t], and the block copies the routing into shared memory. Then, per token: its 16 warps cast the row (FP8: one
// scale per 128 channels, 16 lanes a group) into slot (this rank, t) of each target rank, once per rank however
// many of t's experts it holds, and count t's slot position at each target (the tokens before t naming it). With
// direct stores (peer pointers) the cast stores into the slots themselves and one warp copies the header there;
// otherwise it writes the staging row, which is then put to each target rank in pieces, a warp per (rank,
// piece). The last warp writes t into each target expert's index at t's position; once all of it is written,
// each target's send counter advances. Last, the
// block adds the row count of the experts it is given (spread over all blocks) to their counters, while its
// stores drain: a completed counter raises that expert's flag (count_toward_flag), so a receiver can start on
// an expert while other experts' rows are still being sent.
template <typename Transport>
__global__ void __launch_bounds__(kSendThreads)
    dispatch_send_kernel(const __grid_constant__ LowLatencyCall c,
                         const __grid_constant__ LowLatencyDispatchSendArgs a) {
  extern __shared__ int16_t send_topk[];  // [T, K] the routing; ids outside [0, E) are -1
  __shared__ SendTargets targets;
  __shared__ int32_t invalid;
  enum { kRouting, kCast, kPuts, kFlags };  // phases, as kLowLatencyPhaseNames names them
  clock_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, me = c.group.rank, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, num_topk = a.num_topk, num_tokens = a.num_tokens, max_tokens = c.num_max_tokens;
  const int32_t num_experts = static_cast<int32_t>(c.num_experts);
  const int32_t experts_per_rank = num_experts / num_ranks;
  const LowLatencyLayout layout(max_tokens, hidden, num_ranks, num_experts);
  LowLatencyHeader* own = own_header(c);
  const uint32_t call = next_call(&own->dispatch_calls), set = call & 1;
  const DispatchRowFormat format(a.payload, hidden);
  const int64_t chunks = (hidden + kChunk - 1) / kChunk;
  const int64_t slots = layout.set_offset(set) + layout.dispatch_rows;
  const int64_t index = layout.set_offset(set) + layout.dispatch_index;
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);
  auto staged_row = [&](int64_t t) { return c.region + layout.dispatch_staging + t * layout.dispatch_slot_bytes; };

  // Launches have blocks <= T: every block has a first token.
  int64_t t = blockIdx.x;
  if (warp == 0) prepare_targets(a.topk_idx, num_topk, num_experts, experts_per_rank, t, targets,
                                 reinterpret_cast<DispatchRowHeader*>(staged_row(t)), lane);
  if (warp == 1)
    for (int peer = lane; peer < num_ranks; peer += 32)
      wait_for_credit(c, LowLatencyOp::kDispatchSend, call, /*dispatch=*/true, peer);
  uint4 raw[kPrefetch];
  load_chunks(raw, x + t * hidden, warp, hidden, lane);
  for (int64_t i = threadIdx.x; i < num_tokens * num_topk; i += blockDim.x) {
    const int32_t e = a.topk_idx[i];
    send_topk[i] = static_cast<int16_t>(e >= 0 && e < num_experts ? e : -1);
  }
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  clock_mark(kRouting);

  for (; t < num_tokens; t += gridDim.x) {
    if (t != blockIdx.x) {  // a later token: its targets and first chunks, as above for the first
      if (warp == 0) prepare_targets(a.topk_idx, num_topk, num_experts, experts_per_rank, t, targets,
                                     reinterpret_cast<DispatchRowHeader*>(staged_row(t)), lane);
      load_chunks(raw, x + t * hidden, warp, hidden, lane);
      __syncthreads();
      clock_mark(kRouting);
    }
    char* staged = staged_row(t);
    const int num_targets = targets.count, num_target_ranks = targets.num_ranks;
    const int64_t slot = slots + (static_cast<int64_t>(me) * max_tokens + t) * layout.dispatch_slot_bytes;
    CastRows cast_rows;
    if constexpr (Transport::kDirectStores) {  // the cast stores into the targets' slots; the header goes first
      cast_rows.count = num_target_ranks;
#pragma unroll
      for (int i = 0; i < kMaxIntranodeRanks; ++i)
        if (i < num_target_ranks) cast_rows.rows[i] = Transport::address(c, targets.rank[i], slot);
      if (warp == kSendWarps - 1)  // (a warp with one chunk fewer: its header loads overlap the others' casts)
        for (int i = 0; i < num_target_ranks; ++i)
          Transport::put_warp(c, targets.rank[i], slot, staged, sizeof(DispatchRowHeader), lane);
    } else {
      cast_rows.count = 1;
      cast_rows.rows[0] = staged;
    }
    for (int64_t batch = warp; batch < chunks; batch += kPrefetch * kSendWarps) {
      if (batch != warp) load_chunks(raw, x + t * hidden, batch, hidden, lane);  // the first batch is loaded
#pragma unroll
      for (int p = 0; p < kPrefetch; ++p) {
        const int64_t chunk = batch + p * kSendWarps;
        if (chunk >= chunks) break;  // warp-uniform
        const int64_t ch = chunk * kChunk + lane * kLaneChannels;
        stage_channels(raw[p], ch, ch < hidden, a.payload, a.round_scale, format, cast_rows, lane);
      }
    }
    count_positions(send_topk, num_topk, t, targets, warp, lane);  // after the cast: raw's registers are free
    __syncthreads();  // the row is staged (or stored), the positions counted
    clock_mark(kCast);

    // The puts: where the cast staged the row, its message into slot (this rank, t) of each target rank, in
    // `pieces` 16-byte aligned pieces per rank, a warp per (rank, piece); the last warp also writes t into the
    // index of each target expert at its position.
    if (num_target_ranks > 0) {
      bool put = false;
      if constexpr (!Transport::kDirectStores) {
        const int pieces = max(1, kSendWarps / num_target_ranks);
        const int64_t piece_bytes = ((format.message + pieces - 1) / pieces + 15) / 16 * 16;
        for (int item = warp; item < num_target_ranks * pieces; item += kSendWarps) {
          const int64_t begin = (item % pieces) * piece_bytes, end = min(begin + piece_bytes, format.message);
          if (begin >= end) continue;
          Transport::put_warp(c, targets.rank[item / pieces], slot + begin, staged + begin, end - begin, lane);
          put = true;
        }
      }
      if (warp == kSendWarps - 1) {
        // position < M always (T <= M is checked); the test keeps writes inside the region regardless.
        if (lane < num_targets && targets.position[lane] < max_tokens) {
          const int32_t e = targets.expert[lane];
          Transport::put_int(c, e / experts_per_rank,
                             index + ((static_cast<int64_t>(e % experts_per_rank) * num_ranks + me) * max_tokens +
                                      targets.position[lane]) * sizeof(int32_t),
                             static_cast<int32_t>(t));
        }
        put = true;
      }
      if (put) Transport::finish_puts(lane);
    }
    __syncthreads();  // every piece of the token's rows is written
    clock_mark(kPuts);
    if (warp == 0) {  // (only warp 0 reads the targets from here on: it rewrites them for the next token)
      if (lane < num_targets) count_toward_flag<Transport>(c, layout, call, targets.expert[lane], 1);
      __syncwarp();
    }
    clock_mark(kFlags);
  }

  // Rows per expert (tokens naming it), a warp per expert, 32 tokens per ballot: counted after the puts, whose
  // stores are in flight meanwhile (the flags need the counts only once the rows are written).
  for (int32_t e = blockIdx.x + gridDim.x * warp; e < num_experts; e += gridDim.x * kSendWarps) {
    uint32_t rows = 0;
    for (int64_t first = 0; first < num_tokens; first += 32) {
      int32_t ids[kLowLatencyMaxTopk];
      load_ids(send_topk, num_topk, first + lane, num_tokens, ids);
      rows += __popc(__ballot_sync(kFullMask, names(ids, e)));
    }
    if (lane == 0) count_toward_flag<Transport>(c, layout, call, e, (uint64_t{rows} << 32) + kSentTag - rows);
  }
  if (blockIdx.x == 0) {  // entries outside [-1, E)
    int32_t invalid_here = 0;
    for (int64_t i = threadIdx.x; i < num_tokens * num_topk; i += blockDim.x) {
      const int32_t e = a.topk_idx[i];
      invalid_here += e < -1 || e >= num_experts;
    }
    if (invalid_here) atomicAdd(&invalid, invalid_here);
  }
  clock_mark(kFlags);

  const bool last = finish_block(c, layout, kDispatchSendKernel, call, 1);  // barriers: invalid is summed
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.invalid_ids = invalid;
  if (last && threadIdx.x == 0) {
    own->dispatch_calls = call;
    *a.token = call;
  }
}

// The top-k slot of the receiving expert in a received row's source token comes from the row's header (the
// first entry naming the expert; -1 if none does, which only a corrupt row could cause). Loaded before the
// row's copies, so that the latencies overlap; lane k < 16 loads entry k.
struct RowSource {
  int32_t id;

  __device__ RowSource(const DispatchRowHeader* h, int lane)
      : id(lane < kLowLatencyMaxTopk
               ? static_cast<int16_t>(__ldcg(reinterpret_cast<const unsigned short*>(h->experts + lane)))
               : -1) {}

  __device__ void write(int32_t expert, int32_t token, int lane, int32_t* token_out, int32_t* topk_slot_out) const {
    const unsigned named = __ballot_sync(kFullMask, id == expert);
    if (lane == 0) {
      *token_out = token;
      *topk_slot_out = named ? __ffs(named) - 1 : -1;
    }
  }
};

constexpr int kDispatchRecvBlocksPerSm = 2;  // blocks resident per SM (launch bounds and grid)
static_assert(kThreads >= kMaxLowLatencyRanks, "the dispatch receive waits for an expert's flags with a thread each");

// The receive: a block takes (local expert j, split) units (one each: the launch has a block per unit). Its
// first R threads wait for j's R flags (one per source rank) and the block derives j's packing (rows grouped by
// source rank, each source's rows in its index order, which is token order); then its warps copy every
// `splits`-th row of j (the source's token slot the index names) into the outputs and fill the handle past
// recv_count with -1 (rows past recv_count keep whatever the output held). An expert is packed as soon as its own
// flags are in, while other experts' rows may still be on their way.
template <typename Transport>
__global__ void __launch_bounds__(kThreads, kDispatchRecvBlocksPerSm)
    dispatch_recv_kernel(const __grid_constant__ LowLatencyCall c, const __grid_constant__ LowLatencyDispatchRecvArgs a,
                         int32_t splits) {
  __shared__ int32_t counts[kMaxLowLatencyRanks], begins[kMaxLowLatencyRanks + 1];
  enum { kWaiting, kCopying };  // phases, as kLowLatencyPhaseNames names them
  clock_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, me = c.group.rank, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, max_tokens = c.num_max_tokens, rows_per_expert = num_ranks * max_tokens;
  const int32_t experts_per_rank = static_cast<int32_t>(c.num_experts / num_ranks);
  const LowLatencyLayout layout(max_tokens, hidden, num_ranks, c.num_experts);
  const uint32_t call = *a.token, set = call & 1;
  const char* base = c.region + layout.set_offset(set);

  const uint64_t* flags = reinterpret_cast<const uint64_t*>(base + layout.dispatch_flags);
  const int32_t* index = reinterpret_cast<const int32_t*>(base + layout.dispatch_index);
  const DispatchRowFormat format(a.payload, hidden);
  const int64_t value_bytes = hidden * format.value_bytes, scale_bytes = hidden / kGroup * format.scale_bytes;
  uint64_t units = 0;
  for (int64_t unit = blockIdx.x; unit < static_cast<int64_t>(experts_per_rank) * splits; unit += gridDim.x) {
    const int32_t j = static_cast<int32_t>(unit / splits), split = static_cast<int32_t>(unit % splits);
    if (threadIdx.x < num_ranks) {
      const int s = threadIdx.x;
      const uint64_t seen = wait_until(c, LowLatencyOp::kDispatchRecv, LowLatencyWait::kFlag, s, call,
                                       [&] { return load_acquire_sys(flags + j * num_ranks + s); },
                                       [&](uint64_t v) { return static_cast<uint32_t>(v >> 32) == call; });
      counts[s] = min(static_cast<int32_t>(static_cast<uint32_t>(seen)), static_cast<int32_t>(max_tokens));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      begins[0] = 0;
      for (int s = 0; s < num_ranks; ++s) begins[s + 1] = begins[s] + counts[s];
      trace_flag_now(c, layout, kDispatchRecvKernel, call);
    }
    __syncthreads();
    clock_mark(kWaiting);
    const int32_t received = begins[num_ranks];
    if (split == 0 && threadIdx.x < num_ranks) {
      a.layout_range[(j * num_ranks + threadIdx.x) * 2] = begins[threadIdx.x];
      a.layout_range[(j * num_ranks + threadIdx.x) * 2 + 1] = counts[threadIdx.x];
      if (threadIdx.x == 0) a.recv_count[j] = received;
    }
    for (int32_t i = split + splits * warp; i < received; i += splits * kWarps) {
      int s = 0;
      while (i >= begins[s + 1]) ++s;
      const int64_t out_row = j * rows_per_expert + i;
      // The index is the source's (written before its flag); a token outside [0, M) only a corrupt index could
      // hold, and it reads as token 0 rather than outside the region.
      int32_t token = __ldcg(index + (static_cast<int64_t>(j) * num_ranks + s) * max_tokens + (i - begins[s]));
      if (token < 0 || token >= max_tokens) token = 0;
      const char* src = base + layout.dispatch_rows + (s * max_tokens + token) * layout.dispatch_slot_bytes;
      const RowSource source(reinterpret_cast<const DispatchRowHeader*>(src), lane);
      char* scales_out = scale_bytes ? static_cast<char*>(a.recv_scales) + out_row * scale_bytes : nullptr;
      warp_copy_row_pair<kRecvCopyUnroll>(static_cast<char*>(a.recv_x) + out_row * value_bytes, src + format.value(0),
                                          value_bytes, scales_out, src + format.scales, scale_bytes, lane, LoadL2{});
      source.write(me * experts_per_rank + j, token, lane, a.src_token_index + out_row, a.src_topk_index + out_row);
    }
    for (int64_t i = received + split * kThreads + threadIdx.x; i < rows_per_expert;
         i += static_cast<int64_t>(splits) * kThreads) {
      a.src_token_index[j * rows_per_expert + i] = -1;
      a.src_topk_index[j * rows_per_expert + i] = -1;
    }
    __syncthreads();  // counts and begins are the next unit's
    clock_mark(kCopying);
    ++units;
  }

  if (finish_block(c, layout, kDispatchRecvKernel, call, units)) give_credits<Transport>(c, call, /*dispatch=*/true);
}

// ---- combine ----------------------------------------------------------------------------------------------

// The send spreads the rows to return evenly over every warp of the grid, whatever the pairs (local expert j,
// source rank s) they belong to: rows are numbered pair by pair (p = j * R + s, each pair's rows in order), each
// row is cut into kCombinePieces pieces, and warp w takes pieces w, w + warps, ... (one each at decode sizes),
// putting each into its part of the source's slot (token, top-k slot). A pair's counter counts its pieces once
// written; the piece that completes it raises the pair's flag on the source (combine_piece_sent), so that the
// source can sum a token as soon as the flags of its experts are in; pairs without rows raise theirs at once.
// Handle values outside their ranges send nothing.
constexpr int kCombineSendThreads = 128;
constexpr int kCombineSendWarps = kCombineSendThreads / 32;
// Half a row per warp (twice the warps, each with half the bytes to move) measured 1.5-2.3 us faster at DeepEP's
// decode shape than a row per warp (4x H200: 64.6 against 66.1 us); thirds or quarters were slower (71 us).
constexpr int kCombinePieces = 2;

// Rows of pair p to return, from the handle's layout_range, clamped so that no value reads or writes outside
// the outputs (a dispatch handle's values always are inside).
struct PairRows {
  int64_t begin, count;
  __device__ PairRows(const int32_t* layout_range, int64_t p, int64_t max_tokens, int64_t rows_per_expert) {
    begin = min(static_cast<int64_t>(max(layout_range[2 * p], 0)), rows_per_expert);
    count = min(static_cast<int64_t>(max(layout_range[2 * p + 1], 0)), min(max_tokens, rows_per_expert - begin));
  }
};

// Pair p's flag on its source rank: the call tag, raised once p's rows are written (release: after every write
// the raising thread observed).
template <typename Transport>
__device__ __forceinline__ void raise_combine_flag(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                                   uint32_t call, int64_t p) {
  const int num_ranks = c.group.num_ranks;
  const int64_t experts_per_rank = c.num_experts / num_ranks;
  Transport::signal(c, static_cast<int>(p % num_ranks),
                    layout.set_offset(call & 1) + layout.combine_flags +
                        (c.group.rank * experts_per_rank + p / num_ranks) * static_cast<int64_t>(sizeof(uint64_t)),
                    call);
  trace_flag_now(c, layout, kCombineSendKernel, call);
}

// One thread, after a piece of a row of pair p is written and published (a barrier after its warp's puts):
// counts it; the addition that completes p's `pieces` raises p's flag and clears the counter for the next call.
template <typename Transport>
__device__ __forceinline__ void combine_piece_sent(const LowLatencyCall& c, const LowLatencyLayout& layout,
                                                   uint32_t call, int64_t p, int64_t pieces) {
  unsigned* counter = reinterpret_cast<unsigned*>(c.region + layout.combine_counters) + p;
  __threadfence();  // release: the piece's stores, which this thread saw finished, before the addition
  if (atomicAdd(counter, 1u) + 1 != pieces) return;
  __threadfence();  // acquire: the other pieces of p before the flag
  atomicExch(counter, 0u);  // every piece of p has counted; the next call's kernel starts after this one
  raise_combine_flag<Transport>(c, layout, call, p);
}

// kCompressed: each piece is a run of whole 128-value blocks, LogFMT-encoded by the warp straight into the source's
// slot where stores reach it, else into the row's staging row, whose codes and scale words are then put.
template <typename Transport, bool kCompressed>
__global__ void __launch_bounds__(kCombineSendThreads) combine_send_kernel(
    const __grid_constant__ LowLatencyCall c, const __grid_constant__ LowLatencyCombineSendArgs a) {
  extern __shared__ int64_t first_row[];  // [pairs + 1]: rows of the pairs before p, in pair order
  __shared__ alignas(16) uint32_t logfmt_words[kCombineSendWarps][kLogFmtCodeWords];  // kCompressed: a block's codes
  enum { kCredits, kPuts, kFlags };  // phases, as kLowLatencyPhaseNames names them
  clock_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, max_tokens = c.num_max_tokens, rows_per_expert = num_ranks * max_tokens;
  const int64_t pairs = c.num_experts;  // (local expert, source rank) pairs: L * R
  const LowLatencyLayout layout(max_tokens, hidden, num_ranks, c.num_experts);
  LowLatencyHeader* own = own_header(c);
  const uint32_t call = next_call(&own->combine_calls), set = call & 1;
  // The rows are numbered while the credits come: every thread loads the row counts of its run of consecutive
  // pairs (all loads in flight at once), the block scans the runs' totals, and each thread numbers its run.
  const int64_t run = (pairs + kCombineSendThreads - 1) / kCombineSendThreads, run_begin = threadIdx.x * run;
  const int64_t run_end = min(run_begin + run, pairs);
  int64_t run_rows = 0;
  for (int64_t p = run_begin; p < run_end; ++p) {
    first_row[p + 1] = PairRows(a.layout_range, p, max_tokens, rows_per_expert).count;
    run_rows += first_row[p + 1];
  }
  if (threadIdx.x == 0) first_row[0] = 0;
  for (int peer = threadIdx.x; peer < num_ranks; peer += kCombineSendThreads)
    wait_for_credit(c, LowLatencyOp::kCombineSend, call, /*dispatch=*/false, peer);
  __shared__ typename cub::BlockScan<int64_t, kCombineSendThreads>::TempStorage scan;
  int64_t before;
  cub::BlockScan<int64_t, kCombineSendThreads>(scan).ExclusiveSum(run_rows, before);
  for (int64_t p = run_begin; p < run_end; ++p) first_row[p + 1] = before += first_row[p + 1];
  __syncthreads();  // no row is written before every credit is in; the numbering is done
  clock_mark(kCredits);

  const char* y = static_cast<const char*>(a.y);
  const int64_t rows = first_row[pairs];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kCombineSendWarps;
  const int64_t piece_bytes = (layout.combine_slot_bytes / kCombinePieces + 15) / 16 * 16;
  const int64_t blocks = hidden / kLogFmtBlock, piece_blocks = (blocks + kCombinePieces - 1) / kCombinePieces;
  const int64_t piece_size = kCompressed ? piece_blocks : piece_bytes;  // blocks, or bytes
  const int64_t row_size = kCompressed ? blocks : static_cast<int64_t>(layout.combine_slot_bytes);
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kCombineSendWarps + warp; unit < rows * kCombinePieces;
       unit += warps) {
    const int64_t row = unit / kCombinePieces, begin = unit % kCombinePieces * piece_size;
    const int64_t end = min(begin + piece_size, row_size);
    // The pair p holding row: first_row[p] <= row < first_row[p + 1] (the last such p: pairs without rows
    // share their first_row with the next pair).
    const int64_t p = thrust::upper_bound(thrust::seq, first_row + 1, first_row + pairs + 1, row) - (first_row + 1);
    const PairRows pair(a.layout_range, p, max_tokens, rows_per_expert);
    const int64_t item = (p / num_ranks) * rows_per_expert + pair.begin + (row - first_row[p]);
    const int32_t t = a.src_token_index[item], k = a.src_topk_index[item];
    if (t >= 0 && t < max_tokens && k >= 0 && k < kLowLatencyMaxTopk && begin < end) {  // else not from a dispatch
      const int source = static_cast<int>(p % num_ranks);   // handle (or an empty last piece)
      const int64_t slot = layout.set_offset(set) + layout.combine_rows +
                           (static_cast<int64_t>(t) * kLowLatencyMaxTopk + k) * layout.combine_slot_bytes;
      // A source that stores do not reach gets the piece from its staging row (puts read symmetric memory only).
      const bool stores = Transport::stores_reach(c, source);
      char* staged = c.region + layout.staged_combine_row(item);
      if constexpr (kCompressed) {
        char* dst = stores ? Transport::address(c, source, slot) : staged;
        const __nv_bfloat16* src = reinterpret_cast<const __nv_bfloat16*>(y) + item * hidden;
        for (int64_t b = begin; b < end; ++b)
          logfmt_encode_block(src + b * kLogFmtBlock, dst + b * kLogFmtCodeBytes,
                              dst + blocks * kLogFmtCodeBytes + b * 4, logfmt_words[warp], lane);
        if (!stores) {  // the piece's codes, then its scale words
          __syncwarp();
          Transport::put_warp(c, source, slot + begin * kLogFmtCodeBytes, staged + begin * kLogFmtCodeBytes,
                              (end - begin) * kLogFmtCodeBytes, lane);
          Transport::put_warp(c, source, slot + blocks * kLogFmtCodeBytes + begin * 4,
                              staged + blocks * kLogFmtCodeBytes + begin * 4, (end - begin) * 4, lane);
        }
      } else {
        const char* src = y + item * layout.combine_slot_bytes + begin;
        if (!stores) {
          warp_copy_row<kCopyUnroll>(staged + begin, src, end - begin, lane, LoadL2{});
          __syncwarp();
          src = staged + begin;
        }
        Transport::put_warp(c, source, slot + begin, src, end - begin, lane);
      }
      Transport::finish_puts(lane);
    }
    clock_mark(kPuts);
    if (lane == 0) combine_piece_sent<Transport>(c, layout, call, p, pair.count * kCombinePieces);
    __syncwarp();
    clock_mark(kFlags);
  }
  // Pairs without rows: nothing to wait for.
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kCombineSendThreads + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * kCombineSendThreads)
    if (first_row[p + 1] == first_row[p]) raise_combine_flag<Transport>(c, layout, call, p);
  clock_mark(kFlags);

  if (finish_block(c, layout, kCombineSendKernel, call, 1) && threadIdx.x == 0) {
    own->combine_calls = call;
    *a.token = call;
  }
}

// Pause between two polls of a combine flag: the receive's thousands of waiting warps (every part of every
// token) otherwise hammer the flag words at the L2 that the peers' rows are arriving through; with the pause
// the op measured 2 us faster (4x H200, DeepEP's decode shape: 63.2-63.5 against 65.3 us for pauses of 100 to
// 2000 ns, while some warps still took two items, see TokenParts).
constexpr unsigned kCombineFlagPollNs = 100;

// The receive: a warp takes (token, part), waits for the flags of the token's experts (a lane per distinct
// expert), then sums, for k in order, w[t, k] * row of (t, first entry of expert k) in float32 (one rounding per
// product and per sum, as the reference), and writes BF16. Its trace is per (token, part): lane 0 times the
// wait (reading the routing included) and the sum, the block adds them up in shared memory.
constexpr int kCombineRecvBlocksPerSm = 2;  // blocks resident per SM (launch bounds and grid)
// Row loads a lane issues before summing: kEntries (top-k entries the kernel handles: 8, or kLowLatencyMaxTopk)
// for each of kRowLoadsInFlight / kEntries chunks, what the register budget of two blocks per SM holds. ptxas
// follows each predicated load with a predicated move that waits for it, so the SASS keeps at most 2 in flight;
// the K <= 8 kernel (fewer shuffles and tests per chunk) still measured 52.6 against 54.0 us for the 16-entry one
// at DeepEP's decode shape. (Unconditional loads from in-range addresses would keep 15 in flight; docs/perf-log.md
// has the figure and why that version was not kept.)
constexpr int kRowLoadsInFlight = kLowLatencyMaxTopk;

// kCompressed: the rows arrive LogFMT-encoded (combine_send_kernel) and are decoded as they are loaded.
template <typename Transport, int kEntries, bool kCompressed>
__global__ void __launch_bounds__(kThreads, kCombineRecvBlocksPerSm)
    combine_recv_kernel(const __grid_constant__ LowLatencyCall c, const __grid_constant__ LowLatencyCombineRecvArgs a,
                        TokenParts split) {
  enum { kWaiting, kSumming };  // phases, as kLowLatencyPhaseNames names them
  constexpr int kChunksInFlight = kRowLoadsInFlight / kEntries;
  __shared__ unsigned long long item_ns[2], items, first_ready, last_ready;
  clock_begin();
  const int lane = threadIdx.x % 32;
  const int64_t hidden = c.hidden, num_topk = a.num_topk;
  const int32_t num_experts = static_cast<int32_t>(c.num_experts);
  const int32_t experts_per_rank = static_cast<int32_t>(num_experts / c.group.num_ranks);
  const LowLatencyLayout layout(c.num_max_tokens, hidden, c.group.num_ranks, num_experts);
  const uint32_t call = *a.token, set = call & 1;
  const char* base = c.region + layout.set_offset(set);
  if (kInstrumented) {
    if (threadIdx.x == 0) {
      item_ns[kWaiting] = item_ns[kSumming] = items = last_ready = 0;
      first_ready = ~0ull;
    }
    __syncthreads();
  }

  const uint64_t* flags = reinterpret_cast<const uint64_t*>(base + layout.combine_flags);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  for (int64_t item = global_warp(); item < a.num_tokens * split.parts; item += num_global_warps()) {
    const uint64_t begin = kInstrumented && lane == 0 ? now_ns() : 0;
    const int64_t t = item / split.parts, part = item % split.parts;
    int32_t expert = -1, slot = lane;
    float weight = 0.f;
    if (lane < num_topk) {
      expert = a.topk_idx[t * num_topk + lane];
      if (expert < 0 || expert >= num_experts) expert = -1;
      weight = a.topk_weights[t * num_topk + lane];
    }
    for (int k = 0; k < num_topk; ++k) {  // slot: the first entry naming this lane's expert
      const int32_t other = __shfl_sync(kFullMask, expert, k);
      if (k < lane && other == expert && slot == lane) slot = k;
    }
    if (expert >= 0 && slot == lane)
      wait_until(c, LowLatencyOp::kCombineRecv, LowLatencyWait::kFlag, expert / experts_per_rank, call,
                 [&] { return load_acquire_sys(flags + expert); },
                 [&](uint64_t v) { return static_cast<uint32_t>(v) == call; }, kCombineFlagPollNs);
    __syncwarp();  // the lanes' acquires order every lane's row loads below
    uint64_t ready = 0;
    if (kInstrumented && lane == 0) {
      ready = now_ns();
      atomicAdd(&item_ns[kWaiting], static_cast<unsigned long long>(ready - begin));
      atomicMin(&first_ready, static_cast<unsigned long long>(ready));
      atomicMax(&last_ready, static_cast<unsigned long long>(ready));
    }
    const int64_t chunk_end = min((part + 1) * split.chunks_per_part * kChunk, hidden);
    for (int64_t first = part * split.chunks_per_part * kChunk; first < chunk_end; first += kChunksInFlight * kChunk) {
      // Every entry's load of kChunksInFlight chunks is issued before the first is used (see kRowLoadsInFlight
      // for how many the SASS keeps in flight); the sum still runs in k order.
      uint4 rows[kChunksInFlight][kEntries];
#pragma unroll
      for (int u = 0; u < kChunksInFlight; ++u) {
        const int64_t ch = first + u * kChunk + lane * kLaneChannels;
#pragma unroll
        for (int k = 0; k < kEntries; ++k) {
          const int32_t e = __shfl_sync(kFullMask, expert, k);
          const int32_t s = __shfl_sync(kFullMask, slot, k);
          if (k < num_topk && e >= 0 && ch < chunk_end) {
            const char* row = base + layout.combine_rows + (t * kLowLatencyMaxTopk + s) * layout.combine_slot_bytes;
            if constexpr (kCompressed)
              rows[u][k] = logfmt_load8(row, hidden / kLogFmtBlock, ch);
            else
              rows[u][k] = __ldcg(reinterpret_cast<const uint4*>(row + ch * 2));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kChunksInFlight; ++u) {
        const int64_t ch = first + u * kChunk + lane * kLaneChannels;
        float acc[kLaneChannels];
#pragma unroll
        for (int i = 0; i < kLaneChannels; ++i) acc[i] = 0.f;
#pragma unroll
        for (int k = 0; k < kEntries; ++k) {
          const int32_t e = __shfl_sync(kFullMask, expert, k);
          const float w = __shfl_sync(kFullMask, weight, k);
          if (k >= num_topk || e < 0 || ch >= chunk_end) continue;
          float v[kLaneChannels];
          if constexpr (kCompressed)
            logfmt_decode8(rows[u][k], ch, v);
          else
            bf16x8_to_float(rows[u][k], v);
#pragma unroll
          for (int i = 0; i < kLaneChannels; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
        }
        if (ch >= chunk_end) continue;
        __nv_bfloat16 packed[kLaneChannels];
#pragma unroll
        for (int i = 0; i < kLaneChannels; ++i) packed[i] = __float2bfloat16_rn(acc[i]);
        *reinterpret_cast<uint4*>(out + t * hidden + ch) = *reinterpret_cast<const uint4*>(packed);
      }
    }
    if (kInstrumented && lane == 0) {
      atomicAdd(&item_ns[kSumming], static_cast<unsigned long long>(now_ns() - ready));
      atomicAdd(&items, 1ull);
    }
  }

  if (kInstrumented) {
    __syncthreads();  // the block's items are timed
    if (threadIdx.x == 0) {
      block_clock().phase_ns[kWaiting] = item_ns[kWaiting];
      block_clock().phase_ns[kSumming] = item_ns[kSumming];
      if (items) {
        LowLatencyTrace* trace = trace_slot(c, layout, kCombineRecvKernel, call);
        trace_flag(trace, first_ready);
        trace_flag(trace, last_ready);
      }
    }
  }
  if (finish_block(c, layout, kCombineRecvKernel, call, items)) give_credits<Transport>(c, call, /*dispatch=*/false);
}

// ---- launches ----------------------------------------------------------------------------------------------

// The combine receive's grid: kCombineRecvBlocksPerSm blocks per SM at most, so that enough row loads are in
// flight (the sum is bound by their latency).
int blocks_for_warps(const LowLatencyCall& c, int64_t warps) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(int64_t{c.group.device_sms} * kCombineRecvBlocksPerSm, (warps + kWarps - 1) / kWarps)));
}

// Items (token, part) enough for one wave of warps over the device.
TokenParts token_parts(const LowLatencyCall& c, int64_t num_tokens) {
  return TokenParts(num_tokens, c.hidden, int64_t{c.group.device_sms} * kCombineRecvBlocksPerSm * kWarps);
}

}  // namespace

cudaError_t low_latency_dispatch_send(const LowLatencyCall& call, const LowLatencyDispatchSendArgs& args) {
  if (args.num_topk > kLowLatencyMaxTopk || args.num_tokens < 1 || args.num_tokens > call.num_max_tokens ||
      args.num_tokens * args.num_topk > kLowLatencyMaxEntries || call.num_experts > kLowLatencyMaxExperts)
    return cudaErrorInvalidValue;
  // Shared memory: the routing as int16 (at most 16 KB at the bounds).
  const size_t shared = sizeof(int16_t) * static_cast<size_t>(args.num_tokens * args.num_topk);
  // A block per token (T <= SMs at DeepEP's decode shape), every SM at most.
  const int blocks = static_cast<int>(std::min<int64_t>(call.group.device_sms, args.num_tokens));
  return with_transport(call, [&](auto transport) {
    dispatch_send_kernel<decltype(transport)><<<blocks, kSendThreads, shared, call.stream>>>(call, args);
    return cudaGetLastError();
  });
}

cudaError_t low_latency_dispatch_recv(const LowLatencyCall& call, const LowLatencyDispatchRecvArgs& args) {
  // Units (local expert, split), a block each: as many splits of each expert's rows as keep every block
  // resident at once (kDispatchRecvBlocksPerSm per SM). Fewer splits leave an expert's rows to fewer warps,
  // more start blocks in a second wave, which ends the kernel a unit later. At DeepEP's decode shape (4x H200,
  // L = 72) 3 splits (216 blocks) measured 26.9 us for the FP8 dispatch, 2 splits 27.6, 4 splits (288 blocks)
  // 29.7.
  const int64_t experts_per_rank = call.num_experts / call.group.num_ranks;
  const int32_t splits = static_cast<int32_t>(std::clamp<int64_t>(
      int64_t{call.group.device_sms} * kDispatchRecvBlocksPerSm / experts_per_rank, 1, kWarps));
  const int blocks = static_cast<int>(experts_per_rank * splits);
  return with_transport(call, [&](auto transport) {
    dispatch_recv_kernel<decltype(transport)><<<blocks, kThreads, 0, call.stream>>>(call, args, splits);
    return cudaGetLastError();
  });
}

cudaError_t low_latency_combine_send(const LowLatencyCall& call, const LowLatencyCombineSendArgs& args) {
  // Warps for about a piece each at decode sizes (a rank returns T * K rows on average, T <= M, so T * K *
  // kCombinePieces pieces): E * kCombinePieces blocks of 4 warps, at least 2 * kCombinePieces per SM. Shared
  // memory: the row numbering, 8 bytes per pair (32 KB at most).
  const int blocks = static_cast<int>(std::max<int64_t>(call.num_experts, 2 * call.group.device_sms)) * kCombinePieces;
  const size_t shared = sizeof(int64_t) * static_cast<size_t>(call.num_experts + 1);
  return with_transport(call, [&](auto transport) {
    using Transport = decltype(transport);
    if (args.compression == LowLatencyCompression::kLogFmt)
      combine_send_kernel<Transport, true><<<blocks, kCombineSendThreads, shared, call.stream>>>(call, args);
    else
      combine_send_kernel<Transport, false><<<blocks, kCombineSendThreads, shared, call.stream>>>(call, args);
    return cudaGetLastError();
  });
}

cudaError_t low_latency_combine_recv(const LowLatencyCall& call, const LowLatencyCombineRecvArgs& args) {
  if (args.num_topk > kLowLatencyMaxTopk || args.num_tokens > call.num_max_tokens) return cudaErrorInvalidValue;
  const TokenParts split = token_parts(call, args.num_tokens);
  return with_transport(call, [&](auto transport) {
    using Transport = decltype(transport);
    const int blocks = blocks_for_warps(call, args.num_tokens * split.parts);
    auto launch = [&](auto compressed) {
      constexpr bool kCompressed = decltype(compressed)::value;
      if (args.num_topk <= 8)  // two chunks per round of loads
        combine_recv_kernel<Transport, 8, kCompressed><<<blocks, kThreads, 0, call.stream>>>(call, args, split);
      else
        combine_recv_kernel<Transport, kLowLatencyMaxTopk, kCompressed><<<blocks, kThreads, 0, call.stream>>>(
            call, args, split);
    };
    if (args.compression == LowLatencyCompression::kLogFmt)
      launch(std::true_type{});
    else
      launch(std::false_type{});
    return cudaGetLastError();
  });
}

std::string low_latency_lookup(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport,
                               int64_t ll_offset, LowLatencyCall* call, int64_t* available_bytes) {
  call->transport = transport;
  switch (transport) {
    case LowLatencyTransport::kPeerStores: {
      IntranodeRank group;
      if (!intranode_lookup(buffer_id, device_ordinal, &group))
        return "no intranode state of buffer " + std::to_string(buffer_id) + " on CUDA device " +
               std::to_string(device_ordinal);
      call->group = LowLatencyRank{group.rank, group.num_ranks, group.device_sms, group.error};
      for (int p = 0; p < group.num_ranks; ++p) call->peer_regions[p] = group.workspaces[p] + ll_offset;
      call->region = call->peer_regions[group.rank];
      *available_bytes = group.workspace_bytes - ll_offset;
      return "";
    }
    case LowLatencyTransport::kNvshmem: {
#if defined(JAX_EP_WITH_NVSHMEM)
      SymmetricRegion symmetric;
      if (!nvshmem_region_lookup(buffer_id, device_ordinal, &symmetric))
        return "no NVSHMEM region of buffer " + std::to_string(buffer_id) + " on CUDA device " +
               std::to_string(device_ordinal);
      call->group = LowLatencyRank{symmetric.rank, symmetric.num_ranks, symmetric.device_sms, symmetric.error};
      call->region = symmetric.base + ll_offset;
      for (int p = 0; p < symmetric.num_ranks; ++p) {
        call->pes[p] = symmetric.pes[p];
        call->peer_regions[p] = symmetric.node_regions[p] ? symmetric.node_regions[p] + ll_offset : nullptr;
      }
      *available_bytes = symmetric.bytes - ll_offset;
      return "";
#else
      return "this jax_ep was built without NVSHMEM";
#endif
    }
  }
  return "unknown low-latency transport " + std::to_string(static_cast<int>(transport));
}

#if defined(JAX_EP_INSTRUMENT)
std::vector<std::vector<uint64_t>> low_latency_trace(int64_t buffer_id, const std::vector<int>& device_ordinals,
                                                     LowLatencyTransport transport, int64_t ll_offset, bool reset) {
  constexpr size_t kWords = kLowLatencyTraceBytes / sizeof(uint64_t);
  std::vector<std::vector<uint64_t>> traces;
  int current = 0;
  JAX_EP_CUDA_THROW(cudaGetDevice(&current));
  for (int device : device_ordinals) {
    LowLatencyCall call;
    int64_t available = 0;
    if (!low_latency_lookup(buffer_id, device, transport, ll_offset, &call, &available).empty()) continue;
    JAX_EP_CUDA_THROW(cudaSetDevice(device));
    char* trace = call.region + kLowLatencyTraceOffset;
    std::vector<uint64_t> words(kWords);
    JAX_EP_CUDA_THROW(cudaMemcpy(words.data(), trace, kLowLatencyTraceBytes, cudaMemcpyDeviceToHost));
    if (reset) {
      const std::vector<LowLatencyTrace> prepared(kLowLatencyKernels * kLowLatencyTraceCalls, prepared_trace());
      JAX_EP_CUDA_THROW(cudaMemcpy(trace, prepared.data(), kLowLatencyTraceBytes, cudaMemcpyHostToDevice));
    }
    traces.push_back(std::move(words));
  }
  JAX_EP_CUDA_THROW(cudaSetDevice(current));
  return traces;
}

std::pair<std::vector<std::string>, std::vector<std::vector<std::string>>> low_latency_trace_fields() {
  std::vector<std::vector<std::string>> phases;
  for (const auto& names : kLowLatencyPhaseNames) phases.emplace_back(std::begin(names), std::end(names));
  return {std::vector<std::string>(std::begin(kLowLatencyTraceFields), std::end(kLowLatencyTraceFields)), phases};
}
#endif

std::vector<std::string> low_latency_errors(int64_t buffer_id, const std::vector<int>& device_ordinals) {
  return timeout_errors(buffer_id, static_cast<int32_t>(LowLatencyOp::kDispatchSend),
                        static_cast<int32_t>(LowLatencyOp::kCombineRecv), &device_ordinals);
}

}  // namespace jax_ep
