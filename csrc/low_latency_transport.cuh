// How the low-latency kernels write into other ranks' LL regions (docs/design.md, "Transports"): the few remote-write
// sites of the LL kernels go through one of these policies, a template parameter of each kernel that writes
// remotely, so there is one kernel source for both transports. Every remote word is named by (rank, byte
// offset in the LL region); the layout (low_latency_state.h) is the same on every rank.
//
// The operations and the ordering they promise:
//   kDirectStores   whether plain stores reach every rank (`address` then names any rank's word): the dispatch
//                   send then casts a row straight into its slot on every target rank instead of staging it for
//                   put_warp. Such transports reach at most kMaxIntranodeRanks ranks (one NVLink domain).
//   stores_reach    whether plain stores reach rank `rank` (always, with kDirectStores).
//   address         (where stores reach) the local address of (rank, offset); stores to it are ordered like
//                   put_warp's bytes.
//   put_warp        warp-collective: copies bytes from local memory to (rank, offset). Not yet visible there.
//                   Where stores do not reach the rank, the source must be symmetric memory (the LL region).
//   finish_puts     warp-collective, after a warp's puts: from here on they are ordered like plain stores of
//                   the warp, so that a release after a barrier (a signal, or a fence and an atomic that the
//                   signalling thread acquires) publishes them. The kernels always publish puts that way.
//   put_int         one thread: writes a 32-bit word at (rank, offset); ordered like put_warp's bytes.
//   signal          one thread: writes a 64-bit word (a flag or a credit) at (rank, offset), a release: ordered
//                   after every memory access this thread has observed (its own, or other threads' seen through a
//                   barrier or an atomic with fences: a credit after the reads of the set it frees); the receiver
//                   reads it with an acquire load on its own memory.
// Receivers only ever read their own region: waits stay local and bounded (low_latency_protocol.cuh, wait_until).
#pragma once
#include <cstdint>

#include "api.h"
#include "device_common.cuh"

#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace jax_ep {
namespace {

// Row copies keep this many 16-byte loads in flight per lane (one warp's copy over NVLink is bound by
// latency, not bandwidth).
constexpr int kCopyUnroll = 8;

// Inside one NVLink domain: plain stores through the peers' mapped regions (peer access or CUDA IPC).
struct PeerStores {
  static constexpr bool kDirectStores = true;
  __device__ static constexpr bool stores_reach(const LowLatencyCall& /*c*/, int /*rank*/) { return true; }
  __device__ static char* address(const LowLatencyCall& c, int rank, int64_t offset) {
    return c.peer_regions[rank] + offset;
  }
  __device__ static void put_warp(const LowLatencyCall& c, int rank, int64_t offset, const void* src, int64_t bytes,
                                  int lane) {
    // Sources were written during this call (the staged rows) or are XLA inputs: read at L2.
    warp_copy_row<kCopyUnroll>(c.peer_regions[rank] + offset, src, bytes, lane, LoadL2{});
  }
  // Plain stores need no fence of their own: the release that publishes them (PTX memory model: a release is
  // cumulative over the writes its thread observed through the barrier) orders them, as DeepEP's NVLink path
  // relies on too. A system-scope fence per warp here would wait out the warp's NVLink round trip for nothing.
  __device__ static void put_int(const LowLatencyCall& c, int rank, int64_t offset, int32_t value) {
    *reinterpret_cast<int32_t*>(c.peer_regions[rank] + offset) = value;
  }
  __device__ static void finish_puts(int /*lane*/) { __syncwarp(); }
  __device__ static void signal(const LowLatencyCall& c, int rank, int64_t offset, uint64_t value) {
    store_release_sys(reinterpret_cast<uint64_t*>(c.peer_regions[rank] + offset), value);
  }
};

#if defined(JAX_EP_WITH_NVSHMEM)
// NVSHMEM symmetric memory: the local address of a word is its symmetric address on every PE. Ranks of this
// rank's node (c.peer_regions non-null: NVLink, mapped through nvshmem_ptr) get plain stores as PeerStores does;
// the others NVSHMEM puts and signals, whose sources are the LL region's staged rows (network transports read
// registered memory only: the dispatch's staged rows, the combine's staging rows).
struct NvshmemPuts {
  static constexpr bool kDirectStores = false;  // puts copy from symmetric memory (the staged rows)
  __device__ static bool stores_reach(const LowLatencyCall& c, int rank) { return c.peer_regions[rank] != nullptr; }
  __device__ static char* address(const LowLatencyCall& c, int rank, int64_t offset) {
    return c.peer_regions[rank] + offset;
  }
  __device__ static void put_warp(const LowLatencyCall& c, int rank, int64_t offset, const void* src, int64_t bytes,
                                  int lane) {
    if (stores_reach(c, rank))
      PeerStores::put_warp(c, rank, offset, src, bytes, lane);
    else
      nvshmemx_putmem_nbi_warp(c.region + offset, src, static_cast<size_t>(bytes), c.pes[rank]);
  }
  __device__ static void put_int(const LowLatencyCall& c, int rank, int64_t offset, int32_t value) {
    if (stores_reach(c, rank))
      PeerStores::put_int(c, rank, offset, value);
    else
      nvshmem_int_p(reinterpret_cast<int*>(c.region + offset), value, c.pes[rank]);
  }
  __device__ static void finish_puts(int lane) {
    __syncwarp();
    if (lane == 0) nvshmem_quiet();  // the puts are delivered (for NVLink peers: a system-scope fence)
    __syncwarp();
  }
  __device__ static void signal(const LowLatencyCall& c, int rank, int64_t offset, uint64_t value) {
    if (stores_reach(c, rank)) return PeerStores::signal(c, rank, offset, value);
    // The fence orders the signal after what this thread observed, for a signal an NVLink path may carry too.
    nvshmem_fence();
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(c.region + offset), value, NVSHMEM_SIGNAL_SET, c.pes[rank]);
  }
};
#endif

// Calls launch(policy) with the policy of the call's transport; cudaErrorInvalidValue for a transport this
// build lacks (the handlers report that before launching).
template <typename Launch>
cudaError_t with_transport(const LowLatencyCall& c, Launch launch) {
  switch (c.transport) {
    case LowLatencyTransport::kPeerStores:
      return launch(PeerStores{});
#if defined(JAX_EP_WITH_NVSHMEM)
    case LowLatencyTransport::kNvshmem:
      return launch(NvshmemPuts{});
#endif
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace jax_ep
