// Low-latency dispatch: the send half (each token cast once and stored into every rank that holds one of its
// experts) and the receive half (each local expert's rows packed from the sources' slots). The protocol is in
// low_latency_protocol.cuh.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "api.h"
#include "fp8_cast.cuh"
#include "low_latency_protocol.cuh"

namespace jax_ep {
namespace {

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
  if (!peer_masked(c, e / experts_per_rank))
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
      uint64_t seen = 0;  // a masked source sends nothing
      const bool sent = wait_until(c, LowLatencyOp::kDispatchRecv, LowLatencyWait::kFlag, s, call,
                                   [&] { return load_acquire_sys(flags + j * num_ranks + s); },
                                   [&](uint64_t v) { return static_cast<uint32_t>(v >> 32) == call; }, seen);
      counts[s] = sent ? min(static_cast<int32_t>(static_cast<uint32_t>(seen)), static_cast<int32_t>(max_tokens)) : 0;
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
  // more start blocks in a second wave, which ends the kernel a unit later (docs/perf-log.md compares 2, 3 and 4
  // splits at DeepEP's decode shape).
  const int64_t experts_per_rank = call.num_experts / call.group.num_ranks;
  const int32_t splits = static_cast<int32_t>(std::clamp<int64_t>(
      int64_t{call.group.device_sms} * kDispatchRecvBlocksPerSm / experts_per_rank, 1, kWarps));
  const int blocks = static_cast<int>(experts_per_rank * splits);
  return with_transport(call, [&](auto transport) {
    dispatch_recv_kernel<decltype(transport)><<<blocks, kThreads, 0, call.stream>>>(call, args, splits);
    return cudaGetLastError();
  });
}

}  // namespace jax_ep
