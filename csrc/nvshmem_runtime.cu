// NVSHMEM bootstrap and symmetric memory for jax_ep (docs/design.md, "Transports"): one PE per process, started
// from a unique id that the Python side passes through the jax.distributed key-value store.
#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "registry.h"

namespace jax_ep {
namespace {

// NVSHMEM is initialised once per process; the Buffers' symmetric regions are kept in the registry.
std::mutex g_bootstrap_mutex;
bool g_initialized = false;

// A CUDA call on the current device.
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep nvshmem: ") + what + " failed: " + cudaGetErrorString(err));
}

void check_status(int status, const char* what) {
  if (status != 0) throw std::runtime_error(std::string("jax_ep nvshmem: ") + what + " returned " + std::to_string(status));
}

__global__ void ring_put_kernel(int* words) {
  const int me = nvshmem_my_pe(), pes = nvshmem_n_pes();
  nvshmem_int_p(words, me, (me + 1) % pes);
}

}  // namespace

std::string nvshmem_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  check_status(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void nvshmem_initialize(int device_ordinal, int rank, int num_ranks, const std::string& unique_id) {
  std::lock_guard<std::mutex> lock(g_bootstrap_mutex);
  if (g_initialized) throw std::runtime_error("jax_ep nvshmem: already initialised in this process");
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::invalid_argument("jax_ep nvshmem: the unique id has " + std::to_string(unique_id.size()) +
                                " bytes, expected " + std::to_string(sizeof(nvshmemx_uniqueid_t)));
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  check(cudaSetDevice(device_ordinal), "cudaSetDevice");
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  check_status(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
  check_status(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr), "nvshmemx_init_attr");
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks)
    throw std::runtime_error("jax_ep nvshmem: initialised as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                             std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) + " of " +
                             std::to_string(num_ranks));
  g_initialized = true;
}

bool nvshmem_is_initialized() {
  std::lock_guard<std::mutex> lock(g_bootstrap_mutex);
  return g_initialized;
}

void* nvshmem_allocate(int64_t bytes) {
  void* pointer = nvshmem_malloc(static_cast<size_t>(bytes));
  if (pointer == nullptr && bytes > 0)
    throw std::runtime_error("jax_ep nvshmem: nvshmem_malloc of " + std::to_string(bytes) +
                             " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE)");
  check(cudaMemset(pointer, 0, static_cast<size_t>(bytes)), "cudaMemset (symmetric memory)");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_barrier_all();  // every PE zeroed its part before anyone writes into it
  return pointer;
}

void nvshmem_release(void* pointer) {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_free(pointer);
}

void nvshmem_region_create(int64_t buffer_id, int device_ordinal, int64_t bytes, const std::vector<int>& pes,
                           int ranks_per_node) {
  // The caller (jax_ep's cuda backend) checked these on every process before this collective call; a failure
  // here is a bug, and the other PEs would wait in nvshmem_malloc.
  if (!nvshmem_is_initialized())
    throw std::runtime_error("jax_ep nvshmem: not initialised (jax_ep.nvshmem.initialize())");
  Registry& entries = registry();
  {
    std::lock_guard<std::mutex> lock(entries.mutex);
    if (const DeviceEntry* entry = entries.find(buffer_id, device_ordinal); entry && entry->symmetric)
      throw std::invalid_argument("jax_ep nvshmem: buffer " + std::to_string(buffer_id) +
                                  " already has a region on CUDA device " + std::to_string(device_ordinal));
  }
  const int num_ranks = static_cast<int>(pes.size());
  if (num_ranks < 1 || num_ranks > kMaxLowLatencyRanks || bytes <= 0 || ranks_per_node < 1 ||
      num_ranks % ranks_per_node)
    throw std::invalid_argument("jax_ep nvshmem: a region has 1 to " + std::to_string(kMaxLowLatencyRanks) +
                                " ranks in nodes of ranks_per_node and a positive size, got " +
                                std::to_string(num_ranks) + " ranks, ranks_per_node " +
                                std::to_string(ranks_per_node) + " and " + std::to_string(bytes) + " bytes");
  auto region = std::make_unique<SymmetricRegion>();
  region->rank = -1;
  for (int r = 0; r < num_ranks; ++r) {
    if (pes[r] < 0 || pes[r] >= nvshmem_n_pes())
      throw std::invalid_argument("jax_ep nvshmem: PE " + std::to_string(pes[r]) + " outside the " +
                                  std::to_string(nvshmem_n_pes()) + " PEs");
    if (pes[r] == nvshmem_my_pe()) region->rank = r;
    region->pes[r] = pes[r];
  }
  if (region->rank < 0)
    throw std::invalid_argument("jax_ep nvshmem: this process's PE " + std::to_string(nvshmem_my_pe()) +
                                " is not in the group");
  region->bytes = bytes;
  region->num_ranks = num_ranks;
  {
    CurrentDeviceGuard restore_device;
    check_cuda(cudaSetDevice(device_ordinal), "cudaSetDevice", device_ordinal, "jax_ep nvshmem");
    check_cuda(cudaDeviceGetAttribute(&region->device_sms, cudaDevAttrMultiProcessorCount, device_ordinal),
               "cudaDeviceGetAttribute", device_ordinal, "jax_ep nvshmem");
    // Collective: every PE, same size. Outside the registry's lock: the other PEs may take their time.
    region->base = static_cast<char*>(nvshmem_allocate(bytes));
    map_node_regions(region->base, region->pes, region->rank, ranks_per_node,
                     region->node_regions + region->rank / ranks_per_node * ranks_per_node, "jax_ep nvshmem");
  }
  std::lock_guard<std::mutex> lock(entries.mutex);
  CurrentDeviceGuard restore_device;  // a new entry allocates its timeout record on the device
  DeviceEntry& entry = entries.find_or_create(buffer_id, device_ordinal);
  region->error = entry.error_device;
  entry.symmetric = std::move(region);
}

void map_node_regions(char* base, const int32_t* pe_of_rank, int rank, int ranks_per_node, char** node_regions,
                      const char* runtime) {
  for (int j = 0; j < ranks_per_node; ++j) {
    const int peer = rank / ranks_per_node * ranks_per_node + j;
    node_regions[j] = static_cast<char*>(nvshmem_ptr(base, pe_of_rank[peer]));
    if (node_regions[j] != nullptr) continue;
    nvshmem_release(base);
    throw std::runtime_error(std::string(runtime) + ": rank " + std::to_string(peer) + " (PE " +
                             std::to_string(pe_of_rank[peer]) + ") is on the node of rank " + std::to_string(rank) +
                             " (ranks_per_node=" + std::to_string(ranks_per_node) + ") but its memory cannot be "
                             "reached by loads and stores from here (not in this NVLink domain?)");
  }
}

bool nvshmem_region_lookup(int64_t buffer_id, int device_ordinal, SymmetricRegion* out) {
  return registry().copy_part(buffer_id, device_ordinal, out,
                              [](const DeviceEntry& entry) { return entry.symmetric.get(); });
}

void release_symmetric(int device, void* pointer, ErrorList& errors) {
  try {
    check_cuda(cudaSetDevice(device), "cudaSetDevice", device, "jax_ep nvshmem");
    nvshmem_release(pointer);
  } catch (const std::exception& e) {
    errors.note(e.what());
  }
}

std::string nvshmem_region_destroy(int64_t buffer_id, bool release) {
  std::vector<std::pair<int, std::unique_ptr<SymmetricRegion>>> doomed;
  Registry& entries = registry();
  {
    std::lock_guard<std::mutex> lock(entries.mutex);
    for (DeviceEntry* entry : entries.entries_of(buffer_id))
      if (entry->symmetric) doomed.emplace_back(entry->device, std::move(entry->symmetric));  // no lookup finds it
    entries.erase_empty(buffer_id);
  }
  ErrorList errors;
  if (!release) return errors.text();
  CurrentDeviceGuard restore_device;
  for (const auto& [device, region] : doomed) release_symmetric(device, region->base, errors);
  return errors.text();
}

int nvshmem_ring_check() {
  int* words = static_cast<int*>(nvshmem_allocate(sizeof(int)));
  // Every PE releases the word even when a check below throws: nvshmem_free is collective.
  struct Release {
    int* words;
    ~Release() {
      cudaDeviceSynchronize();
      nvshmem_free(words);
    }
  } release{words};
  ring_put_kernel<<<1, 1>>>(words);
  check(cudaGetLastError(), "ring_put_kernel launch");
  check(cudaDeviceSynchronize(), "ring_put_kernel");
  nvshmem_barrier_all();  // also completes every PE's puts
  int value = -1;
  check(cudaMemcpy(&value, words, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return value;
}

}  // namespace jax_ep
#endif
