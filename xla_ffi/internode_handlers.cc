// CUDA XLA FFI handlers of the internode normal mode (NVSHMEM builds): decode buffers and attributes, find this
// device's rank by (buffer_id, DeviceOrdinal), call csrc/api.h. Command-buffer compatible: the kernels keep
// their call numbers in device memory and the handlers never synchronise.
#include <string>
#include <vector>

#include "api.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace jax_ep::ffi_handlers {
namespace {

using namespace buffer_args;

ffi::Error Launched(const char* op, const InternodeCall& call, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  if (err == cudaErrorMemoryAllocation)  // the launch functions' answer when the shapes need a larger region
    return Invalid(op, "the call needs more than the Buffer's num_rdma_bytes=" +
                           std::to_string(call.group.region_bytes) +
                           " (jax_ep checks this while tracing; jax_ep.internode_buffer_bytes sizes it)");
  if (err == cudaErrorInvalidValue) return Invalid(op, "arguments outside the kernel's limits");
  return LaunchFailed(op, err);
}

ffi::Error MakeCall(const char* op, cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t num_sms,
                    int64_t timeout_ns, InternodeCall* call) {
  return MakeNormalCall(op, internode_lookup, "internode", "with ranks_per_node", stream, device, buffer_id, num_sms,
                        timeout_ns, call);
}

// args: x payloads (num_payloads: 1, or 2 for the FP8 pair), topk_idx, [topk_weights].
// rets: recv payloads, recv_topk_idx, [recv_topk_weights], num_recv_tokens, num_recv_tokens_per_expert,
//       num_dropped, invalid_ids, recv_src_index, is_token_in_rank, relay_row, relay_token.
ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs remaining_args,
                        ffi::RemainingRets remaining_rets, int64_t buffer_id, int64_t num_payloads,
                        int64_t num_experts, int64_t expert_alignment, int64_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "internode dispatch";
  InternodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  const InternodeRank& g = call.group;
  InternodeDispatchArgs a;
  size_t next = 0;
  if (auto err = DecodeDispatch(std::string("jax_ep ") + kOp, args, rets, num_payloads, num_experts,
                                expert_alignment, g.num_ranks, /*handle_results=*/2, &a, &next);
      err.failure())
    return err;
  const ffi::AnyBuffer& is_token_in_rank = rets[next - 1];  // the last result DecodeDispatch decoded
  const ffi::AnyBuffer& relay_row = rets[next++];
  const ffi::AnyBuffer& relay_token = rets[next++];
  const int64_t relayed = static_cast<int64_t>(g.num_nodes) * a.num_tokens;
  if (!IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.num_tokens, g.num_ranks) ||
      !IsMatrix(relay_row, ffi::DataType::S32, relayed, g.ranks_per_node) ||
      !IsVector(relay_token, ffi::DataType::PRED, relayed))
    return Invalid(kOp, "the handle's results must be is_token_in_rank bool [T, R], relay_row int32 [N*T, P] and "
                        "relay_token bool [N*T]");
  a.relay_row = static_cast<int32_t*>(relay_row.untyped_data());
  a.relay_token = static_cast<bool*>(relay_token.untyped_data());
  return Launched(kOp, call, internode_dispatch(call, a));
}

ffi::Error CachedDispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer recv_src_index,
                              ffi::AnyBuffer is_token_in_rank, ffi::Result<ffi::AnyBuffer> recv_x, int64_t buffer_id,
                              int64_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "internode cached dispatch";
  InternodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  InternodeCachedDispatchArgs a;
  a.x = x.untyped_data();
  a.row_bytes = RowBytes(x);
  a.num_tokens = LeadingDim(x);
  a.capacity = LeadingDim(*recv_x);
  if (!IsVector(recv_src_index, ffi::DataType::S32, a.capacity) || RowBytes(*recv_x) != a.row_bytes ||
      !IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.num_tokens, call.group.num_ranks))
    return Invalid(kOp, "recv_src_index [C], is_token_in_rank [T, R], x and the result disagree in shape");
  a.recv_src_index = static_cast<const int32_t*>(recv_src_index.untyped_data());
  a.is_token_in_rank = static_cast<const bool*>(is_token_in_rank.untyped_data());
  a.recv_x = recv_x->untyped_data();
  return Launched(kOp, call, internode_cached_dispatch(call, a));
}

// args: y [C, ...], recv_src_index [C], is_token_in_rank [T, R], relay_row [N*T, P], relay_token [N*T],
// [bias [T, ...]]; result [T, ...] of y's type or float32.
ffi::Error CombineImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs remaining_args,
                       ffi::Result<ffi::AnyBuffer> out, int64_t buffer_id, int64_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "internode combine";
  InternodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  std::vector<ffi::AnyBuffer> args;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (args.size() != 5 && args.size() != 6)
    return Invalid(kOp, "expects y, recv_src_index, is_token_in_rank, relay_row, relay_token and optionally bias");
  const InternodeRank& g = call.group;
  const ffi::AnyBuffer& y = args[0];
  InternodeCombineArgs a;
  if (!AsFloatType(y.element_type(), &a.y_type) || !AsFloatType(out->element_type(), &a.out_type))
    return Invalid(kOp, "y and the result must be float32, bfloat16 or float16");
  a.row_elements = RowElements(y);
  a.capacity = LeadingDim(y);
  a.num_tokens = LeadingDim(*out);
  if (RowElements(*out) != a.row_elements)
    return Invalid(kOp, "y and the result differ in row size");
  const int64_t relayed = static_cast<int64_t>(g.num_nodes) * a.num_tokens;
  if (!IsVector(args[1], ffi::DataType::S32, a.capacity) ||
      !IsMatrix(args[2], ffi::DataType::PRED, a.num_tokens, g.num_ranks) ||
      !IsMatrix(args[3], ffi::DataType::S32, relayed, g.ranks_per_node) ||
      !IsVector(args[4], ffi::DataType::PRED, relayed))
    return Invalid(kOp, "the handle must hold recv_src_index int32 [C], is_token_in_rank bool [T, R], relay_row "
                        "int32 [N*T, P] and relay_token bool [N*T]");
  a.y = y.untyped_data();
  a.recv_src_index = static_cast<const int32_t*>(args[1].untyped_data());
  a.is_token_in_rank = static_cast<const bool*>(args[2].untyped_data());
  a.relay_row = static_cast<const int32_t*>(args[3].untyped_data());
  a.relay_token = static_cast<const bool*>(args[4].untyped_data());
  if (args.size() == 6) {
    if (!DecodeBias(args[5], &a)) return Invalid(kOp, "bias must be floating [num_tokens, ...] like the result");
  }
  a.out = out->untyped_data();
  const cudaError_t err = internode_combine(call, a);
  if (err == cudaErrorInvalidValue)
    return Invalid(kOp, "the result and bias must have y's dtype or float32, and 16-bit rows an even length");
  return Launched(kOp, call, err);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeDispatch, DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_payloads")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("expert_alignment")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCachedDispatch, CachedDispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCombine, CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
