// The low-latency ops' host side: finding a Buffer's LL region for a call, reading the kernels' timeout records
// and (instrumented builds) their trace.
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "api.h"
#include "cuda_check.h"
#include "intranode_state.h"
#include "low_latency_state.h"
#include "low_latency_trace.cuh"
#include "registry.h"

namespace jax_ep {

std::string low_latency_lookup(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport,
                               int64_t ll_offset, LowLatencyCall* call, int64_t* available_bytes) {
  call->transport = transport;
  switch (transport) {
    case LowLatencyTransport::kPeerStores: {
      IntranodeRank group;
      if (!intranode_lookup(buffer_id, device_ordinal, &group))
        return "no intranode state of buffer " + std::to_string(buffer_id) + " on CUDA device " +
               std::to_string(device_ordinal);
      call->group = LowLatencyRank{group.rank, group.num_ranks, group.device_sms, group.error};
      for (int p = 0; p < group.num_ranks; ++p) call->peer_regions[p] = group.workspaces[p] + ll_offset;
      call->region = call->peer_regions[group.rank];
      *available_bytes = group.workspace_bytes - ll_offset;
      return "";
    }
    case LowLatencyTransport::kNvshmem: {
#if defined(JAX_EP_WITH_NVSHMEM)
      SymmetricRegion symmetric;
      if (!nvshmem_region_lookup(buffer_id, device_ordinal, &symmetric))
        return "no NVSHMEM region of buffer " + std::to_string(buffer_id) + " on CUDA device " +
               std::to_string(device_ordinal);
      call->group = LowLatencyRank{symmetric.rank, symmetric.num_ranks, symmetric.device_sms, symmetric.error};
      call->region = symmetric.base + ll_offset;
      for (int p = 0; p < symmetric.num_ranks; ++p) {
        call->pes[p] = symmetric.pes[p];
        call->peer_regions[p] = symmetric.node_regions[p] ? symmetric.node_regions[p] + ll_offset : nullptr;
      }
      *available_bytes = symmetric.bytes - ll_offset;
      return "";
#else
      return "this jax_ep was built without NVSHMEM";
#endif
    }
  }
  return "unknown low-latency transport " + std::to_string(static_cast<int>(transport));
}

#if defined(JAX_EP_INSTRUMENT)
std::vector<std::vector<uint64_t>> low_latency_trace(int64_t buffer_id, const std::vector<int>& device_ordinals,
                                                     LowLatencyTransport transport, int64_t ll_offset, bool reset) {
  constexpr size_t kWords = kLowLatencyTraceBytes / sizeof(uint64_t);
  std::vector<std::vector<uint64_t>> traces;
  int current = 0;
  JAX_EP_CUDA_THROW(cudaGetDevice(&current));
  for (int device : device_ordinals) {
    LowLatencyCall call;
    int64_t available = 0;
    if (!low_latency_lookup(buffer_id, device, transport, ll_offset, &call, &available).empty()) continue;
    JAX_EP_CUDA_THROW(cudaSetDevice(device));
    char* trace = call.region + kLowLatencyTraceOffset;
    std::vector<uint64_t> words(kWords);
    JAX_EP_CUDA_THROW(cudaMemcpy(words.data(), trace, kLowLatencyTraceBytes, cudaMemcpyDeviceToHost));
    if (reset) {
      const std::vector<LowLatencyTrace> prepared(kLowLatencyKernels * kLowLatencyTraceCalls, prepared_trace());
      JAX_EP_CUDA_THROW(cudaMemcpy(trace, prepared.data(), kLowLatencyTraceBytes, cudaMemcpyHostToDevice));
    }
    traces.push_back(std::move(words));
  }
  JAX_EP_CUDA_THROW(cudaSetDevice(current));
  return traces;
}

std::pair<std::vector<std::string>, std::vector<std::vector<std::string>>> low_latency_trace_fields() {
  std::vector<std::vector<std::string>> phases;
  for (const auto& names : kLowLatencyPhaseNames) phases.emplace_back(std::begin(names), std::end(names));
  return {std::vector<std::string>(std::begin(kLowLatencyTraceFields), std::end(kLowLatencyTraceFields)), phases};
}
#endif

namespace {

__global__ void read_masks_kernel(const unsigned long long* words, int num_ranks, int32_t* masked) {
  for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) masked[p] = words[p] != 0;
}

// The LL region of buffer_id's rank on `device` (made current), or an exception naming what is missing.
LowLatencyCall region_of(int64_t buffer_id, int device, LowLatencyTransport transport, int64_t ll_offset) {
  LowLatencyCall call;
  int64_t available = 0;
  if (const std::string missing = low_latency_lookup(buffer_id, device, transport, ll_offset, &call, &available);
      !missing.empty())
    throw std::invalid_argument(missing);
  JAX_EP_CUDA_THROW(cudaSetDevice(device));
  return call;
}

// Restores the current device on leaving.
struct CurrentDevice {
  int device = 0;
  CurrentDevice() { JAX_EP_CUDA_THROW(cudaGetDevice(&device)); }
  ~CurrentDevice() { cudaSetDevice(device); }
};

}  // namespace

cudaError_t low_latency_read_masks(const LowLatencyCall& call, int32_t* masked) {
  read_masks_kernel<<<1, 64, 0, call.stream>>>(reinterpret_cast<const LowLatencyHeader*>(call.region)->masked,
                                               call.group.num_ranks, masked);
  return cudaGetLastError();
}

std::vector<std::vector<uint64_t>> low_latency_masks(int64_t buffer_id, const std::vector<int>& device_ordinals,
                                                     LowLatencyTransport transport, int64_t ll_offset) {
  const CurrentDevice current;
  std::vector<std::vector<uint64_t>> views;
  for (int device : device_ordinals) {
    const LowLatencyCall call = region_of(buffer_id, device, transport, ll_offset);
    LowLatencyHeader header;
    JAX_EP_CUDA_THROW(cudaMemcpy(&header, call.region, sizeof(header), cudaMemcpyDeviceToHost));
    std::vector<uint64_t> words(header.masked, header.masked + call.group.num_ranks);
    words.push_back(header.dispatch_calls);
    views.push_back(std::move(words));
  }
  return views;
}

void low_latency_set_masks(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport, int64_t ll_offset,
                           const std::vector<uint64_t>& masked) {
  const CurrentDevice current;
  const LowLatencyCall call = region_of(buffer_id, device_ordinal, transport, ll_offset);
  if (masked.size() != static_cast<size_t>(call.group.num_ranks))
    throw std::invalid_argument("low_latency_set_masks: one word per rank");
  JAX_EP_CUDA_THROW(cudaMemcpy(call.region + offsetof(LowLatencyHeader, masked), masked.data(),
                               masked.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
}

void low_latency_reset(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport, int64_t ll_offset,
                       int64_t num_max_tokens, int64_t hidden, int64_t num_experts) {
  const CurrentDevice current;
  const LowLatencyCall call = region_of(buffer_id, device_ordinal, transport, ll_offset);
  const LowLatencyLayout layout(num_max_tokens, hidden, call.group.num_ranks, num_experts);
  // The header (call counters, credits, masks), the send's counters, and both sets' flags: the flags carry call
  // numbers, which start again from 1. (Rows and indices are read only under a flag of their call.)
  JAX_EP_CUDA_THROW(cudaMemset(call.region, 0, kLowLatencyHeaderBytes));
  JAX_EP_CUDA_THROW(cudaMemset(call.region + layout.dispatch_counters, 0,
                               layout.dispatch_staging - layout.dispatch_counters));
  for (uint32_t set = 0; set < 2; ++set)
    JAX_EP_CUDA_THROW(cudaMemset(call.region + layout.set_offset(set), 0, layout.dispatch_index));
  JAX_EP_CUDA_THROW(cudaDeviceSynchronize());
}

std::vector<std::string> low_latency_errors(int64_t buffer_id, const std::vector<int>& device_ordinals) {
  return timeout_errors(buffer_id, static_cast<int32_t>(LowLatencyOp::kDispatchSend),
                        static_cast<int32_t>(LowLatencyOp::kCombineRecv), &device_ordinals);
}

}  // namespace jax_ep
