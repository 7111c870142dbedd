// Device-resident state of one rank of an intranode group and its timeout record: the layout shared by the
// runtime (intranode_runtime.cu allocates and zeroes it) and the kernels (intranode.cu).
#pragma once
#include <cstdint>

#include "api.h"
#include "kernel_timer.h"

namespace jax_ep {

// Most pointers one op publishes (dispatch: two payloads, topk_idx, topk_weights, send_offset). Where a staged
// group copies them in its workspace: the staging structs of kernel_limits.h.
inline constexpr int kMaxPublishedPointers = 5;

// Push combine: the rows of y are pushed in units of consecutive rows; a receiver keeps one readiness flag per
// (sending rank, unit), so a call uses at most this many units (intranode.cu sizes them from the capacity).
inline constexpr int64_t kMaxCombineUnits = 4096;

// What a rank publishes for one call; peers read it through its peer pointer once its arrival flag
// reached the call's sequence number, and it is rewritten only after every peer released the call.
struct IntranodeView {
  // Addresses of the inputs peers read: pointers, or in a staged group offsets into the publisher's workspace.
  const void* pointers[kMaxPublishedPointers];
  // dispatch: this rank's tokens that go to each rank; push combine: the end of each source rank's rows in
  // this rank's y (rows of source s are [counts[s - 1], counts[s]), from 0 for s = 0)
  int32_t counts[kMaxIntranodeRanks];
};

struct IntranodeState {
  // Calls this rank completed; the running call is number calls_completed + 1 on every rank (all ranks
  // run the same ops in the same order). Written only by the last block of a call, read at kernel start.
  uint64_t calls_completed;
  uint32_t blocks_finished;  // blocks of the running call that finished their work
  uint32_t blocks_staged;    // staged groups: blocks of the running call that copied their share of the inputs
  uint32_t blocks_synced;    // arrivals at the running call's grid barriers (sync_grid), over all of them
  uint32_t combine_tickets;  // push combine: this rank's tokens handed to reducing warps so far in the call
  unsigned error_claimed;    // the first block that fails fills the error record
  uint64_t arrived[kMaxIntranodeRanks];   // [p]: latest call for which rank p published its view
  uint64_t released[kMaxIntranodeRanks];  // [p]: latest call after which rank p reads nothing of ours
  uint64_t partials_stored[kMaxIntranodeRanks];  // [p]: expert-major combine: latest call whose partials rank p stored
  IntranodeView view;
#if defined(JAX_EP_INSTRUMENT)
  KernelTimer timer;  // read and reset by intranode_kernel_times()
#endif
  // Push combine: [p][u] = latest call in which rank p finished storing its unit u of rows destined here
  // (written by rank p, release; call numbers only grow, so the flags are never cleared).
  uint64_t combine_ready[kMaxIntranodeRanks][kMaxCombineUnits];
};

enum class IntranodeOp : int32_t {
  kDispatch = 1,
  kCachedDispatch = 2,
  kCombine = 3,
  kStoreProbe = 4,
  kExpertMajorDispatch = 5,
  kExpertMajorCachedDispatch = 6,
  kExpertMajorCombine = 7,  // the last intranode op (intranode_errors reads the records of 1 to this)
};
enum class IntranodeWait : int32_t { kArrival = 1, kRelease = 2, kStaging = 3, kCombineRows = 4, kGrid = 5 };

// A rank's record of a bounded wait that ran out, shared by every mode's kernels (intranode, internode, low
// latency: `op` and `wait` take their enums' values). Written by a kernel just before it traps; lives in pinned
// host memory so the host can read it after the trap destroyed the CUDA context. `op` is written last: nonzero
// means the record is complete.
struct TimeoutRecord {
  int32_t op;     // IntranodeOp
  int32_t wait;   // IntranodeWait
  int32_t rank;   // the rank that waited
  int32_t peer;   // the rank it waited for
  uint64_t call;  // the call's sequence number
  uint64_t seen;  // the peer's flag when time ran out
  int64_t waited_ns;
};

}  // namespace jax_ep
