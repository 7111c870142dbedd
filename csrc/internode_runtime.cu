// Internode runtime: one NVSHMEM symmetric region per rank of a Buffer, the node peers' regions mapped through
// nvshmem_ptr, the host-mapped timeout record, and the process-global registry that the FFI handlers query by
// (buffer id, device ordinal). One process per GPU: a process holds at most one rank of a Buffer.
#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "intranode_state.h"

namespace jax_ep {
namespace {

struct InternodeMemory {
  int device = -1;
  InternodeRank view;  // region (symmetric), node_regions, error (device pointer of `error_host`)
  IntranodeError* error_host = nullptr;
};

std::mutex g_mutex;
std::map<std::pair<int64_t, int>, InternodeMemory> g_ranks;  // (buffer id, ordinal) -> rank

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("jax_ep internode runtime: " + what); }

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess)
    fail(std::string(what) + " on CUDA device " + std::to_string(device) + " failed: " + cudaGetErrorString(err));
}

}  // namespace

void internode_create(int64_t buffer_id, int device_ordinal, int rank, int ranks_per_node,
                      const std::vector<int>& pe_of_rank, int64_t region_bytes) {
  const int num_ranks = static_cast<int>(pe_of_rank.size());
  if (num_ranks < 2 || num_ranks > kMaxInternodeRanks || ranks_per_node < 1 || ranks_per_node > kMaxRanksPerNode ||
      num_ranks % ranks_per_node != 0 || num_ranks == ranks_per_node || rank < 0 || rank >= num_ranks ||
      region_bytes < 0)
    throw std::invalid_argument("jax_ep internode runtime: rank " + std::to_string(rank) + " of " +
                                std::to_string(num_ranks) + " with " + std::to_string(ranks_per_node) +
                                " ranks per node is not valid (2 to " + std::to_string(kMaxInternodeRanks) +
                                " ranks, several nodes of 1 to " + std::to_string(kMaxRanksPerNode) + " ranks)");
  if (!nvshmem_is_initialized()) fail("NVSHMEM is not initialised (jax_ep.nvshmem.initialize())");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_ranks.count({buffer_id, device_ordinal}))
    throw std::invalid_argument("jax_ep internode runtime: buffer " + std::to_string(buffer_id) +
                                " already has a rank on CUDA device " + std::to_string(device_ordinal));
  for (int pe : pe_of_rank)
    if (pe < 0 || pe >= nvshmem_n_pes()) fail("PE " + std::to_string(pe) + " does not exist");
  if (pe_of_rank[rank] != nvshmem_my_pe())
    fail("rank " + std::to_string(rank) + " is PE " + std::to_string(pe_of_rank[rank]) + ", this process is PE " +
         std::to_string(nvshmem_my_pe()));

  InternodeMemory memory;
  memory.device = device_ordinal;
  InternodeRank& view = memory.view;
  view.rank = rank;
  view.num_ranks = num_ranks;
  view.ranks_per_node = ranks_per_node;
  view.num_nodes = num_ranks / ranks_per_node;
  view.node = rank / ranks_per_node;
  view.local = rank % ranks_per_node;
  for (int r = 0; r < num_ranks; ++r) view.pe_of_rank[r] = pe_of_rank[r];
  view.region_bytes = region_bytes;
  check(cudaSetDevice(device_ordinal), "cudaSetDevice", device_ordinal);
  check(cudaDeviceGetAttribute(&view.device_sms, cudaDevAttrMultiProcessorCount, device_ordinal),
        "cudaDeviceGetAttribute", device_ordinal);
  // Collective over every PE (all processes create every internode Buffer in the same order).
  view.region = static_cast<char*>(nvshmem_allocate(kInternodeHeaderBytes + region_bytes));
  std::string problem;
  for (int j = 0; j < ranks_per_node && problem.empty(); ++j) {
    const int peer = view.node * ranks_per_node + j;
    view.node_regions[j] = static_cast<char*>(nvshmem_ptr(view.region, pe_of_rank[peer]));
    if (view.node_regions[j] == nullptr)
      problem = "rank " + std::to_string(peer) + " (PE " + std::to_string(pe_of_rank[peer]) +
                ") is on the node of rank " + std::to_string(rank) + " (ranks_per_node=" +
                std::to_string(ranks_per_node) +
                ") but its memory cannot be reached by loads and stores from here (not in this NVLink domain?)";
  }
  cudaError_t err = cudaSuccess;
  if (problem.empty()) {
    err = cudaHostAlloc(&memory.error_host, sizeof(IntranodeError), cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) {
      std::memset(memory.error_host, 0, sizeof(IntranodeError));
      err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&view.error), memory.error_host, 0);
    }
  }
  if (!problem.empty() || err != cudaSuccess) {
    // Every process met the same topology, so a mapping problem is met everywhere and the collective free
    // below is reached by all; a failed host allocation on one process only would leave the others waiting
    // in their next collective (as any NVSHMEM failure does).
    if (memory.error_host) cudaFreeHost(memory.error_host);
    nvshmem_release(view.region);
    if (!problem.empty()) fail(problem);
    check(err, "cudaHostAlloc (error record)", device_ordinal);
  }
  g_ranks[{buffer_id, device_ordinal}] = memory;
}

std::string internode_destroy(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::string errors;
  for (auto it = g_ranks.begin(); it != g_ranks.end();) {
    if (it->first.first != buffer_id) {
      ++it;
      continue;
    }
    InternodeMemory& memory = it->second;
    try {
      check(cudaSetDevice(memory.device), "cudaSetDevice", memory.device);
      nvshmem_release(memory.view.region);  // waits for the device, then frees collectively
    } catch (const std::exception& e) {
      errors += std::string(errors.empty() ? "" : "; ") + e.what();
    }
    if (memory.error_host) cudaFreeHost(memory.error_host);
    it = g_ranks.erase(it);
  }
  return errors;
}

bool internode_lookup(int64_t buffer_id, int device_ordinal, InternodeRank* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_ranks.find({buffer_id, device_ordinal});
  if (it == g_ranks.end()) return false;
  *out = it->second.view;
  return true;
}

std::vector<std::pair<uint64_t, uint64_t>> internode_kernel_times(int64_t buffer_id, bool reset) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::pair<uint64_t, uint64_t>> times;
  for (const auto& [key, memory] : g_ranks) {
    if (key.first != buffer_id) continue;
    check(cudaSetDevice(memory.device), "cudaSetDevice", memory.device);
    InternodeHeader* header = reinterpret_cast<InternodeHeader*>(memory.view.region);
    uint64_t calls_and_ns[2];
    check(cudaMemcpy(calls_and_ns, &header->timed_calls, sizeof(calls_and_ns), cudaMemcpyDeviceToHost),
          "cudaMemcpy (kernel times)", memory.device);
    times.emplace_back(calls_and_ns[0], calls_and_ns[1]);
    if (reset)
      check(cudaMemset(&header->timed_calls, 0, sizeof(calls_and_ns)), "cudaMemset (kernel times)", memory.device);
  }
  return times;
}

std::vector<std::string> internode_errors(int64_t buffer_id) {
  static const char* const kOps[] = {"internode dispatch", "internode cached dispatch", "internode combine"};
  static const char* const kWaits[] = {
      "to free its region after the previous call (credit)", "to deliver this call's data over the network",
      "to make its region readable (node peer)", "to finish reading this rank's region (node peer)",
      "(this rank's own blocks, grid barrier)"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::string> lines;
  for (const auto& [key, memory] : g_ranks) {
    if (key.first != buffer_id || !memory.error_host) continue;
    const volatile IntranodeError& e = *memory.error_host;
    const int op = e.op - static_cast<int32_t>(InternodeOp::kDispatch);
    const int wait = e.wait - static_cast<int32_t>(InternodeWait::kCredit);
    if (e.op == 0) continue;
    lines.push_back("jax_ep " + std::string(op >= 0 && op < 3 ? kOps[op] : "internode op") + " timed out on rank " +
                    std::to_string(e.rank) + " (CUDA device " + std::to_string(memory.device) + ") after " +
                    std::to_string(e.waited_ns / 1000000) + " ms waiting for rank " + std::to_string(e.peer) + " " +
                    (wait >= 0 && wait < 5 ? kWaits[wait] : "?") + " in call " + std::to_string(e.call) +
                    " (its flag was at " + std::to_string(e.seen) + ")");
  }
  return lines;
}

}  // namespace jax_ep
#endif  // JAX_EP_WITH_NVSHMEM
