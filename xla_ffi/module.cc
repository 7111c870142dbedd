// The nanobind module jax_ep._C: FFI handler capsules per (target, platform), build facts, the kernels' limits and
// region sizes, and the intranode, NVSHMEM and internode runtime entry points (C++ exceptions from the runtime become
// Python exceptions).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <iterator>
#include <stdexcept>
#include <string>

#include "api.h"
#include "handlers.h"

namespace nb = nanobind;

namespace {

// The benchmark's instruments (kernel timers, the low-latency trace) in a build without them: defined under the
// same names, they raise this.
void DefineNotInstrumented(nb::module_& m, const char* name) {
  m.def(name, [name](nb::args, nb::kwargs) {
    throw std::runtime_error(std::string("jax_ep._C.") + name +
                             ": this jax_ep was built without the benchmark instrumentation; rebuild it with "
                             "pip install --no-build-isolation -e . "
                             "--config-settings=cmake.define.JAX_EP_INSTRUMENT=ON");
  });
}

template <typename Fn>
nb::capsule Capsule(Fn* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// Every FFI target jax_ep defines, by the key Python looks it up with (jax_ep._native.target): XLA sees it as
// kTargetPrefix + key. The names exist in every build (CPU tests lower the CUDA paths); Registrations() gives the
// handlers of those this build has.
constexpr const char* kTargetPrefix = "jax_ep_";
constexpr const char* kTargetKeys[] = {
    "layout",
    "dispatch", "cached_dispatch", "combine",
    "expert_major_dispatch", "expert_major_cached_dispatch", "expert_major_combine", "expert_major_combine_backward",
    "store_probe",
    "low_latency_dispatch_send", "low_latency_dispatch_recv", "low_latency_combine_send", "low_latency_combine_recv",
    "low_latency_mask",
    "internode_dispatch", "internode_cached_dispatch", "internode_combine",
    "internode_expert_major_dispatch", "internode_expert_major_cached_dispatch", "internode_expert_major_combine",
    "internode_expert_major_combine_backward",
    "side_stream_join",
};

// The normal-mode ops: each has a twin target, its name plus kSideStreamSuffix, that runs on a jax_ep side stream
// (handlers.h, "side streams").
constexpr const char* kSideStreamKeys[] = {
    "dispatch", "cached_dispatch", "combine",
    "expert_major_dispatch", "expert_major_cached_dispatch", "expert_major_combine", "expert_major_combine_backward",
    "internode_dispatch", "internode_cached_dispatch", "internode_combine",
    "internode_expert_major_dispatch", "internode_expert_major_cached_dispatch", "internode_expert_major_combine",
    "internode_expert_major_combine_backward",
};
constexpr const char* kSideStreamSuffix = "_on_side_stream";

std::string TargetName(const std::string& key) {
  for (const char* known : kTargetKeys)
    if (key == known) return kTargetPrefix + key;
  throw std::logic_error("jax_ep._C: no FFI target key " + key);
}

nb::dict TargetNames() {
  nb::dict names;
  for (const char* key : kTargetKeys) names[key] = TargetName(key);
  return names;
}

nb::dict SideStreamTwins() {
  nb::dict twins;
  for (const char* key : kSideStreamKeys) twins[TargetName(key).c_str()] = TargetName(key) + kSideStreamSuffix;
  return twins;
}

nb::dict Registrations() {
  using namespace jax_ep::ffi_handlers;
  nb::dict layout;
  layout["cpu"] = Capsule(LayoutCpu);
#if defined(JAX_EP_WITH_CUDA)
  layout["CUDA"] = Capsule(LayoutCuda);
#endif
  nb::dict targets;
  targets[TargetName("layout").c_str()] = layout;
#if defined(JAX_EP_WITH_CUDA)
  auto cuda_only = [&](const char* key, nb::capsule handler) {
    nb::dict platforms;
    platforms["CUDA"] = handler;
    targets[TargetName(key).c_str()] = platforms;
  };
  // A normal-mode op on XLA's stream and its twin on a side stream.
  auto normal = [&](const char* key, nb::capsule on_xla_stream, nb::capsule on_side_stream) {
    cuda_only(key, on_xla_stream);
    nb::dict platforms;
    platforms["CUDA"] = on_side_stream;
    targets[(TargetName(key) + kSideStreamSuffix).c_str()] = platforms;
  };
  // Every normal-mode op of a mode (its handlers named MODE + op, its targets KEY_PREFIX + op): both modes have
  // the same ops.
#define JAX_EP_REGISTER_NORMAL_OP(key, Handler) normal(key, Capsule(Handler), Capsule(Handler##OnSideStream))
#define JAX_EP_REGISTER_NORMAL_OPS(key_prefix, Mode)                                                         \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "dispatch", Mode##Dispatch);                                            \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "cached_dispatch", Mode##CachedDispatch);                               \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "combine", Mode##Combine);                                              \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "expert_major_dispatch", Mode##ExpertMajorDispatch);                    \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "expert_major_cached_dispatch", Mode##ExpertMajorCachedDispatch);       \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "expert_major_combine", Mode##ExpertMajorCombine);                      \
  JAX_EP_REGISTER_NORMAL_OP(key_prefix "expert_major_combine_backward", Mode##ExpertMajorCombineBackward)
  JAX_EP_REGISTER_NORMAL_OPS("", Intranode);
  cuda_only("side_stream_join", Capsule(SideStreamJoin));
#if defined(JAX_EP_INSTRUMENT)
  cuda_only("store_probe", Capsule(IntranodeStoreProbe));
#endif
  cuda_only("low_latency_dispatch_send", Capsule(LowLatencyDispatchSend));
  cuda_only("low_latency_dispatch_recv", Capsule(LowLatencyDispatchRecv));
  cuda_only("low_latency_combine_send", Capsule(LowLatencyCombineSend));
  cuda_only("low_latency_combine_recv", Capsule(LowLatencyCombineRecv));
  cuda_only("low_latency_mask", Capsule(LowLatencyMask));
#if defined(JAX_EP_WITH_NVSHMEM)
  JAX_EP_REGISTER_NORMAL_OPS("internode_", Internode);
#endif
#undef JAX_EP_REGISTER_NORMAL_OPS
#undef JAX_EP_REGISTER_NORMAL_OP
#endif
  return targets;
}

// The enums whose values cross into Python as FFI attributes (csrc/api.h), by name: {enum: {member: value}}.
nb::dict Enums() {
  using jax_ep::CombineMethod, jax_ep::LowLatencyPayload, jax_ep::LowLatencyTransport;
  auto value = [](auto member) { return static_cast<int64_t>(member); };
  nb::dict combine_method, payload, transport, compression, enums;
  combine_method["pull"] = value(CombineMethod::kPull);
  combine_method["push"] = value(CombineMethod::kPush);
  payload["bf16"] = value(LowLatencyPayload::kBF16);
  payload["fp8"] = value(LowLatencyPayload::kFP8);
  payload["fp8_ue8m0"] = value(LowLatencyPayload::kFP8UE8M0);
  transport["peer_stores"] = value(LowLatencyTransport::kPeerStores);
  transport["nvshmem"] = value(LowLatencyTransport::kNvshmem);
  for (int64_t member = 0; member < static_cast<int64_t>(std::size(jax_ep::kLowLatencyCompressionNames)); ++member)
    compression[jax_ep::kLowLatencyCompressionNames[member]] = member;
  enums["combine_method"] = combine_method;
  enums["low_latency_payload"] = payload;
  enums["low_latency_transport"] = transport;
  enums["low_latency_compression"] = compression;
  return enums;
}

// Every limit and fixed size of csrc/kernel_limits.h that jax_ep checks or sizes with, by name.
nb::dict Limits() {
  nb::dict limits;
  limits["max_intranode_ranks"] = jax_ep::kMaxIntranodeRanks;
  limits["normal_max_topk"] = jax_ep::kNormalMaxTopk;
  limits["combine_max_push_warps"] = jax_ep::kCombineMaxPushWarps;
  limits["expert_major_max_experts"] = jax_ep::kExpertMajorMaxExperts;
  limits["expert_major_grad_zero_rows"] = jax_ep::kExpertMajorGradZeroRows;
  limits["max_side_streams"] = jax_ep::kMaxSideStreams;
  limits["staging_offset"] = jax_ep::kStagingOffset;
  limits["staging_align"] = jax_ep::kStagingAlign;
  limits["max_low_latency_ranks"] = jax_ep::kMaxLowLatencyRanks;
  limits["low_latency_max_topk"] = jax_ep::kLowLatencyMaxTopk;
  limits["low_latency_max_experts"] = jax_ep::kLowLatencyMaxExperts;
  limits["low_latency_max_entries"] = jax_ep::kLowLatencyMaxEntries;
  limits["low_latency_align"] = jax_ep::kLowLatencyAlign;
  limits["low_latency_header_bytes"] = jax_ep::kLowLatencyHeaderBytes;
  limits["low_latency_masked_bit"] = static_cast<int64_t>(jax_ep::kLowLatencyMaskedBit);
  limits["low_latency_trace_calls"] = jax_ep::kLowLatencyTraceCalls;
  limits["low_latency_trace_bytes"] = jax_ep::kLowLatencyTraceBytes;
  limits["low_latency_row_header_bytes"] = jax_ep::kLowLatencyRowHeaderBytes;
  limits["logfmt_block"] = jax_ep::kLogFmtBlock;
  limits["logfmt_code_bits"] = jax_ep::kLogFmtCodeBits;
  limits["logfmt_max_octaves"] = jax_ep::kLogFmtMaxOctaves;
  limits["logfmt_block_bytes"] = jax_ep::kLogFmtBlockBytes;
  limits["max_internode_ranks"] = jax_ep::kMaxInternodeRanks;
  limits["max_ranks_per_node"] = jax_ep::kMaxRanksPerNode;
  limits["internode_align"] = jax_ep::kInternodeAlign;
  limits["internode_header_bytes"] = jax_ep::kInternodeHeaderBytes;
  return limits;
}

// Dispatch staging for one or two payloads (the FP8 pair), as the intranode dispatch lays it out.
int64_t DispatchStagingBytes(int64_t num_tokens, const std::vector<int64_t>& payload_row_bytes, int64_t num_topk,
                             int64_t num_ranks, bool with_weights) {
  if (payload_row_bytes.size() != 1 && payload_row_bytes.size() != 2)
    throw nb::value_error("dispatch_staging_bytes: payload_row_bytes must hold 1 or 2 row sizes");
  const int64_t row_bytes[2] = {payload_row_bytes[0], payload_row_bytes.size() == 2 ? payload_row_bytes[1] : 0};
  return jax_ep::DispatchStaging(num_tokens, row_bytes, num_topk, with_weights, num_ranks).end;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native extension: XLA FFI handlers and the device runtime";
  m.def("registrations", &Registrations, "{target name: {platform: FFI handler capsule}}");
  m.def("target_names", &TargetNames, "{key: FFI target name} of every target jax_ep defines, built or not");
  m.def("side_stream_twins", &SideStreamTwins,
        "{normal-mode FFI target name: its twin's, which runs on a jax_ep side stream}, built or not");
  m.def("enums", &Enums, "{enum: {member: value}} of the enums passed as FFI attributes (csrc/api.h)");
  // Whether the benchmark's instruments are compiled in (CMake option JAX_EP_INSTRUMENT): the kernel timers
  // (intranode_kernel_times, internode_kernel_times), the low-latency trace (low_latency_trace,
  // low_latency_trace_fields) and the FFI target jax_ep_store_probe. Without them those functions raise and the
  // target is not registered.
  m.attr("with_instrumentation") = jax_ep::kInstrumented;
  // Limits and sizes (csrc/kernel_limits.h), in every build: jax_ep reads them here instead of keeping its own copies.
  m.def("limits", &Limits, "{name: value} of the kernels' limits and fixed sizes (csrc/kernel_limits.h).");
  m.def(
      "low_latency_region_bytes",
      [](int64_t num_max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts, bool staged_combine) {
        return jax_ep::LowLatencyLayout(num_max_tokens, hidden, num_ranks, num_experts, staged_combine).total;
      },
      nb::arg("num_max_tokens"), nb::arg("hidden"), nb::arg("num_ranks"), nb::arg("num_experts"),
      nb::arg("staged_combine"),
      "Bytes of a rank's low-latency region for these sizes (staged_combine: with the NVSHMEM transport's combine "
      "staging rows).");
  m.def("dispatch_staging_bytes", &DispatchStagingBytes, nb::arg("num_tokens"), nb::arg("payload_row_bytes"),
        nb::arg("num_topk"), nb::arg("num_ranks"), nb::arg("with_weights"),
        "Workspace bytes an intranode dispatch stages in a group spanning processes (payload_row_bytes: 1 or 2).");
  m.def(
      "cached_dispatch_staging_bytes",
      [](int64_t num_tokens, int64_t row_bytes) { return jax_ep::CachedDispatchStaging(num_tokens, row_bytes).end; },
      nb::arg("num_tokens"), nb::arg("row_bytes"),
      "Workspace bytes an intranode cached dispatch stages in a group spanning processes.");
  m.def(
      "combine_staging_bytes",
      [](int64_t num_tokens, int64_t row_bytes, int64_t num_ranks, int64_t capacity, bool push) {
        return jax_ep::CombineStaging(num_tokens, row_bytes, num_ranks, capacity, push).end;
      },
      nb::arg("num_tokens"), nb::arg("row_bytes"), nb::arg("num_ranks"), nb::arg("capacity"), nb::arg("push"),
      "Workspace bytes an intranode combine uses in a group spanning processes (push: the slots; pull: y's copy).");
  m.def(
      "internode_dispatch_bytes",
      [](int64_t num_nodes, int64_t ranks_per_node, int64_t num_tokens, int64_t num_topk, int64_t payload_bytes) {
        return jax_ep::InternodeDispatchLayout(num_nodes, ranks_per_node, num_tokens, num_topk, payload_bytes).total;
      },
      nb::arg("num_nodes"), nb::arg("ranks_per_node"), nb::arg("num_tokens"), nb::arg("num_topk"),
      nb::arg("payload_bytes"), "Region bytes of an internode dispatch (num_topk=0: cached dispatch).");
  m.def(
      "internode_combine_bytes",
      [](int64_t num_nodes, int64_t num_tokens, int64_t capacity, int64_t row_elements, int64_t item_bytes) {
        return jax_ep::InternodeCombineLayout(num_nodes, num_tokens, capacity, row_elements, item_bytes).total;
      },
      nb::arg("num_nodes"), nb::arg("num_tokens"), nb::arg("capacity"), nb::arg("row_elements"), nb::arg("item_bytes"),
      "Region bytes of an internode combine.");
#if defined(JAX_EP_WITH_CUDA)
  m.def("create_intranode", &jax_ep::intranode_create, nb::arg("buffer_id"), nb::arg("device_ordinals"),
        nb::arg("workspace_bytes"), nb::arg("staging_bytes"),
        "One process driving a whole group: allocates every rank's state and workspace (device_ordinals: CUDA "
        "ordinals in EP-rank order) and enables peer access between its devices.");
  m.def(
      "export_intranode",
      [](int64_t buffer_id, int device_ordinal, int rank, int num_ranks, int64_t workspace_bytes,
         int64_t staging_bytes) {
        const std::string handle =
            jax_ep::intranode_export(buffer_id, device_ordinal, rank, num_ranks, workspace_bytes, staging_bytes);
        return nb::bytes(handle.data(), handle.size());
      },
      nb::arg("buffer_id"), nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("num_ranks"),
      nb::arg("workspace_bytes"), nb::arg("staging_bytes"),
      "Group spanning processes, step 1: allocates this rank on a local device; returns its CUDA IPC handle.");
  m.def(
      "connect_intranode",
      [](int64_t buffer_id, int device_ordinal, const std::vector<nb::bytes>& ipc_handles,
         const std::vector<int>& local_ordinals) {
        std::vector<std::string> handles;
        for (const nb::bytes& handle : ipc_handles) handles.emplace_back(handle.c_str(), handle.size());
        jax_ep::intranode_connect(buffer_id, device_ordinal, handles, local_ordinals);
      },
      nb::arg("buffer_id"), nb::arg("device_ordinal"), nb::arg("ipc_handles"), nb::arg("local_ordinals"),
      "Step 2: maps every rank's memory (IPC handles by rank; local_ordinals[p] >= 0 for ranks of this process).");
  m.def("unmap_intranode", &jax_ep::intranode_unmap, nb::arg("buffer_id"),
        "Waits for every device of buffer_id in this process and unmaps its peers; returns '' or the CUDA errors.");
  m.def("destroy_intranode", &jax_ep::intranode_destroy, nb::arg("buffer_id"),
        "Waits for and frees every group of buffer_id; returns '' or the CUDA errors met.");
  m.def("intranode_errors", &jax_ep::intranode_errors, nb::arg("buffer_id"),
        "One line per rank of buffer_id whose kernel timed out waiting for a peer (readable after the trap).");
  m.def("low_latency_errors", &jax_ep::low_latency_errors, nb::arg("buffer_id"), nb::arg("device_ordinals"),
        "One line per device whose low-latency kernel of buffer_id timed out (op, rank, peer, call).");
  const auto transport_of = [](int transport) { return static_cast<jax_ep::LowLatencyTransport>(transport); };
  m.def(
      "low_latency_masks",
      [transport_of](int64_t buffer_id, const std::vector<int>& device_ordinals, int transport, int64_t ll_offset) {
        return jax_ep::low_latency_masks(buffer_id, device_ordinals, transport_of(transport), ll_offset);
      },
      nb::arg("buffer_id"), nb::arg("device_ordinals"), nb::arg("transport"), nb::arg("ll_offset"),
      "Per device: the LL header's masked words [R] (0, or 2**32 | the dispatches started when masked), then the "
      "dispatches started. Only while no kernel of the buffer runs.");
  m.def(
      "low_latency_set_masks",
      [transport_of](int64_t buffer_id, int device_ordinal, int transport, int64_t ll_offset,
                     const std::vector<uint64_t>& masked) {
        jax_ep::low_latency_set_masks(buffer_id, device_ordinal, transport_of(transport), ll_offset, masked);
      },
      nb::arg("buffer_id"), nb::arg("device_ordinal"), nb::arg("transport"), nb::arg("ll_offset"), nb::arg("masked"),
      "Writes the LL header's masked words [R] of the device's rank. Only while no kernel of the buffer runs.");
  m.def(
      "low_latency_reset",
      [transport_of](int64_t buffer_id, int device_ordinal, int transport, int64_t ll_offset, int64_t num_max_tokens,
                     int64_t hidden, int64_t num_experts) {
        jax_ep::low_latency_reset(buffer_id, device_ordinal, transport_of(transport), ll_offset, num_max_tokens, hidden,
                                  num_experts);
      },
      nb::arg("buffer_id"), nb::arg("device_ordinal"), nb::arg("transport"), nb::arg("ll_offset"),
      nb::arg("num_max_tokens"), nb::arg("hidden"), nb::arg("num_experts"),
      "Zeroes the device's LL state (counters, credits, flags, masks) as when made; every rank of the group, while "
      "no kernel of the buffer runs on any of them.");
#if defined(JAX_EP_INSTRUMENT)
  m.def(
      "low_latency_trace",
      [](int64_t buffer_id, const std::vector<int>& device_ordinals, int transport, int64_t ll_offset, bool reset) {
        return jax_ep::low_latency_trace(buffer_id, device_ordinals, static_cast<jax_ep::LowLatencyTransport>(transport),
                                         ll_offset, reset);
      },
      nb::arg("buffer_id"), nb::arg("device_ordinals"), nb::arg("transport"), nb::arg("ll_offset"),
      nb::arg("reset") = false,
      "Per device: the LL kernels' trace rings as 64-bit words (kernel, slot, word); reset prepares them.");
  m.def("low_latency_trace_fields", &jax_ep::low_latency_trace_fields,
        "(names of the trace words every LL kernel has, per kernel the names of its phase words).");
  m.def("intranode_kernel_times", &jax_ep::intranode_kernel_times, nb::arg("buffer_id"), nb::arg("reset") = false,
        "[(calls, summed kernel ns)] per device of buffer_id in this process, by CUDA ordinal, since the last reset (benchmark figure).");
#else
  for (const char* name : {"low_latency_trace", "low_latency_trace_fields", "intranode_kernel_times"})
    DefineNotInstrumented(m, name);
#endif
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
#if defined(JAX_EP_WITH_NVSHMEM)
  m.attr("with_nvshmem") = true;
  m.def("nvshmem_unique_id", [] {
    const std::string id = jax_ep::nvshmem_unique_id();
    return nb::bytes(id.data(), id.size());
  }, "A fresh NVSHMEM unique id (bytes) for nvshmem_initialize on every process.");
  m.def(
      "nvshmem_initialize",
      [](int device_ordinal, int rank, int num_ranks, nb::bytes unique_id) {
        jax_ep::nvshmem_initialize(device_ordinal, rank, num_ranks, std::string(unique_id.c_str(), unique_id.size()));
      },
      nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("unique_id"),
      "Collective: this process becomes PE `rank` of `num_ranks` on its CUDA device.");
  m.def("nvshmem_is_initialized", &jax_ep::nvshmem_is_initialized);
  m.def("nvshmem_ring_check", &jax_ep::nvshmem_ring_check,
        "Collective: every PE puts its rank to the next one; returns what this PE received.");
  m.def("nvshmem_region_create", &jax_ep::nvshmem_region_create, nb::arg("buffer_id"), nb::arg("device_ordinal"),
        nb::arg("bytes"), nb::arg("pes"), nb::arg("ranks_per_node"),
        "Collective over every PE: zeroed symmetric memory for (buffer_id, device); pes[r]: the PE of EP rank r; "
        "the ranks of this rank's node (ranks_per_node; 1: itself) are mapped for loads and stores.");
  m.def("nvshmem_region_destroy", &jax_ep::nvshmem_region_destroy, nb::arg("buffer_id"), nb::arg("release"),
        "Forgets buffer_id's regions; with release (collective) frees them. Returns '' or the errors met.");
  // ---- internode normal mode ----
  m.def("create_internode", &jax_ep::internode_create, nb::arg("buffer_id"), nb::arg("device_ordinal"), nb::arg("rank"),
        nb::arg("ranks_per_node"), nb::arg("pe_of_rank"), nb::arg("region_bytes"),
        "Collective over every NVSHMEM PE: allocates this rank's symmetric region (header + region_bytes) and maps "
        "its node peers' regions (pe_of_rank: the PE of every EP rank).");
  m.def("destroy_internode", &jax_ep::internode_destroy, nb::arg("buffer_id"), nb::arg("release"),
        "Forgets the internode rank of buffer_id; with release (collective) waits for the device and frees its region. "
        "Returns '' or the errors met.");
  m.def("internode_errors", &jax_ep::internode_errors, nb::arg("buffer_id"),
        "One line per rank of buffer_id in this process whose internode kernel timed out (readable after the trap).");
#if defined(JAX_EP_INSTRUMENT)
  m.def("internode_kernel_times", &jax_ep::internode_kernel_times, nb::arg("buffer_id"), nb::arg("reset") = false,
        "[(calls, summed kernel ns)] per device of buffer_id in this process since the last reset.");
#else
  DefineNotInstrumented(m, "internode_kernel_times");
#endif
#else
  m.attr("with_nvshmem") = false;
#endif
}
