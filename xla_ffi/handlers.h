// Handler symbols defined in cpu_handlers.cc, cuda_handlers.cc and intranode_handlers.cc, exported by module.cc.
#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_handlers {

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCpu);
#if defined(JAX_EP_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCombine);
#endif

}  // namespace jax_ep::ffi_handlers
