// Low-latency (LL) dispatch and combine kernels (ARCHITECTURE.md §3 "Low-latency", §4): each op is a send half
// and a receive half, separate launches joined by a token (the call number) so that XLA can schedule work
// between them. Rows reach the other ranks through a transport policy (low_latency_transport.cuh): plain stores
// through peer pointers (NVLink peer access, or CUDA IPC mappings), or NVSHMEM puts into symmetric memory; the
// LL region of each rank is laid out in low_latency_state.h. Kernels only ever read their own rank's region.
//
// Protocol of call c of one op (dispatch and combine keep separate counters, regions and credits):
//  send:  reads c = (own calls) + 1 from the device (graph replay advances it), waits until every peer's
//         receive of call c - 2 finished reading buffer set c % 2 (a credit: peers may drift, and at most two
//         calls of an op are between send and receive), writes its rows into set c % 2 of the receivers,
//         then, once every block is done, one flag per (expert, source) carrying the tag c (and for dispatch
//         the row count). Flags carry the call number instead of being cleaned between calls, so a stale
//         flag of call c - 2 never reads as ready and no cleaning pass races with a fast peer.
//  recv:  takes c from the send's token, waits (bounded) for every flag of its set to carry c, copies the
//         rows into the outputs, and when every block is done writes "set c % 2 read up to call c" into the
//         credit words of every sender.
// Every wait is bounded by timeout_ns: on expiry the kernel fills the host-mapped error record (op, rank,
// peer, call) and traps. A third send of one op before the receive of the first waits for a credit that
// cannot come: that misuse ends in such a timeout, naming the credit wait.
// Blocks never wait for other blocks of their own kernel, so grids need not be co-resident.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <vector>

#include "api.h"
#include "cuda_check.h"
#include "device_common.cuh"
#include "intranode_state.h"
#include "low_latency_state.h"
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

__device__ __forceinline__ int global_warp() { return (blockIdx.x * kThreads + threadIdx.x) / 32; }
__device__ __forceinline__ int num_global_warps() { return gridDim.x * kWarps; }

// ---- bounded waits -----------------------------------------------------------------------------------------

// Spins until done(load()) and returns the last value loaded, or fails after c.timeout_ns.
template <typename Load, typename Done>
__device__ __forceinline__ uint64_t wait_until(const LowLatencyCall& c, LowLatencyOp op, LowLatencyWait wait,
                                               int peer, uint32_t call, Load load, Done done) {
  uint64_t seen = load();
  if (done(seen)) return seen;
  const uint64_t start = now_ns();
  while (!done(seen = load())) {
    const int64_t waited = static_cast<int64_t>(now_ns() - start);
    if (waited > c.timeout_ns)
      fail_on_timeout(&own_header(c)->error_claimed, c.group.error, c.group.rank, static_cast<int32_t>(op),
                      static_cast<int32_t>(wait), peer, call, seen, waited);
  }
  return seen;
}

// Send halves, before writing into set call % 2 of the peers: every peer's receive of call - 2 (the previous
// user of that set) has finished reading it, as the credit words it wrote into this rank's header say.
// Threads < num_ranks wait, one peer each.
__device__ __forceinline__ void wait_for_credits(const LowLatencyCall& c, LowLatencyOp op, uint32_t call,
                                                 bool dispatch) {
  if (threadIdx.x < c.group.num_ranks) {
    const int peer = threadIdx.x;
    const uint64_t* credit = reinterpret_cast<const uint64_t*>(c.region + credit_offset(dispatch, peer, call & 1));
    wait_until(c, op, LowLatencyWait::kCredit, peer, call, [&] { return load_acquire_sys(credit); },
               [&](uint64_t seen) { return call_reached(static_cast<uint32_t>(seen), call - 2); });
  }
  __syncthreads();
}

// Receive halves, in the last block once every block finished reading set call % 2: tells every sender
// (threads < num_ranks, one each) that it may write into that set again.
template <typename Transport>
__device__ __forceinline__ void give_credits(const LowLatencyCall& c, uint32_t call, bool dispatch) {
  if (threadIdx.x < c.group.num_ranks)
    Transport::signal(c, threadIdx.x, credit_offset(dispatch, c.group.rank, call & 1), call);
}

// Every kernel calls this first: block 0 notes the start time of the call.
__device__ __forceinline__ void start_clock(LowLatencyHeader* own, LowLatencyKernel kernel) {
  if (blockIdx.x == 0 && threadIdx.x == 0) own->kernel_start[kernel] = now_ns();
}

// Every block calls this after its work; true in the one block that finished last, which then sees every
// other block's writes (and may publish them to peers with release stores). That block also adds the call's
// time (block 0's start to now) to the kernel's sums.
__device__ __forceinline__ bool is_last_block(LowLatencyHeader* own, LowLatencyKernel kernel) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&own->blocks_finished[kernel], 1u) == gridDim.x - 1;
    if (last) {
      own->blocks_finished[kernel] = 0;  // every block has counted: ready for the next call
      own->kernel_ns[kernel] += now_ns() - *reinterpret_cast<volatile uint64_t*>(&own->kernel_start[kernel]);
      own->kernel_calls[kernel] += 1;
    }
    __threadfence_system();
  }
  __syncthreads();
  return last;
}

// The call number of a send half: one more than the calls this rank completed (read by every block at start;
// only the last block of a call advances it).
__device__ __forceinline__ uint32_t next_call(const uint32_t* completed) {
  __shared__ uint32_t call;
  if (threadIdx.x == 0) call = *reinterpret_cast<const volatile uint32_t*>(completed) + 1;
  __syncthreads();
  return call;
}

// ---- row copies --------------------------------------------------------------------------------------------

// Local row copies read at L2 (LoadL2): the rows were written by peers during this call.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  warp_copy_row<kCopyUnroll>(dst, src, bytes, lane, LoadL2{});
}

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
  uint8_t q[kLaneChannels];
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) q[i] = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], s), __NV_SATFINITE, __NV_E4M3);
  uint2 out;
  memcpy(&out, q, sizeof(out));
  return out;
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&v)[kLaneChannels]) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) v[i] = __bfloat162float(h[i]);
}

// Work items (token, part): a token's channels split into `parts` ranges of whole chunks, so that small
// batches still spread over every SM.
struct TokenParts {
  int64_t parts, chunks_per_part;
  __host__ __device__ TokenParts(int64_t num_tokens, int64_t hidden, int64_t warps_wanted) {
    const int64_t chunks = (hidden + kChunk - 1) / kChunk;
    parts = std::min(chunks, std::max<int64_t>(1, (warps_wanted + num_tokens - 1) / num_tokens));
    chunks_per_part = (chunks + parts - 1) / parts;
  }
};

// ---- dispatch ---------------------------------------------------------------------------------------------

// Before the send: position[t, k] = rank of token t among this rank's tokens routed to expert topk_idx[t, k]
// (token order), on the first entry of each distinct expert of t; -1 elsewhere. A warp takes one expert and
// scans the tokens 32 at a time (a ballot gives the prefix count): no atomics, so deterministic.
__global__ void __launch_bounds__(kThreads) dispatch_route_kernel(const __grid_constant__ LowLatencyCall c,
                                                                  const __grid_constant__ LowLatencyDispatchSendArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t num_tokens = a.num_tokens, num_topk = a.num_topk;
  const int32_t num_experts = static_cast<int32_t>(c.num_experts);
  LowLatencyHeader* own = own_header(c);
  start_clock(own, kDispatchRoute);
  if (blockIdx.x == 0) {  // entries outside [0, E) get no position; those outside [-1, E) are counted
    __shared__ int32_t invalid;
    if (threadIdx.x == 0) invalid = 0;
    __syncthreads();
    int32_t own = 0;
    for (int64_t i = threadIdx.x; i < num_tokens * num_topk; i += kThreads) {
      const int32_t e = a.topk_idx[i];
      if (e < 0 || e >= num_experts) {
        a.position[i] = -1;
        own += e != -1;
      }
    }
    if (own) atomicAdd(&invalid, own);
    __syncthreads();
    if (threadIdx.x == 0) *a.invalid_ids = invalid;
  }
  for (int32_t e = global_warp(); e < num_experts; e += num_global_warps()) {
    int32_t routed = 0;
    for (int64_t first = 0; first < num_tokens; first += 32) {
      const int64_t t = first + lane;
      int32_t k_first = -1;
      if (t < num_tokens) {
        for (int64_t k = 0; k < num_topk; ++k) {
          if (a.topk_idx[t * num_topk + k] != e) continue;
          if (k_first < 0)
            k_first = static_cast<int32_t>(k);
          else
            a.position[t * num_topk + k] = -1;  // a repeat of the expert: its row is the first entry's
        }
      }
      const unsigned routed_lanes = __ballot_sync(kFullMask, k_first >= 0);
      if (k_first >= 0) a.position[t * num_topk + k_first] = routed + __popc(routed_lanes & ((1u << lane) - 1u));
      routed += __popc(routed_lanes);
    }
    if (lane == 0) a.expert_count[e] = routed;
  }
  is_last_block(own, kDispatchRoute);
}

// Byte offsets inside a dispatch slot row: the DispatchRowHeader, the values, then (FP8) the scales.
struct DispatchRowFormat {
  int64_t value_bytes;  // per channel: 2 (BF16) or 1 (FP8)
  int64_t scale_bytes;  // per 128 channels: 0 (BF16), 4 (FP8 float32 scales) or 1 (UE8M0 exponent bytes)
  int64_t scales;       // offset of the scales

  __device__ DispatchRowFormat(LowLatencyPayload payload, int64_t hidden)
      : value_bytes(payload == LowLatencyPayload::kBF16 ? 2 : 1),
        scale_bytes(payload == LowLatencyPayload::kFP8 ? 4 : payload == LowLatencyPayload::kFP8UE8M0 ? 1 : 0),
        scales(static_cast<int64_t>(sizeof(DispatchRowHeader)) + hidden * value_bytes) {}
  __device__ int64_t value(int64_t channel) const { return sizeof(DispatchRowHeader) + channel * value_bytes; }
  __device__ int64_t scale(int64_t channel) const { return scales + channel / kGroup * scale_bytes; }
};

// The handle entries of a received row, from its header: the source token and the top-k slot of `expert` in
// it (the first entry naming the expert; -1 if none does, which only a corrupt row could cause).
__device__ __forceinline__ void write_row_source(const DispatchRowHeader* h, int32_t expert, int lane,
                                                 int32_t* token, int32_t* topk_slot) {
  const int32_t id = lane < kLowLatencyMaxTopk
                         ? static_cast<int16_t>(__ldcg(reinterpret_cast<const unsigned short*>(h->experts + lane)))
                         : -1;
  const unsigned named = __ballot_sync(kFullMask, id == expert);
  if (lane == 0) {
    *token = __ldcg(&h->token);
    *topk_slot = named ? __ffs(named) - 1 : -1;
  }
}

// The send: a warp takes (token, part), loads each 256-channel chunk once, casts it (FP8: one scale per 128
// channels, 16 lanes a group) into the token's staging row, then puts its part of that row (and part 0 the
// row header) into the slot of every distinct expert of the token, on that expert's rank. The last block then
// raises one flag per expert: (call << 32) | rows sent to it.
template <typename Transport>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(const __grid_constant__ LowLatencyCall c,
                                                                 const __grid_constant__ LowLatencyDispatchSendArgs a,
                                                                 TokenParts split) {
  const int lane = threadIdx.x % 32, me = c.group.rank, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, num_topk = a.num_topk, max_tokens = c.num_max_tokens;
  const int32_t experts_per_rank = static_cast<int32_t>(c.num_experts / num_ranks);
  const LowLatencyLayout layout(max_tokens, hidden, c.num_experts);
  LowLatencyHeader* own = own_header(c);
  start_clock(own, kDispatchSendKernel);
  const uint32_t call = next_call(&own->dispatch_calls), set = call & 1;
  wait_for_credits(c, LowLatencyOp::kDispatchSend, call, /*dispatch=*/true);

  const bool fp8 = a.payload != LowLatencyPayload::kBF16, ue8m0 = a.payload == LowLatencyPayload::kFP8UE8M0;
  const DispatchRowFormat format(a.payload, hidden);
  const int64_t slots = layout.set_offset(set) + layout.dispatch_rows;
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);
  for (int64_t item = global_warp(); item < a.num_tokens * split.parts; item += num_global_warps()) {
    const int64_t t = item / split.parts, part = item % split.parts;
    int32_t expert = -1, position = -1;
    if (lane < num_topk) {
      position = a.position[t * num_topk + lane];
      if (position >= 0) expert = a.topk_idx[t * num_topk + lane];
    }
    // position < max_tokens always (T <= M is checked); the test keeps writes inside the region regardless.
    const unsigned targets = __ballot_sync(kFullMask, position >= 0 && position < max_tokens);
    char* staged = c.region + layout.dispatch_staging + t * layout.dispatch_slot_bytes;
    if (part == 0 && lane < kLowLatencyMaxTopk) {  // the row header
      DispatchRowHeader* h = reinterpret_cast<DispatchRowHeader*>(staged);
      int32_t id = -1;
      if (lane < num_topk) id = a.topk_idx[t * num_topk + lane];
      h->experts[lane] = static_cast<int16_t>(id >= 0 && id < c.num_experts ? id : -1);
      if (lane == 0) h->token = static_cast<int32_t>(t);
    }
    const int64_t chunk_begin = part * split.chunks_per_part * kChunk;
    const int64_t chunk_end = min(chunk_begin + split.chunks_per_part * kChunk, hidden);
    if (chunk_begin >= chunk_end && part != 0) continue;
    // Loads of kPrefetch chunks are issued together, so their latency is paid once per kPrefetch chunks.
    constexpr int kPrefetch = 4;
    uint4 prefetched[kPrefetch];
    for (int64_t chunk = chunk_begin, u = 0; chunk < chunk_end; chunk += kChunk, ++u) {
      if (u % kPrefetch == 0) {
#pragma unroll
        for (int p = 0; p < kPrefetch; ++p) {
          const int64_t ch = chunk + p * kChunk + lane * kLaneChannels;
          prefetched[p] = ch < chunk_end ? __ldg(reinterpret_cast<const uint4*>(x + t * hidden + ch))
                                         : make_uint4(0, 0, 0, 0);
        }
      }
      const int64_t ch = chunk + lane * kLaneChannels;
      const bool active = ch < hidden;  // hidden is a multiple of 128: whole 16-lane groups are active or not
      uint4 raw = prefetched[0];
#pragma unroll
      for (int p = 1; p < kPrefetch; ++p)
        if (u % kPrefetch == p) raw = prefetched[p];
      if (!fp8) {
        if (active) *reinterpret_cast<uint4*>(staged + format.value(ch)) = raw;
        continue;
      }
      float v[kLaneChannels], scale = 0.f;
      bf16x8_to_float(raw, v);
      const uint2 q = cast_to_fp8(v, a.round_scale, &scale);
      if (!active) continue;
      *reinterpret_cast<uint2*>(staged + format.value(ch)) = q;
      if (lane % (kGroup / kLaneChannels) == 0) {  // the group's first lane writes its scale
        if (ue8m0)  // byte i of packed word w is group 4w + i: the packed scales are one byte per group
          *reinterpret_cast<uint8_t*>(staged + format.scale(ch)) = static_cast<uint8_t>(__float_as_uint(scale) >> 23);
        else
          *reinterpret_cast<float*>(staged + format.scale(ch)) = scale;
      }
    }
    __syncwarp();  // the part is staged: every lane reads what the others wrote
    // This warp's bytes of the row: its values (from the row's start for part 0: the header too) and scales.
    const int64_t values_begin = part == 0 ? 0 : format.value(chunk_begin), values_end = format.value(chunk_end);
    const int64_t scales_begin = format.scale(chunk_begin), scales_end = format.scale(chunk_end);
    for (unsigned todo = targets; todo; todo &= todo - 1) {
      const int target_lane = __ffs(todo) - 1;
      const int32_t e = __shfl_sync(kFullMask, expert, target_lane);
      const int32_t pos = __shfl_sync(kFullMask, position, target_lane);
      const int32_t j = e % experts_per_rank;
      const int64_t slot = slots + ((j * num_ranks + me) * max_tokens + pos) * layout.dispatch_slot_bytes;
      const int rank = e / experts_per_rank;
      Transport::put_warp(c, rank, slot + values_begin, staged + values_begin, values_end - values_begin, lane);
      if (scales_end > scales_begin)
        Transport::put_warp(c, rank, slot + scales_begin, staged + scales_begin, scales_end - scales_begin, lane);
    }
  }
  Transport::finish_puts(lane);

  if (!is_last_block(own, kDispatchSendKernel)) return;
  for (int32_t e = threadIdx.x; e < c.num_experts; e += kThreads) {
    const int32_t rank = e / experts_per_rank, j = e % experts_per_rank;
    Transport::signal(c, rank, layout.set_offset(set) + layout.dispatch_flags + (j * num_ranks + me) * 8,
                      (uint64_t{call} << 32) | static_cast<uint32_t>(a.expert_count[e]));
  }
  if (threadIdx.x == 0) {
    own->dispatch_calls = call;
    *a.token = call;
  }
}

// The receive: waits for the L*R flags of its set, packs each local expert's rows by (source rank, position)
// into the outputs (rows past recv_count keep whatever the buffer held; their handle entries are -1).
template <typename Transport>
__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(const __grid_constant__ LowLatencyCall c,
                                                                 const __grid_constant__ LowLatencyDispatchRecvArgs a) {
  extern __shared__ int32_t counts_and_begins[];  // [L*R] rows per (expert, source), then [L*R] first rows
  const int lane = threadIdx.x % 32, me = c.group.rank, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, max_tokens = c.num_max_tokens;
  const int32_t experts_per_rank = static_cast<int32_t>(c.num_experts / num_ranks);
  const int32_t pairs = experts_per_rank * num_ranks;
  int32_t* counts = counts_and_begins;
  int32_t* begins = counts_and_begins + pairs;
  const LowLatencyLayout layout(max_tokens, hidden, c.num_experts);
  const uint32_t call = *a.token, set = call & 1;
  const char* base = c.region + layout.set_offset(set);
  LowLatencyHeader* own = own_header(c);
  start_clock(own, kDispatchRecvKernel);

  const uint64_t* flags = reinterpret_cast<const uint64_t*>(base + layout.dispatch_flags);
  for (int32_t i = threadIdx.x; i < pairs; i += kThreads) {
    const uint64_t seen = wait_until(c, LowLatencyOp::kDispatchRecv, LowLatencyWait::kFlag, i % num_ranks, call,
                                     [&] { return load_acquire_sys(flags + i); },
                                     [&](uint64_t v) { return static_cast<uint32_t>(v >> 32) == call; });
    counts[i] = min(static_cast<int32_t>(static_cast<uint32_t>(seen)), static_cast<int32_t>(max_tokens));
  }
  __syncthreads();
  for (int32_t j = threadIdx.x; j < experts_per_rank; j += kThreads) {
    int32_t running = 0;
    for (int s = 0; s < num_ranks; ++s) {
      begins[j * num_ranks + s] = running;
      running += counts[j * num_ranks + s];
    }
    if (blockIdx.x == 0) {
      a.recv_count[j] = running;
      for (int s = 0; s < num_ranks; ++s) {
        a.layout_range[(j * num_ranks + s) * 2] = begins[j * num_ranks + s];
        a.layout_range[(j * num_ranks + s) * 2 + 1] = counts[j * num_ranks + s];
      }
    }
  }
  __syncthreads();

  const DispatchRowFormat format(a.payload, hidden);
  const int64_t value_bytes = hidden * format.value_bytes, scale_bytes = hidden / kGroup * format.scale_bytes;
  const int64_t rows_per_expert = num_ranks * max_tokens;
  for (int64_t slot = global_warp(); slot < pairs * max_tokens; slot += num_global_warps()) {
    const int32_t pair = static_cast<int32_t>(slot / max_tokens), pos = static_cast<int32_t>(slot % max_tokens);
    if (pos >= counts[pair]) continue;
    const int32_t j = pair / num_ranks;
    const int64_t out_row = j * rows_per_expert + begins[pair] + pos;
    const char* src = base + layout.dispatch_rows + slot * layout.dispatch_slot_bytes;
    warp_copy(static_cast<char*>(a.recv_x) + out_row * value_bytes, src + format.value(0), value_bytes, lane);
    if (scale_bytes)
      warp_copy(static_cast<char*>(a.recv_scales) + out_row * scale_bytes, src + format.scales, scale_bytes, lane);
    write_row_source(reinterpret_cast<const DispatchRowHeader*>(src), me * experts_per_rank + j, lane,
                     a.src_token_index + out_row, a.src_topk_index + out_row);
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < experts_per_rank * rows_per_expert;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int32_t j = static_cast<int32_t>(i / rows_per_expert);
    const int32_t last = j * num_ranks + num_ranks - 1;
    if (i % rows_per_expert >= begins[last] + counts[last]) {
      a.src_token_index[i] = -1;
      a.src_topk_index[i] = -1;
    }
  }

  if (is_last_block(own, kDispatchRecvKernel)) give_credits<Transport>(c, call, /*dispatch=*/true);
}

// ---- combine ----------------------------------------------------------------------------------------------

// The send: a warp takes an output row (local expert j, row i < its count), finds its source rank from
// layout_range and puts the row into the source's slot (token, top-k slot). The last block then raises, on
// every source rank, the flag of each local expert.
template <typename Transport>
__global__ void __launch_bounds__(kThreads) combine_send_kernel(const __grid_constant__ LowLatencyCall c,
                                                                const __grid_constant__ LowLatencyCombineSendArgs a) {
  const int lane = threadIdx.x % 32, me = c.group.rank, num_ranks = c.group.num_ranks;
  const int64_t hidden = c.hidden, max_tokens = c.num_max_tokens;
  const int32_t experts_per_rank = static_cast<int32_t>(c.num_experts / num_ranks);
  const LowLatencyLayout layout(max_tokens, hidden, c.num_experts);
  LowLatencyHeader* own = own_header(c);
  start_clock(own, kCombineSendKernel);
  const uint32_t call = next_call(&own->combine_calls), set = call & 1;
  wait_for_credits(c, LowLatencyOp::kCombineSend, call, /*dispatch=*/false);

  // The handle's (first row, rows) per (local expert, source) in shared memory: most rows of [L, R*M] are past
  // recv_count, and a warp skips them without a global load.
  extern __shared__ int32_t ranges[];  // [L, R, 2]
  for (int32_t i = threadIdx.x; i < experts_per_rank * num_ranks * 2; i += kThreads) ranges[i] = a.layout_range[i];
  __syncthreads();
  const int64_t rows_per_expert = num_ranks * max_tokens;
  for (int64_t item = global_warp(); item < experts_per_rank * rows_per_expert; item += num_global_warps()) {
    const int64_t j = item / rows_per_expert, row = item % rows_per_expert;
    bool inside = false;
    if (lane < num_ranks) {
      const int32_t begin = ranges[(j * num_ranks + lane) * 2];
      const int32_t count = ranges[(j * num_ranks + lane) * 2 + 1];
      inside = row >= begin && row < static_cast<int64_t>(begin) + count;
    }
    const unsigned sources = __ballot_sync(kFullMask, inside);
    if (!sources) continue;  // a row past recv_count
    const int src = __ffs(sources) - 1;
    const int32_t t = a.src_token_index[item], k = a.src_topk_index[item];
    if (t < 0 || t >= max_tokens || k < 0 || k >= kLowLatencyMaxTopk) continue;  // not from a dispatch handle
    const int64_t slot = layout.set_offset(set) + layout.combine_rows +
                         (static_cast<int64_t>(t) * kLowLatencyMaxTopk + k) * layout.combine_slot_bytes;
    Transport::put_warp(c, src, slot, static_cast<const char*>(a.y) + item * layout.combine_slot_bytes,
                        layout.combine_slot_bytes, lane);
  }
  Transport::finish_puts(lane);

  if (!is_last_block(own, kCombineSendKernel)) return;
  for (int32_t i = threadIdx.x; i < experts_per_rank * num_ranks; i += kThreads) {
    const int32_t j = i / num_ranks, src = i % num_ranks;
    Transport::signal(c, src, layout.set_offset(set) + layout.combine_flags + (me * experts_per_rank + j) * 8, call);
  }
  if (threadIdx.x == 0) {
    own->combine_calls = call;
    *a.token = call;
  }
}

// The receive: waits for the E flags of its set, then a warp takes (token, part) and sums, for k in order,
// w[t, k] * row of (t, first entry of expert k) in float32 (one rounding per product and per sum, as the
// reference), and writes BF16.
template <typename Transport>
__global__ void __launch_bounds__(kThreads) combine_recv_kernel(const __grid_constant__ LowLatencyCall c,
                                                                const __grid_constant__ LowLatencyCombineRecvArgs a,
                                                                TokenParts split) {
  const int lane = threadIdx.x % 32;
  const int64_t hidden = c.hidden, num_topk = a.num_topk;
  const int32_t num_experts = static_cast<int32_t>(c.num_experts);
  const LowLatencyLayout layout(c.num_max_tokens, hidden, num_experts);
  const uint32_t call = *a.token, set = call & 1;
  const char* base = c.region + layout.set_offset(set);
  LowLatencyHeader* own = own_header(c);
  start_clock(own, kCombineRecvKernel);

  const uint64_t* flags = reinterpret_cast<const uint64_t*>(base + layout.combine_flags);
  const int32_t experts_per_rank = static_cast<int32_t>(num_experts / c.group.num_ranks);
  for (int32_t e = threadIdx.x; e < num_experts; e += kThreads)
    wait_until(c, LowLatencyOp::kCombineRecv, LowLatencyWait::kFlag, e / experts_per_rank, call,
               [&] { return load_acquire_sys(flags + e); },
               [&](uint64_t v) { return static_cast<uint32_t>(v) == call; });
  __syncthreads();

  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  for (int64_t item = global_warp(); item < a.num_tokens * split.parts; item += num_global_warps()) {
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
    const int64_t chunk_end = min((part + 1) * split.chunks_per_part * kChunk, hidden);
    for (int64_t chunk = part * split.chunks_per_part * kChunk; chunk < chunk_end; chunk += kChunk) {
      const int64_t ch = chunk + lane * kLaneChannels;
      float acc[kLaneChannels];
#pragma unroll
      for (int i = 0; i < kLaneChannels; ++i) acc[i] = 0.f;
      // Every entry's load is issued before the first is used (one memory latency per chunk, not one per k);
      // the sum still runs in k order.
      uint4 rows[kLowLatencyMaxTopk];
#pragma unroll
      for (int k = 0; k < kLowLatencyMaxTopk; ++k) {
        const int32_t e = __shfl_sync(kFullMask, expert, k);
        const int32_t s = __shfl_sync(kFullMask, slot, k);
        if (k < num_topk && e >= 0 && ch < hidden)
          rows[k] = __ldcg(reinterpret_cast<const uint4*>(
              base + layout.combine_rows + (t * kLowLatencyMaxTopk + s) * layout.combine_slot_bytes + ch * 2));
      }
#pragma unroll
      for (int k = 0; k < kLowLatencyMaxTopk; ++k) {
        const int32_t e = __shfl_sync(kFullMask, expert, k);
        const float w = __shfl_sync(kFullMask, weight, k);
        if (k >= num_topk || e < 0 || ch >= hidden) continue;
        float v[kLaneChannels];
        bf16x8_to_float(rows[k], v);
#pragma unroll
        for (int i = 0; i < kLaneChannels; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
      }
      if (ch >= hidden) continue;
      __nv_bfloat16 packed[kLaneChannels];
#pragma unroll
      for (int i = 0; i < kLaneChannels; ++i) packed[i] = __float2bfloat16_rn(acc[i]);
      *reinterpret_cast<uint4*>(out + t * hidden + ch) = *reinterpret_cast<const uint4*>(packed);
    }
  }

  if (is_last_block(own, kCombineRecvKernel)) give_credits<Transport>(c, call, /*dispatch=*/false);
}

// ---- launches ----------------------------------------------------------------------------------------------

int blocks_for_warps(const LowLatencyCall& c, int64_t warps) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(c.group.device_sms, (warps + kWarps - 1) / kWarps)));
}

// One wave of warps over the device: items (token, part) enough to occupy every SM once.
TokenParts token_parts(const LowLatencyCall& c, int64_t num_tokens) {
  return TokenParts(num_tokens, c.hidden, static_cast<int64_t>(c.group.device_sms) * kWarps);
}

}  // namespace

cudaError_t low_latency_dispatch_send(const LowLatencyCall& call, const LowLatencyDispatchSendArgs& args) {
  if (args.num_topk > kLowLatencyMaxTopk || args.num_tokens > call.num_max_tokens) return cudaErrorInvalidValue;
  dispatch_route_kernel<<<blocks_for_warps(call, call.num_experts), kThreads, 0, call.stream>>>(call, args);
  JAX_EP_CUDA_RETURN(cudaGetLastError());
  const TokenParts split = token_parts(call, args.num_tokens);
  return with_transport(call, [&](auto transport) {
    dispatch_send_kernel<decltype(transport)>
        <<<blocks_for_warps(call, args.num_tokens * split.parts), kThreads, 0, call.stream>>>(call, args, split);
    return cudaGetLastError();
  });
}

cudaError_t low_latency_dispatch_recv(const LowLatencyCall& call, const LowLatencyDispatchRecvArgs& args) {
  if (call.num_experts > kLowLatencyMaxExperts) return cudaErrorInvalidValue;
  const size_t shared = 2 * sizeof(int32_t) * static_cast<size_t>(call.num_experts);
  return with_transport(call, [&](auto transport) {
    dispatch_recv_kernel<decltype(transport)><<<call.group.device_sms, kThreads, shared, call.stream>>>(call, args);
    return cudaGetLastError();
  });
}

cudaError_t low_latency_combine_send(const LowLatencyCall& call, const LowLatencyCombineSendArgs& args) {
  if (call.num_experts > kLowLatencyMaxExperts) return cudaErrorInvalidValue;
  const size_t shared = 2 * sizeof(int32_t) * static_cast<size_t>(call.num_experts);  // L*R = E ranges
  return with_transport(call, [&](auto transport) {
    combine_send_kernel<decltype(transport)><<<call.group.device_sms, kThreads, shared, call.stream>>>(call, args);
    return cudaGetLastError();
  });
}

cudaError_t low_latency_combine_recv(const LowLatencyCall& call, const LowLatencyCombineRecvArgs& args) {
  if (args.num_topk > kLowLatencyMaxTopk || args.num_tokens > call.num_max_tokens) return cudaErrorInvalidValue;
  const TokenParts split = token_parts(call, args.num_tokens);
  return with_transport(call, [&](auto transport) {
    combine_recv_kernel<decltype(transport)>
        <<<blocks_for_warps(call, args.num_tokens * split.parts), kThreads, 0, call.stream>>>(call, args, split);
    return cudaGetLastError();
  });
}

std::string low_latency_lookup(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport,
                               int64_t ll_offset, LowLatencyCall* call, int64_t* available_bytes) {
  if (!intranode_lookup(buffer_id, device_ordinal, &call->group))
    return "no intranode state of buffer " + std::to_string(buffer_id) + " on CUDA device " +
           std::to_string(device_ordinal);
  call->transport = transport;
  switch (transport) {
    case LowLatencyTransport::kPeerStores:
      for (int p = 0; p < call->group.num_ranks; ++p) call->peer_regions[p] = call->group.workspaces[p] + ll_offset;
      call->region = call->peer_regions[call->group.rank];
      *available_bytes = call->group.workspace_bytes - ll_offset;
      return "";
    case LowLatencyTransport::kNvshmem: {
#if defined(JAX_EP_WITH_NVSHMEM)
      SymmetricRegion symmetric;
      if (!nvshmem_region_lookup(buffer_id, device_ordinal, &symmetric))
        return "no NVSHMEM region of buffer " + std::to_string(buffer_id) + " on CUDA device " +
               std::to_string(device_ordinal);
      if (symmetric.num_ranks != call->group.num_ranks)
        return "the NVSHMEM region of buffer " + std::to_string(buffer_id) + " has " +
               std::to_string(symmetric.num_ranks) + " ranks, its intranode group " +
               std::to_string(call->group.num_ranks);
      call->region = symmetric.base + ll_offset;
      for (int p = 0; p < symmetric.num_ranks; ++p) call->pes[p] = symmetric.pes[p];
      *available_bytes = symmetric.bytes - ll_offset;
      return "";
#else
      return "this jax_ep was built without NVSHMEM";
#endif
    }
  }
  return "unknown low-latency transport " + std::to_string(static_cast<int>(transport));
}

std::vector<std::vector<std::pair<uint64_t, uint64_t>>> low_latency_kernel_times(
    int64_t buffer_id, const std::vector<int>& device_ordinals, LowLatencyTransport transport, int64_t ll_offset,
    bool reset) {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> times;
  int current = 0;
  JAX_EP_CUDA_THROW(cudaGetDevice(&current));
  for (int device : device_ordinals) {
    LowLatencyCall call;
    int64_t available = 0;
    if (!low_latency_lookup(buffer_id, device, transport, ll_offset, &call, &available).empty()) continue;
    JAX_EP_CUDA_THROW(cudaSetDevice(device));
    LowLatencyHeader* h = reinterpret_cast<LowLatencyHeader*>(call.region);
    uint64_t calls[kLowLatencyKernels], ns[kLowLatencyKernels];
    JAX_EP_CUDA_THROW(cudaMemcpy(calls, h->kernel_calls, sizeof(calls), cudaMemcpyDeviceToHost));
    JAX_EP_CUDA_THROW(cudaMemcpy(ns, h->kernel_ns, sizeof(ns), cudaMemcpyDeviceToHost));
    if (reset) {
      JAX_EP_CUDA_THROW(cudaMemset(h->kernel_calls, 0, sizeof(calls)));
      JAX_EP_CUDA_THROW(cudaMemset(h->kernel_ns, 0, sizeof(ns)));
    }
    std::vector<std::pair<uint64_t, uint64_t>> row;
    for (int k = 0; k < kLowLatencyKernels; ++k) row.emplace_back(calls[k], ns[k]);
    times.push_back(row);
  }
  JAX_EP_CUDA_THROW(cudaSetDevice(current));
  return times;
}

std::vector<std::string> low_latency_errors(int64_t buffer_id, const std::vector<int>& device_ordinals) {
  static const char* const kOps[] = {"low_latency_dispatch (send)", "low_latency_dispatch (receive)",
                                     "low_latency_combine (send)", "low_latency_combine (receive)"};
  std::vector<std::string> lines;
  for (int device : device_ordinals) {
    IntranodeRank rank;
    if (!intranode_lookup(buffer_id, device, &rank) || !rank.error) continue;
    // Pinned, mapped host memory: with unified addressing its device pointer is its host pointer.
    const volatile IntranodeError& e = *rank.error;
    const int op = e.op - static_cast<int>(LowLatencyOp::kDispatchSend);
    if (op < 0 || op > 3) continue;
    const uint32_t call = static_cast<uint32_t>(e.call);
    const std::string waited_for =
        e.wait == static_cast<int32_t>(LowLatencyWait::kCredit)
            ? " to finish receiving call " + std::to_string(call - 2) +
                  " (a credit: are more than two results of this op between send and receive?)"
            : " to send its rows of call " + std::to_string(call) + " (flag " + std::to_string(e.seen) + ")";
    lines.push_back("jax_ep " + std::string(kOps[op]) + " timed out on rank " + std::to_string(e.rank) +
                    " (CUDA device " + std::to_string(device) + ") after " + std::to_string(e.waited_ns / 1000000) +
                    " ms waiting for rank " + std::to_string(e.peer) + waited_for);
  }
  return lines;
}

}  // namespace jax_ep
