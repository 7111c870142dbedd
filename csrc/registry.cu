// The registry of device memory by (Buffer id, CUDA ordinal) and what the runtimes share (registry.h).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "internode_state.h"
#include "intranode_state.h"
#include "registry.h"

namespace jax_ep {

bool DeviceEntry::empty() const {
#if defined(JAX_EP_WITH_NVSHMEM)
  if (internode || symmetric) return false;
#endif
  return !intranode;
}

DeviceEntry* Registry::find(int64_t buffer_id, int device) {
  auto it = entries_.find({buffer_id, device});
  return it == entries_.end() ? nullptr : &it->second;
}

DeviceEntry& Registry::find_or_create(int64_t buffer_id, int device) {
  if (DeviceEntry* entry = find(buffer_id, device)) return *entry;
  DeviceEntry entry;
  entry.device = device;
  check_cuda(cudaSetDevice(device), "cudaSetDevice", device, "jax_ep runtime");
  check_cuda(cudaHostAlloc(&entry.error_host, sizeof(TimeoutRecord), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc (timeout record)", device, "jax_ep runtime");
  std::memset(entry.error_host, 0, sizeof(TimeoutRecord));
  // With unified addressing the mapped host pointer is valid on the device.
  const cudaError_t err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&entry.error_device), entry.error_host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(entry.error_host);  // the lookup's error is the one to report
    check_cuda(err, "cudaHostGetDevicePointer (timeout record)", device, "jax_ep runtime");
  }
  return entries_.emplace(std::make_pair(buffer_id, device), std::move(entry)).first->second;
}

std::vector<DeviceEntry*> Registry::entries_of(int64_t buffer_id) {
  std::vector<DeviceEntry*> entries;
  for (auto it = entries_.lower_bound({buffer_id, -1}); it != entries_.end() && it->first.first == buffer_id; ++it)
    entries.push_back(&it->second);
  return entries;
}

void Registry::erase_empty(int64_t buffer_id) {
  for (auto it = entries_.lower_bound({buffer_id, -1}); it != entries_.end() && it->first.first == buffer_id;) {
    if (!it->second.empty()) {
      ++it;
      continue;
    }
    if (it->second.error_host) cudaFreeHost(it->second.error_host);  // nothing to report: pinned memory of a record
    it = entries_.erase(it);
  }
}

Registry& registry() {
  static Registry instance;
  return instance;
}

void check_cuda(cudaError_t err, const std::string& what, int device, const char* runtime) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(runtime) + ": " + what + " on CUDA device " + std::to_string(device) +
                             " failed: " + cudaGetErrorString(err));
}

CurrentDeviceGuard::CurrentDeviceGuard() {
  if (cudaGetDevice(&device_) != cudaSuccess) device_ = -1;
}

CurrentDeviceGuard::~CurrentDeviceGuard() {
  if (device_ >= 0) cudaSetDevice(device_);  // a destructor cannot report; the next CUDA call would
}

void ErrorList::note(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess)
    note(std::string(what) + " on device " + std::to_string(device) + ": " + cudaGetErrorString(err));
}

void ErrorList::note(const std::string& problem) { text_ += (text_.empty() ? "" : "; ") + problem; }

namespace {

// The words of the timeout records' codes (IntranodeOp and IntranodeWait, LowLatencyOp and LowLatencyWait,
// InternodeOp and InternodeWait: distinct ranges of one code space).
struct Words {
  int32_t code;
  const char* text;
};

constexpr Words kOps[] = {
    {static_cast<int32_t>(IntranodeOp::kDispatch), "dispatch"},
    {static_cast<int32_t>(IntranodeOp::kCachedDispatch), "cached dispatch"},
    {static_cast<int32_t>(IntranodeOp::kCombine), "combine"},
    {static_cast<int32_t>(IntranodeOp::kStoreProbe), "store probe"},
    {static_cast<int32_t>(IntranodeOp::kExpertMajorDispatch), "expert-major dispatch"},
    {static_cast<int32_t>(IntranodeOp::kExpertMajorCachedDispatch), "expert-major cached dispatch"},
    {static_cast<int32_t>(IntranodeOp::kExpertMajorCombine), "expert-major combine"},
    {static_cast<int32_t>(LowLatencyOp::kDispatchSend), "low_latency_dispatch (send)"},
    {static_cast<int32_t>(LowLatencyOp::kDispatchRecv), "low_latency_dispatch (receive)"},
    {static_cast<int32_t>(LowLatencyOp::kCombineSend), "low_latency_combine (send)"},
    {static_cast<int32_t>(LowLatencyOp::kCombineRecv), "low_latency_combine (receive)"},
    {static_cast<int32_t>(InternodeOp::kDispatch), "internode dispatch"},
    {static_cast<int32_t>(InternodeOp::kCachedDispatch), "internode cached dispatch"},
    {static_cast<int32_t>(InternodeOp::kCombine), "internode combine"},
    {static_cast<int32_t>(InternodeOp::kExpertMajorDispatch), "internode expert-major dispatch"},
    {static_cast<int32_t>(InternodeOp::kExpertMajorCachedDispatch), "internode expert-major cached dispatch"},
    {static_cast<int32_t>(InternodeOp::kExpertMajorCombine), "internode expert-major combine"},
};

// What the normal modes' waits wait for (the low-latency ones name the call, below).
constexpr Words kWaits[] = {
    {static_cast<int32_t>(IntranodeWait::kArrival), "to publish its inputs (arrival)"},
    {static_cast<int32_t>(IntranodeWait::kRelease), "to finish reading (release)"},
    {static_cast<int32_t>(IntranodeWait::kStaging), "(its own blocks) to stage the inputs"},
    {static_cast<int32_t>(IntranodeWait::kCombineRows), "to store its rows of this rank's tokens (push combine)"},
    {static_cast<int32_t>(IntranodeWait::kGrid), "(this rank's own blocks, grid barrier)"},
    {static_cast<int32_t>(InternodeWait::kCredit), "to free its region after the previous call (credit)"},
    {static_cast<int32_t>(InternodeWait::kArrival), "to deliver this call's data over the network"},
    {static_cast<int32_t>(InternodeWait::kReady), "to make its region readable (node peer)"},
    {static_cast<int32_t>(InternodeWait::kRelease), "to finish reading this rank's region (node peer)"},
    {static_cast<int32_t>(InternodeWait::kGrid), "(this rank's own blocks, grid barrier)"},
};

template <size_t N>
const char* words_of(const Words (&table)[N], int32_t code) {
  for (const Words& words : table)
    if (words.code == code) return words.text;
  return "?";
}

bool is_low_latency(int32_t op) {
  return op >= static_cast<int32_t>(LowLatencyOp::kDispatchSend) &&
         op <= static_cast<int32_t>(LowLatencyOp::kCombineRecv);
}

std::string describe(const volatile TimeoutRecord& e, int device) {
  std::string line = "jax_ep " + std::string(words_of(kOps, e.op)) + " timed out on rank " + std::to_string(e.rank) +
                     " (CUDA device " + std::to_string(device) + ") after " + std::to_string(e.waited_ns / 1000000) +
                     " ms waiting for rank " + std::to_string(e.peer);
  if (!is_low_latency(e.op))
    return line + " " + words_of(kWaits, e.wait) + " in call " + std::to_string(e.call) + " (its flag was at " +
           std::to_string(e.seen) + ")";
  const uint32_t call = static_cast<uint32_t>(e.call);  // the low-latency kernels count calls in 32 bits
  if (e.wait == static_cast<int32_t>(LowLatencyWait::kCredit))
    return line + " to finish receiving call " + std::to_string(call - 2) +
           " (a credit: are more than two results of this op between send and receive?)";
  return line + " to send its rows of call " + std::to_string(call) + " (flag " + std::to_string(e.seen) + ")";
}

}  // namespace

std::vector<std::string> timeout_errors(int64_t buffer_id, int32_t first_op, int32_t last_op,
                                        const std::vector<int>* devices) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  std::vector<std::string> lines;
  for (const DeviceEntry* entry : entries.entries_of(buffer_id)) {
    if (devices && std::find(devices->begin(), devices->end(), entry->device) == devices->end()) continue;
    // Written by a kernel before its trap, `op` last: a code in range means a complete record.
    const volatile TimeoutRecord& e = *entry->error_host;
    if (e.op >= first_op && e.op <= last_op) lines.push_back(describe(e, entry->device));
  }
  return lines;
}

#if defined(JAX_EP_INSTRUMENT)
std::vector<std::pair<uint64_t, uint64_t>> kernel_times(int64_t buffer_id, bool reset,
                                                        KernelTimer* (*timer_of)(const DeviceEntry&)) {
  Registry& entries = registry();
  std::lock_guard<std::mutex> lock(entries.mutex);
  CurrentDeviceGuard restore_device;
  std::vector<std::pair<uint64_t, uint64_t>> times;
  for (const DeviceEntry* entry : entries.entries_of(buffer_id)) {
    KernelTimer* timer = timer_of(*entry);
    if (!timer) continue;
    const int device = entry->device;
    check_cuda(cudaSetDevice(device), "cudaSetDevice", device, "jax_ep kernel times");
    uint64_t calls_and_ns[2];
    static_assert(offsetof(KernelTimer, ns) == offsetof(KernelTimer, calls) + sizeof(uint64_t), "read as one copy");
    check_cuda(cudaMemcpy(calls_and_ns, &timer->calls, sizeof(calls_and_ns), cudaMemcpyDeviceToHost),
               "cudaMemcpy (kernel times)", device, "jax_ep kernel times");
    times.emplace_back(calls_and_ns[0], calls_and_ns[1]);
    if (reset)
      check_cuda(cudaMemset(&timer->calls, 0, sizeof(calls_and_ns)), "cudaMemset (kernel times)", device,
                 "jax_ep kernel times");
  }
  return times;
}
#endif

}  // namespace jax_ep
