// CUDA XLA FFI handlers of the local layout op, and the dispatch decoding the normal-mode handlers share.
#include <string>
#include <vector>

#include "api.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {

ffi::Error DecodeDispatch(const std::string& op, ffi::RemainingArgs remaining_args,
                          ffi::RemainingRets remaining_rets, int64_t num_payloads, int64_t num_experts,
                          int64_t expert_alignment, int num_ranks, size_t handle_results, NormalDispatchArgs* a,
                          std::vector<ffi::AnyBuffer>* handle) {
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  if (num_payloads < 1 || num_payloads > 2) return Invalid(op, "num_payloads must be 1 or 2");
  const size_t payloads = static_cast<size_t>(num_payloads);
  if (args.size() != payloads + 1 && args.size() != payloads + 2) return Invalid(op, "wrong number of operands");
  const bool has_weights = args.size() == payloads + 2;
  if (rets.size() != payloads + (has_weights ? 8 : 7) + handle_results) return Invalid(op, "wrong number of results");
  const ffi::AnyBuffer& topk_idx = args[payloads];
  const auto idx_dims = topk_idx.dimensions();
  if (topk_idx.element_type() != ffi::DataType::S32 || idx_dims.size() != 2)
    return Invalid(op, "topk_idx must be int32 [num_tokens, num_topk]");
  if (num_experts < num_ranks || num_experts % num_ranks)
    return Invalid(op, "num_experts must be a multiple of the ranks");
  if (idx_dims[1] < 1 || idx_dims[1] > kNormalMaxTopk)
    return Invalid(op, "1 to " + std::to_string(kNormalMaxTopk) + " top-k entries per token");
  a->num_payloads = static_cast<int32_t>(payloads);
  a->num_tokens = idx_dims[0];
  a->num_topk = idx_dims[1];
  a->num_experts = num_experts;
  a->capacity = LeadingDim(rets[0]);
  a->expert_alignment = expert_alignment;
  for (size_t p = 0; p < payloads; ++p) {
    if (LeadingDim(args[p]) != a->num_tokens || LeadingDim(rets[p]) != a->capacity ||
        RowBytes(args[p]) != RowBytes(rets[p]))
      return Invalid(op, "payload shapes disagree with topk_idx or the capacity");
    a->x[p] = args[p].untyped_data();
    a->x_row_bytes[p] = RowBytes(args[p]);
    a->recv_x[p] = rets[p].untyped_data();
  }
  a->topk_idx = DataOf<int32_t>(topk_idx);
  size_t i = payloads;
  a->recv_topk_idx = MutableDataOf<int32_t>(rets[i++]);
  if (has_weights) {
    a->topk_weights = DataOf<float>(args[payloads + 1]);
    a->recv_topk_weights = MutableDataOf<float>(rets[i++]);
  }
  a->num_recv_tokens = MutableDataOf<int32_t>(rets[i++]);
  a->num_recv_tokens_per_expert = MutableDataOf<int32_t>(rets[i++]);
  a->num_dropped = MutableDataOf<int32_t>(rets[i++]);
  a->invalid_ids = MutableDataOf<int32_t>(rets[i++]);
  a->recv_src_index = MutableDataOf<int32_t>(rets[i++]);
  if (!IsMatrix(rets[i], ffi::DataType::PRED, a->num_tokens, num_ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a->is_token_in_rank = MutableDataOf<bool>(rets[i++]);
  handle->assign(rets.begin() + i, rets.end());
  return ffi::Error::Success();
}

namespace {

ffi::Error LayoutCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts,
                          int64_t num_ranks, ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                          ffi::ResultBuffer<ffi::S32> num_tokens_per_expert,
                          ffi::ResultBuffer<ffi::PRED> is_token_in_rank, ffi::ResultBuffer<ffi::S32> invalid_ids) {
  if (auto err = CheckLayoutArgs(topk_idx, num_experts, num_ranks); err.failure()) return err;
  const auto dims = topk_idx.dimensions();
  const cudaError_t err = layout_cuda(topk_idx.typed_data(), dims[0], dims[1], num_experts, num_ranks,
                                      num_tokens_per_rank->typed_data(), num_tokens_per_expert->typed_data(),
                                      is_token_in_rank->typed_data(), invalid_ids->typed_data(), stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("jax_ep layout: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayoutCuda, LayoutCudaImpl,
                              WithLayoutSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
