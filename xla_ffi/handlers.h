// Handler symbols defined in cpu_handlers.cc, cuda_handlers.cc, intranode_handlers.cc and low_latency_handlers.cc,
// exported by module.cc.
#pragma once
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

}  // namespace jax_ep::ffi_handlers
