// The process's one registry of device memory, by (Buffer id, CUDA ordinal): what the intranode, internode and
// NVSHMEM runtimes (intranode_runtime.cu, internode_runtime.cu, nvshmem_runtime.cu) hold of a Buffer on one device,
// and the timeout record that every kernel of that Buffer on that device fills. The FFI
// handlers find their launch views here (the *_lookup functions of api.h). Handlers of different devices run
// concurrently on different threads, so every access holds the registry's mutex. Host code only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "kernel_timer.h"

namespace jax_ep {

struct TimeoutRecord;  // the timeout record (intranode_state.h)

// One rank of an intranode group held by this process (intranode_runtime.cu): its own allocation and the peers'
// memory it mapped.
struct IntranodeMemory {
  int rank = 0;
  int num_ranks = 0;
  int64_t workspace_bytes = 0;
  int64_t staging_bytes = 0;
  char* memory = nullptr;           // own allocation: the IntranodeState, then the workspace
  std::vector<void*> ipc_mappings;  // peers' allocations opened through CUDA IPC
  bool connected = false;
  IntranodeRank view;               // valid once connected
};

// Everything of one Buffer on one device of this process. An entry exists while one of its parts does.
struct DeviceEntry {
  int device = -1;
  // The timeout record of every kernel of this Buffer on this device (pinned host memory, mapped: readable after
  // a trap destroyed the CUDA context). The kernels tell their op apart by its codes (IntranodeOp, LowLatencyOp,
  // InternodeOp).
  TimeoutRecord* error_host = nullptr;
  TimeoutRecord* error_device = nullptr;  // the same record as the device sees it
  std::unique_ptr<IntranodeMemory> intranode;
#if defined(JAX_EP_WITH_NVSHMEM)
  std::unique_ptr<InternodeRank> internode;    // the launch view of an internode rank (its region is symmetric)
  std::unique_ptr<SymmetricRegion> symmetric;  // the low-latency region under the NVSHMEM transport
#endif
  bool empty() const;
};

class Registry {
 public:
  // Held for every call below and for every use of what they return.
  std::mutex mutex;

  // The entry of (buffer_id, device), or null.
  DeviceEntry* find(int64_t buffer_id, int device);
  // The entry of (buffer_id, device); a new one first gets its timeout record (throws std::runtime_error on a CUDA
  // failure, leaving nothing behind). Sets `device` current.
  DeviceEntry& find_or_create(int64_t buffer_id, int device);
  // Every entry of buffer_id, by CUDA ordinal.
  std::vector<DeviceEntry*> entries_of(int64_t buffer_id);
  // Frees the timeout records of buffer_id's entries that hold no part any more and forgets those entries.
  void erase_empty(int64_t buffer_id);

  // A lookup (takes the lock itself): copies *part(entry of (buffer_id, device)) into *out, or returns false where
  // there is no entry or part(entry) is null. Part: const DeviceEntry& -> const T*.
  template <typename T, typename Part>
  bool copy_part(int64_t buffer_id, int device, T* out, Part part) {
    std::lock_guard<std::mutex> lock(mutex);
    const DeviceEntry* entry = find(buffer_id, device);
    const T* found = entry ? part(*entry) : nullptr;
    if (found) *out = *found;
    return found != nullptr;
  }

 private:
  std::map<std::pair<int64_t, int>, DeviceEntry> entries_;
};

// The process's registry.
Registry& registry();

// ---- shared by the runtimes ---------------------------------------------------------------------------------------

// Throws std::runtime_error "<runtime>: <what> on CUDA device <device> failed: <CUDA error>" unless err is success.
void check_cuda(cudaError_t err, const std::string& what, int device, const char* runtime);

// Restores the calling thread's current device (JAX's threads expect theirs unchanged).
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard();
  ~CurrentDeviceGuard();

 private:
  int device_ = 0;
};

// Collects the errors of a teardown, which goes on past them, as one message.
class ErrorList {
 public:
  void note(cudaError_t err, const char* what, int device);
  void note(const std::string& problem);
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

#if defined(JAX_EP_WITH_NVSHMEM)
// Waits for `device`, then frees `pointer`'s symmetric memory (collective over every PE); a failure goes to `errors`.
void release_symmetric(int device, void* pointer, ErrorList& errors);
// node_regions[j] = the symmetric `base` of rank node * ranks_per_node + j (PE pe_of_rank[that rank]), mapped here for
// loads and stores, for every rank of `rank`'s node. Where one cannot be mapped, frees `base` (collective: every
// process meets the same topology, so all reach the free) and throws std::runtime_error, `runtime` naming the caller.
void map_node_regions(char* base, const int32_t* pe_of_rank, int rank, int ranks_per_node, char** node_regions,
                      const char* runtime);
#endif

// One line per entry of buffer_id (on `devices` only, when given) whose timeout record holds a code in
// [first_op, last_op]: the op, the rank, the peer it waited for and what for (readable after the trap).
std::vector<std::string> timeout_errors(int64_t buffer_id, int32_t first_op, int32_t last_op,
                                        const std::vector<int>* devices = nullptr);

#if defined(JAX_EP_INSTRUMENT)
// (calls, summed ns) of the kernel timer of every entry of buffer_id where timer_of(entry) gives one (a device
// pointer), zeroed after reading with `reset`. Call only while no kernel of the buffer runs.
std::vector<std::pair<uint64_t, uint64_t>> kernel_times(int64_t buffer_id, bool reset,
                                                        KernelTimer* (*timer_of)(const DeviceEntry&));
#endif

}  // namespace jax_ep
