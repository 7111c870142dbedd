// Internode runtime: one NVSHMEM symmetric region per rank of a Buffer and the node peers' regions mapped through
// nvshmem_ptr, kept in the process's registry (registry.h) that the FFI handlers query by (buffer id, device
// ordinal). One process per GPU: a process holds at most one rank of a Buffer.
#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "internode_state.h"
#include "registry.h"

namespace jax_ep {
namespace {

constexpr const char* kRuntime = "jax_ep internode runtime";

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(std::string(kRuntime) + ": " + what); }

}  // namespace

void internode_create(int64_t buffer_id, int device_ordinal, int rank, int ranks_per_node,
                      const std::vector<int>& pe_of_rank, int64_t region_bytes) {
  const int num_ranks = static_cast<int>(pe_of_rank.size());
  if (num_ranks < 2 || num_ranks > kMaxInternodeRanks || ranks_per_node < 1 || ranks_per_node > kMaxRanksPerNode ||
      num_ranks % ranks_per_node != 0 || num_ranks == ranks_per_node || rank < 0 || rank >= num_ranks ||
      region_bytes < 0)
    throw std::invalid_argument(std::string(kRuntime) + ": rank " + std::to_string(rank) + " of " +
                                std::to_string(num_ranks) + " with " + std::to_string(ranks_per_node) +
                                " ranks per node is not valid (2 to " + std::to_string(kMaxInternodeRanks) +
                                " ranks, several nodes of 1 to " + std::to_string(kMaxRanksPerNode) + " ranks)");
  if (!nvshmem_is_initialized()) fail("NVSHMEM is not initialised (jax_ep.nvshmem.initialize())");
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  if (const DeviceEntry* entry = entries.find(buffer_id, device_ordinal); entry && entry->internode)
    throw std::invalid_argument(std::string(kRuntime) + ": buffer " + std::to_string(buffer_id) +
                                " already has a rank on CUDA device " + std::to_string(device_ordinal));
  for (int pe : pe_of_rank)
    if (pe < 0 || pe >= nvshmem_n_pes()) fail("PE " + std::to_string(pe) + " does not exist");
  if (pe_of_rank[rank] != nvshmem_my_pe())
    fail("rank " + std::to_string(rank) + " is PE " + std::to_string(pe_of_rank[rank]) + ", this process is PE " +
         std::to_string(nvshmem_my_pe()));

  // The timeout record first: a failure here comes before the collective allocation, not after it.
  DeviceEntry& entry = entries.find_or_create(buffer_id, device_ordinal);
  auto view = std::make_unique<InternodeRank>();
  view->rank = rank;
  view->num_ranks = num_ranks;
  view->ranks_per_node = ranks_per_node;
  view->num_nodes = num_ranks / ranks_per_node;
  view->node = rank / ranks_per_node;
  view->local = rank % ranks_per_node;
  for (int r = 0; r < num_ranks; ++r) view->pe_of_rank[r] = pe_of_rank[r];
  view->region_bytes = region_bytes;
  view->error = entry.error_device;
  try {
    check_cuda(cudaDeviceGetAttribute(&view->device_sms, cudaDevAttrMultiProcessorCount, device_ordinal),
               "cudaDeviceGetAttribute", device_ordinal, kRuntime);
    // Collective over every PE (all processes create every internode Buffer in the same order).
    view->region = static_cast<char*>(nvshmem_allocate(kInternodeHeaderBytes + region_bytes));
    map_node_regions(view->region, view->pe_of_rank, rank, ranks_per_node, view->node_regions, kRuntime);
  } catch (...) {
    entries.erase_empty(buffer_id);  // the entry's record, where this call created it
    throw;
  }
  entry.internode = std::move(view);
}

std::string internode_destroy(int64_t buffer_id, bool release) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  ErrorList errors;
  for (DeviceEntry* entry : entries.entries_of(buffer_id)) {
    if (!entry->internode) continue;
    if (release) release_symmetric(entry->device, entry->internode->region, errors);
    entry->internode.reset();
  }
  entries.erase_empty(buffer_id);
  return errors.text();
}

bool internode_lookup(int64_t buffer_id, int device_ordinal, InternodeRank* out) {
  return registry().copy_part(buffer_id, device_ordinal, out,
                              [](const DeviceEntry& entry) { return entry.internode.get(); });
}

std::vector<std::string> internode_errors(int64_t buffer_id) {
  return timeout_errors(buffer_id, static_cast<int32_t>(InternodeOp::kDispatch),
                        static_cast<int32_t>(InternodeOp::kExpertMajorCombine));
}

#if defined(JAX_EP_INSTRUMENT)
std::vector<std::pair<uint64_t, uint64_t>> internode_kernel_times(int64_t buffer_id, bool reset) {
  return kernel_times(buffer_id, reset, [](const DeviceEntry& entry) -> KernelTimer* {
    return entry.internode ? &reinterpret_cast<InternodeHeader*>(entry.internode->region)->timer : nullptr;
  });
}
#endif

}  // namespace jax_ep
#endif  // JAX_EP_WITH_NVSHMEM
