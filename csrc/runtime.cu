// Intranode runtime: per-rank device memory (state + workspace), peer access, CUDA IPC mappings and the
// process-global registry that the FFI handlers query by (buffer id, device ordinal). Handlers of
// different devices run concurrently on different threads, so every registry access holds one mutex.
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "intranode_state.h"

namespace jax_ep {
namespace {

// The state sits at the start of a rank's allocation; the workspace follows, 256-byte aligned.
constexpr size_t kStateBytes = (sizeof(IntranodeState) + 255) / 256 * 256;

// One rank of a group held by this process: its own allocation and the peers' memory it mapped.
struct RankMemory {
  int device = -1;
  int rank = 0;
  int num_ranks = 0;
  int64_t workspace_bytes = 0;
  int64_t staging_bytes = 0;
  char* memory = nullptr;                    // own allocation: state, then workspace
  IntranodeError* error = nullptr;           // pinned, mapped host memory
  std::vector<void*> ipc_mappings;           // peers' allocations opened through CUDA IPC
  bool connected = false;
  IntranodeRank view;                        // valid once connected
};

std::mutex g_mutex;
std::map<std::pair<int64_t, int>, std::unique_ptr<RankMemory>> g_ranks;  // (buffer id, ordinal) -> rank

[[noreturn]] void fail(const std::string& what, int device, cudaError_t err) {
  throw std::runtime_error("jax_ep intranode runtime: " + what + " on CUDA device " + std::to_string(device) +
                           " failed: " + cudaGetErrorString(err));
}

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess) fail(what, device, err);
}

// Restores the calling thread's current device (JAX's threads expect theirs unchanged).
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() { cudaGetDevice(&device_); }
  ~CurrentDeviceGuard() { cudaSetDevice(device_); }

 private:
  int device_ = 0;
};

// Collects CUDA errors of teardown (which goes on past them) as one message.
class ErrorList {
 public:
  void note(cudaError_t err, const char* what, int device) {
    if (err != cudaSuccess)
      text_ += std::string(text_.empty() ? "" : "; ") + what + " on device " + std::to_string(device) + ": " +
               cudaGetErrorString(err);
  }
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

// Waits for `rank`'s device and unmaps its peers: afterwards no kernel of this rank runs or starts (lookups
// fail) and nothing of the peers stays mapped here. Its own memory stays allocated (peers may still map it).
void quiesce_rank(RankMemory& rank, ErrorList& errors) {
  rank.connected = false;
  errors.note(cudaSetDevice(rank.device), "cudaSetDevice", rank.device);
  errors.note(cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank.device);
  for (void* mapping : rank.ipc_mappings) errors.note(cudaIpcCloseMemHandle(mapping), "cudaIpcCloseMemHandle", rank.device);
  rank.ipc_mappings.clear();
}

// Frees `rank`'s own memory (after quiesce_rank).
void free_rank(RankMemory& rank, ErrorList& errors) {
  errors.note(cudaSetDevice(rank.device), "cudaSetDevice", rank.device);
  if (rank.memory) errors.note(cudaFree(rank.memory), "cudaFree", rank.device);
  rank.memory = nullptr;
  if (rank.error) errors.note(cudaFreeHost(rank.error), "cudaFreeHost", rank.device);
  rank.error = nullptr;
}

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  int possible = 0;
  check(cudaDeviceCanAccessPeer(&possible, device, peer), "cudaDeviceCanAccessPeer", device);
  if (!possible)
    throw std::runtime_error("jax_ep intranode runtime: CUDA device " + std::to_string(device) +
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
    throw std::invalid_argument("jax_ep intranode runtime: a group has 1 to " + std::to_string(kMaxIntranodeRanks) +
                                " ranks, got " + std::to_string(num_ranks));
}

// Allocates and registers rank `rank` on `device` (caller holds g_mutex and a CurrentDeviceGuard).
RankMemory& allocate_rank(int64_t buffer_id, int device, int rank, int num_ranks, int64_t workspace_bytes,
                          int64_t staging_bytes) {
  check_group_size(num_ranks);
  if (rank < 0 || rank >= num_ranks || workspace_bytes < 0 || staging_bytes < 0 || staging_bytes > workspace_bytes)
    throw std::invalid_argument("jax_ep intranode runtime: rank " + std::to_string(rank) + " of " +
                                std::to_string(num_ranks) + " with workspace " + std::to_string(workspace_bytes) +
                                " bytes is not valid");
  if (g_ranks.count({buffer_id, device}))
    throw std::invalid_argument("jax_ep intranode runtime: buffer " + std::to_string(buffer_id) +
                                " already has a rank on CUDA device " + std::to_string(device));
  auto memory = std::make_unique<RankMemory>();
  memory->device = device;
  memory->rank = rank;
  memory->num_ranks = num_ranks;
  memory->workspace_bytes = workspace_bytes;
  memory->staging_bytes = staging_bytes;
  try {
    check(cudaSetDevice(device), "cudaSetDevice", device);
    check(cudaHostAlloc(&memory->error, sizeof(IntranodeError), cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc (error record)", device);
    std::memset(memory->error, 0, sizeof(IntranodeError));
    const size_t bytes = kStateBytes + static_cast<size_t>(workspace_bytes);
    check(cudaMalloc(&memory->memory, bytes), ("cudaMalloc (" + std::to_string(bytes) + " bytes)").c_str(), device);
    check(cudaMemset(memory->memory, 0, bytes), "cudaMemset (state and workspace)", device);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device);
  } catch (...) {
    ErrorList ignored;  // the allocation error is the one to report
    quiesce_rank(*memory, ignored);
    free_rank(*memory, ignored);
    throw;
  }
  RankMemory& out = *memory;
  g_ranks[{buffer_id, device}] = std::move(memory);
  return out;
}

// Fills the launch view of `self` from every rank's allocation mapped into this process.
void connect_rank(RankMemory& self, const std::vector<char*>& memories, bool staged) {
  IntranodeRank& view = self.view;
  view.rank = self.rank;
  view.num_ranks = self.num_ranks;
  view.staged = staged ? 1 : 0;
  view.workspace_bytes = self.workspace_bytes;
  view.staging_bytes = self.staging_bytes;
  check(cudaDeviceGetAttribute(&view.device_sms, cudaDevAttrMultiProcessorCount, self.device),
        "cudaDeviceGetAttribute", self.device);
  for (int p = 0; p < self.num_ranks; ++p) {
    view.states[p] = reinterpret_cast<IntranodeState*>(memories[p]);
    view.workspaces[p] = memories[p] + kStateBytes;
  }
  // With unified addressing the mapped host pointer is valid on the device.
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&view.error), self.error, 0), "cudaHostGetDevicePointer",
        self.device);
  self.connected = true;
}

// Erases every rank of buffer_id whose device is in `devices`, returning their errors. Every device is
// quiesced before any memory is freed: a kernel on one local device may read another's memory.
std::string erase_ranks(int64_t buffer_id, const std::vector<int>& devices) {
  ErrorList errors;
  for (int device : devices) {
    auto it = g_ranks.find({buffer_id, device});
    if (it != g_ranks.end()) quiesce_rank(*it->second, errors);
  }
  for (int device : devices) {
    auto it = g_ranks.find({buffer_id, device});
    if (it == g_ranks.end()) continue;
    free_rank(*it->second, errors);
    g_ranks.erase(it);
  }
  return errors.text();
}

std::vector<int> devices_of(int64_t buffer_id) {
  std::vector<int> devices;
  for (const auto& [key, memory] : g_ranks)
    if (key.first == buffer_id) devices.push_back(key.second);
  return devices;
}

}  // namespace

void intranode_create(int64_t buffer_id, const std::vector<int>& device_ordinals, int64_t workspace_bytes,
                      int64_t staging_bytes) {
  const int num_ranks = static_cast<int>(device_ordinals.size());
  check_group_size(num_ranks);
  if (std::set<int>(device_ordinals.begin(), device_ordinals.end()).size() != device_ordinals.size())
    throw std::invalid_argument("jax_ep intranode runtime: a device appears twice in one group");
  std::lock_guard<std::mutex> lock(g_mutex);
  for (int device : device_ordinals)
    if (g_ranks.count({buffer_id, device}))
      throw std::invalid_argument("jax_ep intranode runtime: buffer " + std::to_string(buffer_id) +
                                  " already has a rank on CUDA device " + std::to_string(device));
  CurrentDeviceGuard restore_device;
  try {
    std::vector<char*> memories;
    for (int r = 0; r < num_ranks; ++r)
      memories.push_back(
          allocate_rank(buffer_id, device_ordinals[r], r, num_ranks, workspace_bytes, staging_bytes).memory);
    for (int r = 0; r < num_ranks; ++r) {
      const int device = device_ordinals[r];
      check(cudaSetDevice(device), "cudaSetDevice", device);
      for (int peer : device_ordinals) enable_peer_access(device, peer);
      connect_rank(*g_ranks.at({buffer_id, device}), memories, /*staged=*/false);
    }
  } catch (...) {
    erase_ranks(buffer_id, device_ordinals);
    throw;
  }
}

std::string intranode_export(int64_t buffer_id, int device_ordinal, int rank, int num_ranks, int64_t workspace_bytes,
                             int64_t staging_bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CurrentDeviceGuard restore_device;
  RankMemory& memory = allocate_rank(buffer_id, device_ordinal, rank, num_ranks, workspace_bytes, staging_bytes);
  cudaIpcMemHandle_t handle;
  const cudaError_t err = cudaIpcGetMemHandle(&handle, memory.memory);
  if (err != cudaSuccess) {
    erase_ranks(buffer_id, {device_ordinal});
    fail("cudaIpcGetMemHandle", device_ordinal, err);
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void intranode_connect(int64_t buffer_id, int device_ordinal, const std::vector<std::string>& ipc_handles,
                       const std::vector<int>& local_ordinals) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_ranks.find({buffer_id, device_ordinal});
  if (it == g_ranks.end() || it->second->connected)
    throw std::invalid_argument("jax_ep intranode runtime: buffer " + std::to_string(buffer_id) +
                                " has no exported, unconnected rank on CUDA device " + std::to_string(device_ordinal));
  RankMemory& self = *it->second;
  const int num_ranks = self.num_ranks;
  if (static_cast<int>(ipc_handles.size()) != num_ranks || static_cast<int>(local_ordinals.size()) != num_ranks)
    throw std::invalid_argument("jax_ep intranode runtime: connect needs one IPC handle and one local ordinal per "
                                "rank (" + std::to_string(num_ranks) + ")");
  CurrentDeviceGuard restore_device;
  check(cudaSetDevice(self.device), "cudaSetDevice", self.device);
  std::vector<char*> memories(num_ranks, nullptr);
  bool staged = false;
  try {
    for (int p = 0; p < num_ranks; ++p) {
      if (local_ordinals[p] >= 0) {  // exported by this process: reached through peer access
        auto peer = g_ranks.find({buffer_id, local_ordinals[p]});
        if (peer == g_ranks.end() || peer->second->rank != p || peer->second->num_ranks != num_ranks)
          throw std::invalid_argument("jax_ep intranode runtime: rank " + std::to_string(p) + " of buffer " +
                                      std::to_string(buffer_id) + " was not exported on CUDA device " +
                                      std::to_string(local_ordinals[p]));
        enable_peer_access(self.device, local_ordinals[p]);
        memories[p] = peer->second->memory;
        continue;
      }
      if (ipc_handles[p].size() != sizeof(cudaIpcMemHandle_t))
        throw std::invalid_argument("jax_ep intranode runtime: the IPC handle of rank " + std::to_string(p) +
                                    " has " + std::to_string(ipc_handles[p].size()) + " bytes, expected " +
                                    std::to_string(sizeof(cudaIpcMemHandle_t)));
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, ipc_handles[p].data(), sizeof(handle));
      void* mapped = nullptr;
      const cudaError_t err = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) fail("cudaIpcOpenMemHandle (rank " + std::to_string(p) + ")", self.device, err);
      self.ipc_mappings.push_back(mapped);
      memories[p] = static_cast<char*>(mapped);
      staged = true;
    }
    connect_rank(self, memories, staged);
  } catch (...) {
    for (void* mapping : self.ipc_mappings) cudaIpcCloseMemHandle(mapping);
    self.ipc_mappings.clear();
    throw;
  }
}

std::string intranode_unmap(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CurrentDeviceGuard restore_device;
  ErrorList errors;
  for (int device : devices_of(buffer_id)) quiesce_rank(*g_ranks.at({buffer_id, device}), errors);
  return errors.text();
}

std::string intranode_destroy(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CurrentDeviceGuard restore_device;
  return erase_ranks(buffer_id, devices_of(buffer_id));
}

bool intranode_lookup(int64_t buffer_id, int device_ordinal, IntranodeRank* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_ranks.find({buffer_id, device_ordinal});
  if (it == g_ranks.end() || !it->second->connected) return false;
  *out = it->second->view;
  return true;
}

std::vector<std::pair<uint64_t, uint64_t>> intranode_kernel_times(int64_t buffer_id, bool reset) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::pair<uint64_t, uint64_t>> times;
  CurrentDeviceGuard restore_device;
  for (const auto& [key, memory] : g_ranks) {
    if (key.first != buffer_id) continue;
    const int device = memory->device;
    check(cudaSetDevice(device), "cudaSetDevice", device);
    IntranodeState* state = reinterpret_cast<IntranodeState*>(memory->memory);
    uint64_t calls_and_ns[2];
    check(cudaMemcpy(calls_and_ns, &state->timed_calls, sizeof(calls_and_ns), cudaMemcpyDeviceToHost),
          "cudaMemcpy (kernel times)", device);
    times.emplace_back(calls_and_ns[0], calls_and_ns[1]);
    if (reset) check(cudaMemset(&state->timed_calls, 0, sizeof(calls_and_ns)), "cudaMemset (kernel times)", device);
  }
  return times;
}

std::vector<std::string> intranode_errors(int64_t buffer_id) {
  static const char* const kOps[] = {"?", "dispatch", "cached dispatch", "combine", "store probe"};
  static const char* const kWaits[] = {"?", "to publish its inputs (arrival)", "to finish reading (release)",
                                       "(its own blocks) to stage the inputs",
                                       "to store its rows of this rank's tokens (push combine)"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::string> lines;
  for (const auto& [key, memory] : g_ranks) {
    if (key.first != buffer_id || !memory->error) continue;
    const volatile IntranodeError& e = *memory->error;
    if (e.op == 0 || e.op >= static_cast<int32_t>(LowLatencyOp::kDispatchSend)) continue;  // LL: low_latency_errors
    const int op = (e.op >= 1 && e.op <= 4) ? e.op : 0;
    const int wait = (e.wait >= 1 && e.wait <= 4) ? e.wait : 0;
    lines.push_back("jax_ep " + std::string(kOps[op]) + " timed out on rank " + std::to_string(e.rank) +
                    " (CUDA device " + std::to_string(memory->device) + ") after " +
                    std::to_string(e.waited_ns / 1000000) + " ms waiting for rank " + std::to_string(e.peer) + " " +
                    kWaits[wait] + " in call " + std::to_string(e.call) + " (its flag was at " +
                    std::to_string(e.seen) + ")");
  }
  return lines;
}

}  // namespace jax_ep
