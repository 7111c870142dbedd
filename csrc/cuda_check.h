// Error propagation for CUDA calls inside csrc/: every call is checked and the first failure returned.
#pragma once
#include <cuda_runtime.h>

#define JAX_EP_CUDA_RETURN(expr)                 \
  do {                                           \
    const cudaError_t jax_ep_err_ = (expr);      \
    if (jax_ep_err_ != cudaSuccess) return jax_ep_err_; \
  } while (0)
