// Error propagation for CUDA calls inside csrc/: every call is checked and the first failure returned.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define JAX_EP_CUDA_RETURN(expr)                 \
  do {                                           \
    const cudaError_t jax_ep_err_ = (expr);      \
    if (jax_ep_err_ != cudaSuccess) return jax_ep_err_; \
  } while (0)

// Host-side runtime entry points (called from Python, never from a handler) throw instead.
#define JAX_EP_CUDA_THROW(expr)                                                                         \
  do {                                                                                                  \
    const cudaError_t jax_ep_err_ = (expr);                                                             \
    if (jax_ep_err_ != cudaSuccess)                                                                     \
      throw std::runtime_error(std::string("jax_ep: ") + #expr + " failed: " + cudaGetErrorString(jax_ep_err_)); \
  } while (0)
