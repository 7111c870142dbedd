// CPU XLA FFI handler of the local (communication-free) layout op.
#include "api.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {
namespace {

ffi::Error LayoutCpuImpl(ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts, int64_t num_ranks,
                         ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                         ffi::ResultBuffer<ffi::S32> num_tokens_per_expert,
                         ffi::ResultBuffer<ffi::PRED> is_token_in_rank, ffi::ResultBuffer<ffi::S32> invalid_ids) {
  if (auto err = CheckLayoutArgs(topk_idx, num_experts, num_ranks); err.failure()) return err;
  const auto dims = topk_idx.dimensions();
  layout_cpu(topk_idx.typed_data(), dims[0], dims[1], num_experts, num_ranks, num_tokens_per_rank->typed_data(),
             num_tokens_per_expert->typed_data(), is_token_in_rank->typed_data(), invalid_ids->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayoutCpu, LayoutCpuImpl, WithLayoutSignature(ffi::Ffi::Bind()));

}  // namespace jax_ep::ffi_handlers
