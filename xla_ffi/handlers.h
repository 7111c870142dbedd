// Handler symbols defined in cpu_handlers.cc / cuda_handlers.cc and exported by module.cc.
#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_handlers {

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCpu);
#if defined(JAX_EP_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCuda);
#endif

}  // namespace jax_ep::ffi_handlers
