// Internode normal mode: the symmetric region every rank allocates with NVSHMEM (same offsets on every PE),
// its fixed header and the per-call layouts of the space after it. Plain C++ (no CUDA types), shared by the kernels
// (internode.cu), the runtime (internode_runtime.cu) and the FFI handlers. The limits, the header's size and the
// layout structs (InternodeDispatchLayout, InternodeCombineLayout) live in kernel_limits.h, which jax_ep._C also
// exports for jax_ep.internode_buffer_bytes; this header describes them and holds what only the CUDA side needs.
//
// Ranks: EP rank g = node * ranks_per_node + local. Network traffic only flows between ranks of the same local
// index on different nodes ("rails"); inside a node, ranks read each other's regions through NVLink
// (nvshmem_ptr). A rank relays into its node the tokens of the ranks with its local index on every node.
#pragma once
#include <cstdint>

#include "kernel_limits.h"
#include "kernel_timer.h"

namespace jax_ep {

// The first kInternodeHeaderBytes of a rank's region. Flags hold call numbers (every rank runs the same ops in
// the same order, so call n is the same op everywhere) and only grow: no op ever cleans them.
struct InternodeHeader {
  uint64_t calls_completed;  // calls this rank finished; the running call is calls_completed + 1
  uint32_t blocks_finished;  // blocks of the running call that finished (the last one ends the call)
  uint32_t grid_arrivals;    // in-kernel grid barriers of the running call: gridDim.x per barrier passed
  unsigned error_claimed;    // the first block that times out fills the error record
  uint32_t unused;
  // Written by other nodes through NVSHMEM signals (index: the writer's node):
  uint64_t arrived[kMaxInternodeRanks];  // [m]: latest call whose puts from rank (m, local) into this region completed
  uint64_t credit[kMaxInternodeRanks];   // [m]: latest call after which rank (m, local) reads nothing of its region
                                         //      and its node peers neither: this rank may put the next call's data
  // Written by node peers through NVLink (index: the writer's local index):
  uint64_t ready[kMaxRanksPerNode];      // [j]: latest call for which node peer j's region can be read
  uint64_t released[kMaxRanksPerNode];   // [j]: latest call after which node peer j reads nothing of this region
#if defined(JAX_EP_INSTRUMENT)
  KernelTimer timer;  // read and reset by internode_kernel_times()
#endif
};
static_assert(sizeof(InternodeHeader) <= kInternodeHeaderBytes, "the header fits its reserved bytes");

// Dispatch (num_topk > 0) and cached dispatch (num_topk == 0) after the header, for N nodes of P ranks and T
// tokens per rank:
//   slots     [N][T] x slot_bytes   slot (s, t): token t of rank (s, local), payload rows back to back; this
//                                   rank's own tokens in slot (node, t), where node peers read them and the
//                                   puts to other nodes take them from (NVSHMEM sources must be symmetric)
//   meta      [N] x meta_bytes      per source node s: that rank's topk_idx [T][K] int32 and topk_weights
//                                   [T][K] f32 (topk part), then its routing into this node (routing part):
//                                   counts [P] int32 (its tokens per node rank; 256 bytes reserved), then
//                                   offsets [T][P] int32 (token t's index among its tokens for rank (node, j),
//                                   in token order, or -1)
//   outgoing  [N] x routing_bytes   this rank's routing into node m, put from here into node m's meta
// Fixed slots need no count exchange before the data moves, and every output is deterministic.
// (InternodeDispatchLayout in kernel_limits.h computes these offsets.)
static_assert(kMaxRanksPerNode * sizeof(int32_t) <= InternodeDispatchLayout::kOffsets,
              "a routing part's counts fit before its offsets");

// Combine after the header, for capacity C and rows of E elements:
//   staged    [C] x staged_row_bytes    this rank's valid y rows, where the node peers that relay their tokens
//                                       read them
//   received  [N][T] x partial_bytes    float32 partial sums for this rank's tokens, by the node that reduced them
//   sending   [N][T] x partial_bytes    partials this rank reduced for the tokens of rank (s, local), put from here
// (InternodeCombineLayout in kernel_limits.h computes these offsets.)

// Error-record values (TimeoutRecord.op / .wait) of the internode kernels; the intranode and low-latency
// modes use 1..7 and 10..13.
enum class InternodeOp : int32_t {
  kDispatch = 20,
  kCachedDispatch = 21,
  kCombine = 22,
  kExpertMajorDispatch = 23,
  kExpertMajorCachedDispatch = 24,  // also combine's backward
  kExpertMajorCombine = 25,  // the last internode op (internode_errors reads the records of kDispatch to this)
};
enum class InternodeWait : int32_t {
  kCredit = 20,   // a sender waited for rank (m, local) to free its region after the previous call
  kArrival = 21,  // waited for rank (m, local)'s puts of this call (rows, or combine partials)
  kReady = 22,    // waited for node peer j to make its region readable (relayed rows, or staged y)
  kRelease = 23,  // waited for node peer j to finish reading this rank's region
  kGrid = 24,     // waited for this rank's own blocks (in-kernel grid barrier)
};

}  // namespace jax_ep
