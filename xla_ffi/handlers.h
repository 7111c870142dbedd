// Handler symbols defined in cpu_handlers.cc, cuda_handlers.cc, intranode_handlers.cc, low_latency_handlers.cc and
// internode_handlers.cc, exported by module.cc.
#pragma once
#include <vector>

#include "api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_handlers {

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

inline bool AsFloatType(xla::ffi::DataType dtype, FloatType* out) {
  switch (dtype) {
    case xla::ffi::DataType::F32: *out = FloatType::kF32; return true;
    case xla::ffi::DataType::BF16: *out = FloatType::kBF16; return true;
    case xla::ffi::DataType::F16: *out = FloatType::kF16; return true;
    default: return false;
  }
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
