// Intranode runtime: per-group device state, peer access and the process-global registry that the FFI
// handlers query by (buffer id, device ordinal). Handlers of different devices run concurrently on
// different threads, so every registry access holds one mutex.
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

struct Group {
  std::vector<int> devices;               // CUDA ordinal by rank
  std::vector<IntranodeState*> states;    // device memory by rank (null where allocation never happened)
  IntranodeError* errors = nullptr;       // [num_ranks] pinned, mapped host memory
};

std::mutex g_mutex;
std::map<int64_t, std::vector<std::unique_ptr<Group>>> g_groups;   // buffer id -> its groups
std::map<std::pair<int64_t, int>, IntranodeRank> g_ranks;          // (buffer id, ordinal) -> launch view

void check(cudaError_t err, const char* what, int device) {
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string("jax_ep intranode runtime: ") + what + " on CUDA device " +
                           std::to_string(device) + " failed: " + cudaGetErrorString(err));
}

// Restores the calling thread's current device (JAX's threads expect theirs unchanged).
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() { cudaGetDevice(&device_); }
  ~CurrentDeviceGuard() { cudaSetDevice(device_); }

 private:
  int device_ = 0;
};

// Frees what `group` holds, collecting (not throwing) errors: used for teardown and failed creation.
std::string free_group(Group& group) {
  std::string errors;
  auto note = [&](cudaError_t err, const char* what, int device) {
    if (err != cudaSuccess)
      errors += std::string(errors.empty() ? "" : "; ") + what + " on device " + std::to_string(device) + ": " +
                cudaGetErrorString(err);
  };
  for (size_t r = 0; r < group.states.size(); ++r) {
    if (!group.states[r]) continue;
    note(cudaSetDevice(group.devices[r]), "cudaSetDevice", group.devices[r]);
    note(cudaDeviceSynchronize(), "cudaDeviceSynchronize", group.devices[r]);
    note(cudaFree(group.states[r]), "cudaFree", group.devices[r]);
    group.states[r] = nullptr;
  }
  if (group.errors) note(cudaFreeHost(group.errors), "cudaFreeHost", group.devices.empty() ? -1 : group.devices[0]);
  group.errors = nullptr;
  return errors;
}

void enable_peer_access(int device, int peer) {
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

void allocate_group(Group& group) {
  const int num_ranks = static_cast<int>(group.devices.size());
  check(cudaHostAlloc(&group.errors, num_ranks * sizeof(IntranodeError), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc (error records)", group.devices[0]);
  std::memset(group.errors, 0, num_ranks * sizeof(IntranodeError));
  for (int r = 0; r < num_ranks; ++r) {
    const int device = group.devices[r];
    check(cudaSetDevice(device), "cudaSetDevice", device);
    for (int p = 0; p < num_ranks; ++p)
      if (p != r) enable_peer_access(device, group.devices[p]);
    check(cudaMalloc(&group.states[r], sizeof(IntranodeState)), "cudaMalloc (intranode state)", device);
    check(cudaMemset(group.states[r], 0, sizeof(IntranodeState)), "cudaMemset (intranode state)", device);
  }
  for (int r = 0; r < num_ranks; ++r) {
    check(cudaSetDevice(group.devices[r]), "cudaSetDevice", group.devices[r]);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", group.devices[r]);
  }
}

}  // namespace

void intranode_create(int64_t buffer_id, const std::vector<int>& device_ordinals) {
  const int num_ranks = static_cast<int>(device_ordinals.size());
  if (num_ranks < 1 || num_ranks > kMaxIntranodeRanks)
    throw std::invalid_argument("jax_ep intranode runtime: a group has 1 to " + std::to_string(kMaxIntranodeRanks) +
                                " ranks, got " + std::to_string(num_ranks));
  if (std::set<int>(device_ordinals.begin(), device_ordinals.end()).size() != device_ordinals.size())
    throw std::invalid_argument("jax_ep intranode runtime: a device appears twice in one group");

  std::lock_guard<std::mutex> lock(g_mutex);
  for (int device : device_ordinals)
    if (g_ranks.count({buffer_id, device}))
      throw std::invalid_argument("jax_ep intranode runtime: buffer " + std::to_string(buffer_id) +
                                  " already has a group on CUDA device " + std::to_string(device));

  CurrentDeviceGuard restore_device;
  auto group = std::make_unique<Group>();
  group->devices = device_ordinals;
  group->states.assign(num_ranks, nullptr);
  std::vector<IntranodeRank> views(num_ranks);
  try {
    allocate_group(*group);
    // With unified addressing the mapped host pointer is valid on every device.
    IntranodeError* device_errors = nullptr;
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_errors), group->errors, 0),
          "cudaHostGetDevicePointer", group->devices[0]);
    for (int r = 0; r < num_ranks; ++r) {
      views[r].rank = r;
      views[r].num_ranks = num_ranks;
      check(cudaDeviceGetAttribute(&views[r].device_sms, cudaDevAttrMultiProcessorCount, group->devices[r]),
            "cudaDeviceGetAttribute", group->devices[r]);
      for (int p = 0; p < num_ranks; ++p) views[r].states[p] = group->states[p];
      views[r].error = device_errors + r;
    }
  } catch (...) {
    free_group(*group);
    throw;
  }
  for (int r = 0; r < num_ranks; ++r) g_ranks[{buffer_id, group->devices[r]}] = views[r];
  g_groups[buffer_id].push_back(std::move(group));
}

std::string intranode_destroy(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(buffer_id);
  if (it == g_groups.end()) return "";
  CurrentDeviceGuard restore_device;
  std::string errors;
  for (auto& group : it->second) {
    for (int device : group->devices) g_ranks.erase({buffer_id, device});
    const std::string group_errors = free_group(*group);
    if (!group_errors.empty()) errors += (errors.empty() ? "" : "; ") + group_errors;
  }
  g_groups.erase(it);
  return errors;
}

bool intranode_lookup(int64_t buffer_id, int device_ordinal, IntranodeRank* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_ranks.find({buffer_id, device_ordinal});
  if (it == g_ranks.end()) return false;
  *out = it->second;
  return true;
}

std::vector<std::pair<uint64_t, uint64_t>> intranode_kernel_times(int64_t buffer_id, bool reset) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::pair<uint64_t, uint64_t>> times;
  auto it = g_groups.find(buffer_id);
  if (it == g_groups.end()) return times;
  CurrentDeviceGuard restore_device;
  for (const auto& group : it->second) {
    for (size_t r = 0; r < group->devices.size(); ++r) {
      const int device = group->devices[r];
      check(cudaSetDevice(device), "cudaSetDevice", device);
      IntranodeState* state = group->states[r];
      uint64_t calls_and_ns[2];
      check(cudaMemcpy(calls_and_ns, &state->timed_calls, sizeof(calls_and_ns), cudaMemcpyDeviceToHost),
            "cudaMemcpy (kernel times)", device);
      times.emplace_back(calls_and_ns[0], calls_and_ns[1]);
      if (reset) check(cudaMemset(&state->timed_calls, 0, sizeof(calls_and_ns)), "cudaMemset (kernel times)", device);
    }
  }
  return times;
}

std::vector<std::string> intranode_errors(int64_t buffer_id) {
  static const char* const kOps[] = {"?", "dispatch", "cached dispatch", "combine"};
  static const char* const kWaits[] = {"?", "to publish its inputs (arrival)", "to finish reading (release)"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::string> lines;
  auto it = g_groups.find(buffer_id);
  if (it == g_groups.end()) return lines;
  for (const auto& group : it->second) {
    for (size_t r = 0; r < group->devices.size(); ++r) {
      const volatile IntranodeError& e = group->errors[r];
      if (e.op == 0) continue;
      const int op = (e.op >= 1 && e.op <= 3) ? e.op : 0;
      const int wait = (e.wait >= 1 && e.wait <= 2) ? e.wait : 0;
      lines.push_back("jax_ep " + std::string(kOps[op]) + " timed out on rank " + std::to_string(e.rank) +
                      " (CUDA device " + std::to_string(group->devices[r]) + ") after " +
                      std::to_string(e.waited_ns / 1000000) + " ms waiting for rank " + std::to_string(e.peer) +
                      " " + kWaits[wait] + " in call " + std::to_string(e.call) + " (its flag was at " +
                      std::to_string(e.seen) + ")");
    }
  }
  return lines;
}

}  // namespace jax_ep
