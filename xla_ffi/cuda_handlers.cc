// CUDA XLA FFI handlers: decode buffers and attributes, call csrc/api.h, turn CUDA errors into FFI errors.
#include <string>

#include "api.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace jax_ep::ffi_handlers {
namespace {

ffi::Error CudaError(const char* op, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_ep ") + op + ": " + cudaGetErrorString(err));
}

ffi::Error LayoutCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts,
                          int64_t num_ranks, ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                          ffi::ResultBuffer<ffi::S32> num_tokens_per_expert,
                          ffi::ResultBuffer<ffi::PRED> is_token_in_rank, ffi::ResultBuffer<ffi::S32> invalid_ids) {
  if (auto err = CheckLayoutArgs(topk_idx, num_experts, num_ranks); err.failure()) return err;
  const auto dims = topk_idx.dimensions();
  const cudaError_t err = layout_cuda(topk_idx.typed_data(), dims[0], dims[1], num_experts, num_ranks,
                                      num_tokens_per_rank->typed_data(), num_tokens_per_expert->typed_data(),
                                      is_token_in_rank->typed_data(), invalid_ids->typed_data(), stream);
  if (err != cudaSuccess) return CudaError("layout", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayoutCuda, LayoutCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
