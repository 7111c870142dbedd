// Intranode runtime: per-rank device memory (state + workspace), peer access and CUDA IPC mappings, kept in the
// process's registry (registry.h) that the FFI handlers query by (buffer id, device ordinal).
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "intranode_state.h"
#include "registry.h"

namespace jax_ep {
namespace {

constexpr const char* kRuntime = "jax_ep intranode runtime";

// The state sits at the start of a rank's allocation; the workspace follows, 256-byte aligned.
constexpr size_t kStateBytes = (sizeof(IntranodeState) + 255) / 256 * 256;

void check(cudaError_t err, const std::string& what, int device) { check_cuda(err, what, device, kRuntime); }

// Waits for the entry's device and unmaps its peers: afterwards no kernel of this rank runs or starts (lookups
// fail) and nothing of the peers stays mapped here. Its own memory stays allocated (peers may still map it).
void quiesce_rank(DeviceEntry& entry, ErrorList& errors) {
  IntranodeMemory& rank = *entry.intranode;
  rank.connected = false;
  errors.note(cudaSetDevice(entry.device), "cudaSetDevice", entry.device);
  errors.note(cudaDeviceSynchronize(), "cudaDeviceSynchronize", entry.device);
  for (void* mapping : rank.ipc_mappings)
    errors.note(cudaIpcCloseMemHandle(mapping), "cudaIpcCloseMemHandle", entry.device);
  rank.ipc_mappings.clear();
}

// Frees the entry's own memory (after quiesce_rank) and drops its intranode part.
void free_rank(DeviceEntry& entry, ErrorList& errors) {
  errors.note(cudaSetDevice(entry.device), "cudaSetDevice", entry.device);
  if (entry.intranode->memory) errors.note(cudaFree(entry.intranode->memory), "cudaFree", entry.device);
  entry.intranode.reset();
}

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  int possible = 0;
  check(cudaDeviceCanAccessPeer(&possible, device, peer), "cudaDeviceCanAccessPeer", device);
  if (!possible)
    throw std::runtime_error(std::string(kRuntime) + ": CUDA device " + std::to_string(device) +
                             " cannot access device " + std::to_string(peer) +
                             " as a peer (no NVLink/PCIe P2P); intranode mode needs peer access");
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clear the non-sticky error so later checks do not see it
    return;
  }
  check(err, "cudaDeviceEnablePeerAccess", device);
}

void check_group_size(int num_ranks) {
  if (num_ranks < 1 || num_ranks > kMaxIntranodeRanks)
    throw std::invalid_argument(std::string(kRuntime) + ": a group has 1 to " + std::to_string(kMaxIntranodeRanks) +
                                " ranks, got " + std::to_string(num_ranks));
}

void check_no_rank(Registry& entries, int64_t buffer_id, int device) {
  const DeviceEntry* entry = entries.find(buffer_id, device);
  if (entry && entry->intranode)
    throw std::invalid_argument(std::string(kRuntime) + ": buffer " + std::to_string(buffer_id) +
                                " already has a rank on CUDA device " + std::to_string(device));
}

// Erases the intranode part of every entry of buffer_id whose device is in `devices`, returning their errors.
// Every device is quiesced before any memory is freed: a kernel on one local device may read another's memory.
std::string erase_ranks(Registry& entries, int64_t buffer_id, const std::vector<int>& devices) {
  ErrorList errors;
  std::vector<DeviceEntry*> doomed;
  for (int device : devices)
    if (DeviceEntry* entry = entries.find(buffer_id, device); entry && entry->intranode) doomed.push_back(entry);
  for (DeviceEntry* entry : doomed) quiesce_rank(*entry, errors);
  for (DeviceEntry* entry : doomed) free_rank(*entry, errors);
  entries.erase_empty(buffer_id);
  return errors.text();
}

// Allocates and registers rank `rank` on `device` (caller holds the registry's mutex and a CurrentDeviceGuard).
IntranodeMemory& allocate_rank(Registry& entries, int64_t buffer_id, int device, int rank, int num_ranks,
                               int64_t workspace_bytes, int64_t staging_bytes) {
  check_group_size(num_ranks);
  if (rank < 0 || rank >= num_ranks || workspace_bytes < 0 || staging_bytes < 0 || staging_bytes > workspace_bytes)
    throw std::invalid_argument(std::string(kRuntime) + ": rank " + std::to_string(rank) + " of " +
                                std::to_string(num_ranks) + " with workspace " + std::to_string(workspace_bytes) +
                                " bytes is not valid");
  check_no_rank(entries, buffer_id, device);
  DeviceEntry& entry = entries.find_or_create(buffer_id, device);
  entry.intranode = std::make_unique<IntranodeMemory>();
  IntranodeMemory& memory = *entry.intranode;
  memory.rank = rank;
  memory.num_ranks = num_ranks;
  memory.workspace_bytes = workspace_bytes;
  memory.staging_bytes = staging_bytes;
  try {
    const size_t bytes = kStateBytes + static_cast<size_t>(workspace_bytes);
    check(cudaMalloc(&memory.memory, bytes), "cudaMalloc (" + std::to_string(bytes) + " bytes)", device);
    check(cudaMemset(memory.memory, 0, bytes), "cudaMemset (state and workspace)", device);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device);
  } catch (...) {
    erase_ranks(entries, buffer_id, {device});  // the allocation error is the one to report
    throw;
  }
  return memory;
}

// Fills the launch view of the entry's rank from every rank's allocation mapped into this process.
void connect_rank(DeviceEntry& entry, const std::vector<char*>& memories, bool staged) {
  IntranodeMemory& self = *entry.intranode;
  IntranodeRank& view = self.view;
  view.rank = self.rank;
  view.num_ranks = self.num_ranks;
  view.staged = staged ? 1 : 0;
  view.workspace_bytes = self.workspace_bytes;
  view.staging_bytes = self.staging_bytes;
  check(cudaDeviceGetAttribute(&view.device_sms, cudaDevAttrMultiProcessorCount, entry.device),
        "cudaDeviceGetAttribute", entry.device);
  for (int p = 0; p < self.num_ranks; ++p) {
    view.states[p] = reinterpret_cast<IntranodeState*>(memories[p]);
    view.workspaces[p] = memories[p] + kStateBytes;
  }
  view.error = entry.error_device;
  self.connected = true;
}

std::vector<int> devices_of(Registry& entries, int64_t buffer_id) {
  std::vector<int> devices;
  for (const DeviceEntry* entry : entries.entries_of(buffer_id))
    if (entry->intranode) devices.push_back(entry->device);
  return devices;
}

}  // namespace

void intranode_create(int64_t buffer_id, const std::vector<int>& device_ordinals, int64_t workspace_bytes,
                      int64_t staging_bytes) {
  const int num_ranks = static_cast<int>(device_ordinals.size());
  check_group_size(num_ranks);
  if (std::set<int>(device_ordinals.begin(), device_ordinals.end()).size() != device_ordinals.size())
    throw std::invalid_argument(std::string(kRuntime) + ": a device appears twice in one group");
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  for (int device : device_ordinals) check_no_rank(entries, buffer_id, device);
  CurrentDeviceGuard restore_device;
  try {
    std::vector<char*> memories;
    for (int r = 0; r < num_ranks; ++r)
      memories.push_back(
          allocate_rank(entries, buffer_id, device_ordinals[r], r, num_ranks, workspace_bytes, staging_bytes).memory);
    for (int r = 0; r < num_ranks; ++r) {
      const int device = device_ordinals[r];
      check(cudaSetDevice(device), "cudaSetDevice", device);
      for (int peer : device_ordinals) enable_peer_access(device, peer);
      connect_rank(*entries.find(buffer_id, device), memories, /*staged=*/false);
    }
  } catch (...) {
    erase_ranks(entries, buffer_id, device_ordinals);
    throw;
  }
}

std::string intranode_export(int64_t buffer_id, int device_ordinal, int rank, int num_ranks, int64_t workspace_bytes,
                             int64_t staging_bytes) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  CurrentDeviceGuard restore_device;
  IntranodeMemory& memory =
      allocate_rank(entries, buffer_id, device_ordinal, rank, num_ranks, workspace_bytes, staging_bytes);
  cudaIpcMemHandle_t handle;
  const cudaError_t err = cudaIpcGetMemHandle(&handle, memory.memory);
  if (err != cudaSuccess) {
    erase_ranks(entries, buffer_id, {device_ordinal});
    check(err, "cudaIpcGetMemHandle", device_ordinal);
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void intranode_connect(int64_t buffer_id, int device_ordinal, const std::vector<std::string>& ipc_handles,
                       const std::vector<int>& local_ordinals) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  DeviceEntry* entry = entries.find(buffer_id, device_ordinal);
  if (!entry || !entry->intranode || entry->intranode->connected)
    throw std::invalid_argument(std::string(kRuntime) + ": buffer " + std::to_string(buffer_id) +
                                " has no exported, unconnected rank on CUDA device " + std::to_string(device_ordinal));
  IntranodeMemory& self = *entry->intranode;
  const int num_ranks = self.num_ranks;
  if (static_cast<int>(ipc_handles.size()) != num_ranks || static_cast<int>(local_ordinals.size()) != num_ranks)
    throw std::invalid_argument(std::string(kRuntime) + ": connect needs one IPC handle and one local ordinal per "
                                "rank (" + std::to_string(num_ranks) + ")");
  CurrentDeviceGuard restore_device;
  check(cudaSetDevice(device_ordinal), "cudaSetDevice", device_ordinal);
  std::vector<char*> memories(num_ranks, nullptr);
  bool staged = false;
  try {
    for (int p = 0; p < num_ranks; ++p) {
      if (local_ordinals[p] >= 0) {  // exported by this process: reached through peer access
        const DeviceEntry* peer = entries.find(buffer_id, local_ordinals[p]);
        if (!peer || !peer->intranode || peer->intranode->rank != p || peer->intranode->num_ranks != num_ranks)
          throw std::invalid_argument(std::string(kRuntime) + ": rank " + std::to_string(p) + " of buffer " +
                                      std::to_string(buffer_id) + " was not exported on CUDA device " +
                                      std::to_string(local_ordinals[p]));
        enable_peer_access(device_ordinal, local_ordinals[p]);
        memories[p] = peer->intranode->memory;
        continue;
      }
      if (ipc_handles[p].size() != sizeof(cudaIpcMemHandle_t))
        throw std::invalid_argument(std::string(kRuntime) + ": the IPC handle of rank " + std::to_string(p) +
                                    " has " + std::to_string(ipc_handles[p].size()) + " bytes, expected " +
                                    std::to_string(sizeof(cudaIpcMemHandle_t)));
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, ipc_handles[p].data(), sizeof(handle));
      void* mapped = nullptr;
      check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle (rank " + std::to_string(p) + ")", device_ordinal);
      self.ipc_mappings.push_back(mapped);
      memories[p] = static_cast<char*>(mapped);
      staged = true;
    }
    connect_rank(*entry, memories, staged);
  } catch (...) {
    ErrorList ignored;  // the connection's error is the one to report
    for (void* mapping : self.ipc_mappings)
      ignored.note(cudaIpcCloseMemHandle(mapping), "cudaIpcCloseMemHandle", device_ordinal);
    self.ipc_mappings.clear();
    throw;
  }
}

std::string intranode_unmap(int64_t buffer_id) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  CurrentDeviceGuard restore_device;
  ErrorList errors;
  for (int device : devices_of(entries, buffer_id)) quiesce_rank(*entries.find(buffer_id, device), errors);
  return errors.text();
}

std::string intranode_destroy(int64_t buffer_id) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  CurrentDeviceGuard restore_device;
  return erase_ranks(entries, buffer_id, devices_of(entries, buffer_id));
}

bool intranode_lookup(int64_t buffer_id, int device_ordinal, IntranodeRank* out) {
  return registry().copy_part(buffer_id, device_ordinal, out, [](const DeviceEntry& entry) -> const IntranodeRank* {
    return entry.intranode && entry.intranode->connected ? &entry.intranode->view : nullptr;
  });
}

std::vector<std::string> intranode_errors(int64_t buffer_id) {
  return timeout_errors(buffer_id, static_cast<int32_t>(IntranodeOp::kDispatch),
                        static_cast<int32_t>(IntranodeOp::kExpertMajorCombine));
}

#if defined(JAX_EP_INSTRUMENT)
std::vector<std::pair<uint64_t, uint64_t>> intranode_kernel_times(int64_t buffer_id, bool reset) {
  return kernel_times(buffer_id, reset, [](const DeviceEntry& entry) -> KernelTimer* {
    return entry.intranode ? &reinterpret_cast<IntranodeState*>(entry.intranode->memory)->timer : nullptr;
  });
}
#endif

}  // namespace jax_ep
