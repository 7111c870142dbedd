// The low-latency (LL) region of a rank: where it lies and what it holds. The sizes and offsets (LowLatencyLayout) and
// the limits live in kernel_limits.h, which the kernels (low_latency_*.cu), the handlers' size check and jax_ep._C (for
// jax_ep.low_latency_buffer_bytes) share; the structs here are tied to them by static_asserts.
//
// The region lives at byte `ll_offset` of the rank's intranode workspace (peer-store transport) or of its
// NVSHMEM symmetric allocation (NVSHMEM transport); either way the layout is the same and every offset below
// is relative to the region's start, so one offset names the same word on every rank. It holds:
//   header                                   kLowLatencyHeaderBytes: this rank's call counters and credits (below)
//   trace [kernel][kLowLatencyTraceCalls]    LowLatencyTrace: %globaltimer instants of each LL kernel's recent
//                                            calls on this rank (the benchmark's breakdown; kLowLatencyTraceBytes,
//                                            0 unless the build is instrumented)
//   dispatch_counters [E] uint64             the send's progress per expert, this rank's own (dispatch send,
//                                            count_toward_flag); zero between calls
//   combine_counters [E] uint32              the combine send's row pieces written per (local expert,
//                                            source rank), this rank's own (combine_piece_sent); zero
//                                            between calls
//   dispatch_staging [M] x dispatch slot     this rank's rows as sent (cast, with their header): the source of
//                                            the NVSHMEM puts into the receivers' slots (with peer stores only
//                                            the header is staged: the cast writes the slots directly)
//   set 0, set 1                              two buffer sets; call c of an op uses set c % 2
//   combine_staging [L][R*M] x 2H bytes      (NVSHMEM transport only) the combine send's copy of each row of y
//                                            it puts to a rank outside its node: puts read registered (symmetric)
//                                            memory, and XLA's y is not; rows to node peers are stored directly
// One set:
//   dispatch_flags  [L][R] uint64             at the receiver: (call tag << 32 | row count) per (local expert,
//                                             source rank), written by the source after its rows
//   combine_flags   [E] uint64                at the source: call tag per global expert, written by the
//                                             expert's rank after it returned that expert's rows
//   dispatch_index  [L][R][M] int32           at the receiver: per (local expert, source rank), the source
//                                             token of each slot position
//   dispatch_rows   [R][M] dispatch slots     at the receiver: per (source rank, source token) a
//                                             DispatchRowHeader, then the BF16 row, or the FP8 values (H bytes)
//                                             and scales. A token crosses to a rank once, however many of its
//                                             experts live there; the receive copies it to each of them.
//   combine_rows    [M][kLowLatencyMaxTopk] x 2H bytes  at the source: expert output row of (token, slot)
// A token's position inside its (expert, source rank) range is its rank among the source's tokens routed to
// that expert, in token order, so every output is deterministic.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "api.h"
#include "kernel_limits.h"

namespace jax_ep {

// Call numbers are 32-bit and compared modulo 2^32 (see `call_reached`), so they never run out.
struct LowLatencyHeader {
  uint32_t dispatch_calls;            // dispatch send calls this rank completed
  uint32_t combine_calls;             // combine send calls this rank completed
  uint32_t blocks_finished[kLowLatencyKernels];  // per LowLatencyKernel: blocks of the running call done
  unsigned error_claimed;             // the first block that fails fills the error record
  // Credits, written by the peers (each receive pushes its progress to every sender, so that no rank ever
  // reads another's memory): [p][set] = the latest call whose rows in buffer set `set` rank p finished
  // reading. 64-bit words: NVSHMEM signals are 64-bit. Only the low 32 bits (the call number) count.
  uint64_t dispatch_credit[kMaxLowLatencyRanks][2];
  uint64_t combine_credit[kMaxLowLatencyRanks][2];
  // Masked peers (Config(on_timeout="mask"); docs/design.md, "Masked ranks"): [p] is 0 while this rank does not
  // mask p, else kLowLatencyMaskedBit | (the dispatches this rank had started when it masked p). Set by this rank's
  // kernels (a wait on p that passed the bound), set and cleared by the host between calls; zero when made.
  unsigned long long masked[kMaxLowLatencyRanks];
};
static_assert(sizeof(LowLatencyHeader) <= kLowLatencyHeaderBytes, "the header fits its reserved bytes");

// ---- trace (instrumented builds only): where one call of an LL kernel spent its time, on this rank -------------
// Every instant is this GPU's %globaltimer in ns (comparable across the kernels of one GPU, not across GPUs).
// Call c of an op uses slot c % kLowLatencyTraceCalls of each of its kernels (the send and the receive of a
// call share the number). Blocks add their share with atomics as they end; the last block of call c writes
// `end` and `call`, then prepares slot c + 1 (the next call of the same kernel runs after this one, in stream
// order): minima to ~0, everything else to 0. low_latency_trace(reset) prepares every slot; a slot that was
// never prepared (a region used before any reset) holds garbage in first_start and first_flag. The ring's length
// (kLowLatencyTraceCalls) and its bytes are in kernel_limits.h.
inline constexpr int kLowLatencyPhases = 4;

struct LowLatencyTrace {
  uint64_t call;          // the call number (set with `end`)
  uint64_t units;         // what phase_ns sums over: blocks, or warps (combine receive); see kPhaseNames
  uint64_t first_start;   // min over blocks of their start
  uint64_t last_start;    // max over blocks of their start: first_start to last_start is the launch spread
  uint64_t first_flag;    // min over the kernel's flags: sends: a flag raised on a receiver; receives: a
                          // wait for flags satisfied (every flag of one expert, or of one token's experts)
  uint64_t last_flag;     // max of the same
  uint64_t end;           // the last block's end; 0 while the call runs
  uint64_t phase_ns[kLowLatencyPhases];  // time per phase (kLowLatencyPhaseNames) summed over the units
};
static_assert(sizeof(LowLatencyTrace) == kLowLatencyTraceSlotBytes && sizeof(LowLatencyTrace) % sizeof(uint64_t) == 0,
              "the region's trace is sized from kLowLatencyTraceSlotBytes; the trace reader copies 64-bit words");

// The field names of LowLatencyTrace's words, then per kernel its phases, as the benchmark prints them.
inline constexpr const char* kLowLatencyTraceFields[] = {"call", "units", "first_start", "last_start",
                                                         "first_flag", "last_flag", "end"};
inline constexpr const char* kLowLatencyPhaseNames[kLowLatencyKernels][kLowLatencyPhases] = {
    {"routing", "cast", "puts", "flags"},       // dispatch send, per block (summed over its tokens)
    {"waiting", "copying", "-", "-"},           // dispatch receive, per block (summed over its units)
    {"credits", "puts", "flags", "-"},          // combine send, per block
    {"waiting", "summing", "-", "-"},           // combine receive, per (token, part) a warp took
};
static_assert(sizeof(kLowLatencyTraceFields) / sizeof(kLowLatencyTraceFields[0]) + kLowLatencyPhases ==
                  sizeof(LowLatencyTrace) / sizeof(uint64_t),
              "a name per word");

// What precedes each dispatched row: the source token's top-k expert ids, so that the receiver of expert e
// finds the top-k slot of its row (the first entry naming e) without a per-target write: every receiver of a
// token gets the same bytes, which are staged once and copied or put to each.
struct DispatchRowHeader {
  int16_t experts[kLowLatencyMaxTopk];  // the token's top-k ids; -1 past its top-k and for ids outside [0, E)
  int32_t unused[4];                    // keeps the payload 16-byte aligned
};
static_assert(sizeof(DispatchRowHeader) == kLowLatencyRowHeaderBytes && sizeof(DispatchRowHeader) % 16 == 0,
              "LowLatencyLayout sizes dispatch slots from kLowLatencyRowHeaderBytes; payloads stay 16-byte aligned");

}  // namespace jax_ep
