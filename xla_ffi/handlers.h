// Handler symbols defined in cpu_handlers.cc, cuda_handlers.cc, intranode_handlers.cc, low_latency_handlers.cc and
// internode_handlers.cc, exported by module.cc.
#pragma once
#include <string>
#include <vector>

#include "api.h"
#include "kernel_limits.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_handlers {

// An op's bad-argument error: "jax_ep <op>: <message>" (op names the mode where it matters, e.g.
// "internode dispatch").
inline xla::ffi::Error Invalid(const std::string& op, const std::string& message) {
  return xla::ffi::Error::InvalidArgument("jax_ep " + op + ": " + message);
}

#if defined(JAX_EP_WITH_CUDA)
// The error of a kernel launch that failed for a reason the handler has no better words for (each handler file
// first turns the errors its launch functions use for refused arguments into Invalid).
inline xla::ffi::Error LaunchFailed(const std::string& op, cudaError_t err) {
  return xla::ffi::Error::Internal("jax_ep " + op + ": kernel launch failed: " + cudaGetErrorString(err));
}
#endif

// The layout handlers' shared argument check (CPU and CUDA).
inline xla::ffi::Error CheckLayoutArgs(const xla::ffi::Buffer<xla::ffi::S32>& topk_idx, int64_t num_experts,
                                       int64_t num_ranks) {
  if (topk_idx.dimensions().size() != 2)
    return xla::ffi::Error::InvalidArgument("jax_ep layout: topk_idx must be rank 2");
  if (num_ranks <= 0 || num_experts % num_ranks != 0)
    return xla::ffi::Error::InvalidArgument("jax_ep layout: num_experts must be a positive multiple of num_ranks");
  return xla::ffi::Error::Success();
}

#if defined(JAX_EP_WITH_CUDA)
// The launch settings of a normal-mode call (Call: IntranodeCall or InternodeCall): this device's rank in
// buffer `buffer_id`, found by `lookup` (intranode_lookup or internode_lookup; `mode` and `created_with` word
// the error when there is none), the SM count, the wait bound and the stream.
template <typename Call, typename Lookup>
xla::ffi::Error MakeNormalCall(const char* op, Lookup lookup, const char* mode, const char* created_with,
                               cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t num_sms,
                               int64_t timeout_ns, Call* call) {
  if (!lookup(buffer_id, device, &call->group))
    return Invalid(op, std::string("no ") + mode + " state of buffer " + std::to_string(buffer_id) +
                           " on CUDA device " + std::to_string(device) + " (create the Buffer " + created_with +
                           " over a mesh holding this device and keep it alive while programs that use it run)");
  if (num_sms < 1 || timeout_ns < 1) return Invalid(op, "num_sms and timeout_ns must be positive");
  call->num_sms = static_cast<int32_t>(num_sms);
  call->timeout_ns = timeout_ns;
  call->stream = stream;
  return xla::ffi::Error::Success();
}

// Decoding of the normal-mode handlers' buffers (intranode_handlers.cc, internode_handlers.cc). In a namespace of
// their own so that a handler file's local helpers cannot clash with them.
namespace buffer_args {

inline xla::ffi::Error Collect(const xla::ffi::RemainingArgs& args, std::vector<xla::ffi::AnyBuffer>* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<xla::ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    out->push_back(*buffer);
  }
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error Collect(const xla::ffi::RemainingRets& rets, std::vector<xla::ffi::AnyBuffer>* out) {
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<xla::ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    out->push_back(**buffer);
  }
  return xla::ffi::Error::Success();
}

inline int64_t LeadingDim(const xla::ffi::AnyBuffer& buffer) {
  const auto dims = buffer.dimensions();
  return dims.size() == 0 ? 1 : dims[0];
}

// Bytes of one row: everything after the leading axis.
inline int64_t RowBytes(const xla::ffi::AnyBuffer& buffer) {
  const auto dims = buffer.dimensions();
  int64_t elements = 1;
  for (size_t i = 1; i < dims.size(); ++i) elements *= dims[i];
  return elements * static_cast<int64_t>(xla::ffi::ByteWidth(buffer.element_type()));
}

// Elements of one row: everything after the leading axis.
inline int64_t RowElements(const xla::ffi::AnyBuffer& buffer) {
  return RowBytes(buffer) / static_cast<int64_t>(xla::ffi::ByteWidth(buffer.element_type()));
}

inline bool IsMatrix(const xla::ffi::AnyBuffer& buffer, xla::ffi::DataType type, int64_t rows, int64_t cols) {
  const auto dims = buffer.dimensions();
  return buffer.element_type() == type && dims.size() == 2 && dims[0] == rows && dims[1] == cols;
}

inline bool IsVector(const xla::ffi::AnyBuffer& buffer, xla::ffi::DataType type, int64_t size) {
  const auto dims = buffer.dimensions();
  return buffer.element_type() == type && dims.size() == 1 && dims[0] == size;
}

inline bool AsFloatType(xla::ffi::DataType dtype, FloatType* out) {
  switch (dtype) {
    case xla::ffi::DataType::F32: *out = FloatType::kF32; return true;
    case xla::ffi::DataType::BF16: *out = FloatType::kBF16; return true;
    case xla::ffi::DataType::F16: *out = FloatType::kF16; return true;
    default: return false;
  }
}

// The optional bias operand of both normal-mode combines (Args: CombineArgs or InternodeCombineArgs, after
// num_tokens and row_elements are set): floating [num_tokens, ...] with the result's row length. False where
// it is not; the caller names the error.
template <typename Args>
bool DecodeBias(const xla::ffi::AnyBuffer& bias, Args* a) {
  if (!AsFloatType(bias.element_type(), &a->bias_type) || LeadingDim(bias) != a->num_tokens ||
      RowElements(bias) != a->row_elements)
    return false;
  a->bias = bias.untyped_data();
  return true;
}

// The operands and results every normal-mode dispatch handler decodes alike (Args: DispatchArgs or
// InternodeDispatchArgs, whose fields share names). args: x payloads (num_payloads: 1, or 2 for the FP8 pair),
// topk_idx, [topk_weights]; rets: recv payloads, recv_topk_idx, [recv_topk_weights], num_recv_tokens,
// num_recv_tokens_per_expert, num_dropped, invalid_ids, recv_src_index, is_token_in_rank, then `handle_results`
// of the kernel's own, from index *next on. `op` prefixes the error messages (e.g. "jax_ep dispatch").
template <typename Args>
xla::ffi::Error DecodeDispatch(const std::string& op, const std::vector<xla::ffi::AnyBuffer>& args,
                               const std::vector<xla::ffi::AnyBuffer>& rets, int64_t num_payloads,
                               int64_t num_experts, int64_t expert_alignment, int num_ranks, size_t handle_results,
                               Args* a, size_t* next) {
  namespace ffi = xla::ffi;
  auto invalid = [&](const std::string& message) { return ffi::Error::InvalidArgument(op + ": " + message); };
  if (num_payloads < 1 || num_payloads > 2) return invalid("num_payloads must be 1 or 2");
  const size_t payloads = static_cast<size_t>(num_payloads);
  if (args.size() != payloads + 1 && args.size() != payloads + 2) return invalid("wrong number of operands");
  const bool has_weights = args.size() == payloads + 2;
  if (rets.size() != payloads + (has_weights ? 8 : 7) + handle_results) return invalid("wrong number of results");
  const ffi::AnyBuffer& topk_idx = args[payloads];
  const auto idx_dims = topk_idx.dimensions();
  if (topk_idx.element_type() != ffi::DataType::S32 || idx_dims.size() != 2)
    return invalid("topk_idx must be int32 [num_tokens, num_topk]");
  if (num_experts < num_ranks || num_experts % num_ranks) return invalid("num_experts must be a multiple of the ranks");
  if (idx_dims[1] < 1 || idx_dims[1] > kNormalMaxTopk)
    return invalid("1 to " + std::to_string(kNormalMaxTopk) + " top-k entries per token");
  a->num_payloads = static_cast<int32_t>(payloads);
  a->num_tokens = idx_dims[0];
  a->num_topk = idx_dims[1];
  a->num_experts = num_experts;
  a->capacity = LeadingDim(rets[0]);
  a->expert_alignment = expert_alignment;
  for (size_t p = 0; p < payloads; ++p) {
    if (LeadingDim(args[p]) != a->num_tokens || LeadingDim(rets[p]) != a->capacity ||
        RowBytes(args[p]) != RowBytes(rets[p]))
      return invalid("payload shapes disagree with topk_idx or the capacity");
    a->x[p] = args[p].untyped_data();
    a->x_row_bytes[p] = RowBytes(args[p]);
    a->recv_x[p] = rets[p].untyped_data();
  }
  a->topk_idx = static_cast<const int32_t*>(topk_idx.untyped_data());
  size_t i = payloads;
  a->recv_topk_idx = static_cast<int32_t*>(rets[i++].untyped_data());
  if (has_weights) {
    a->topk_weights = static_cast<const float*>(args[payloads + 1].untyped_data());
    a->recv_topk_weights = static_cast<float*>(rets[i++].untyped_data());
  }
  a->num_recv_tokens = static_cast<int32_t*>(rets[i++].untyped_data());
  a->num_recv_tokens_per_expert = static_cast<int32_t*>(rets[i++].untyped_data());
  a->num_dropped = static_cast<int32_t*>(rets[i++].untyped_data());
  a->invalid_ids = static_cast<int32_t*>(rets[i++].untyped_data());
  a->recv_src_index = static_cast<int32_t*>(rets[i++].untyped_data());
  a->is_token_in_rank = static_cast<bool*>(rets[i++].untyped_data());
  *next = i;
  return ffi::Error::Success();
}

}  // namespace buffer_args
#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCpu);
#if defined(JAX_EP_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeStoreProbe);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchSend);  // low_latency_handlers.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyCombineRecv);
#endif
#if defined(JAX_EP_WITH_NVSHMEM)
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeDispatch);  // internode_handlers.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeCombine);
#endif

}  // namespace jax_ep::ffi_handlers
