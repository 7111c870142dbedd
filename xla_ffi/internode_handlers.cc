// CUDA XLA FFI handlers of the internode normal mode (NVSHMEM builds), in the normal-mode frame of handlers.h: decode
// buffers and attributes, call csrc/api.h. On XLA's stream command-buffer compatible: the kernels keep their call
// numbers in device memory and the handlers never synchronise; each op's twin runs on a side stream.
#include <optional>
#include <string>
#include <vector>

#include "api.h"
#include "expert_major_decode.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {
namespace {

// The launch functions' cudaErrorMemoryAllocation: the shapes need a larger region.
auto RegionTooSmall(const InternodeCall& call) {
  return [&call] {
    return "the call needs more than the Buffer's num_rdma_bytes=" + std::to_string(call.group.region_bytes) +
           " (jax_ep checks this while tracing; jax_ep.internode_buffer_bytes sizes it)";
  };
}

// The relay part of a handle: relay_row int32 [N*T, P] and relay_token bool [N*T].
bool IsRelay(const InternodeRank& g, int64_t num_tokens, const ffi::AnyBuffer& relay_row,
             const ffi::AnyBuffer& relay_token) {
  const int64_t relayed = static_cast<int64_t>(g.num_nodes) * num_tokens;
  return IsMatrix(relay_row, ffi::DataType::S32, relayed, g.ranks_per_node) &&
         IsVector(relay_token, ffi::DataType::PRED, relayed);
}

// The dispatch's handle results: relay_row and relay_token.
ffi::Error Dispatch(const char* op, const InternodeCall& call, InternodeDispatchArgs& a,
                    const std::vector<ffi::AnyBuffer>& handle) {
  if (!IsRelay(call.group, a.num_tokens, handle[0], handle[1]))
    return Invalid(op, "the handle's results must be relay_row int32 [N*T, P] and relay_token bool [N*T]");
  a.relay_row = MutableDataOf<int32_t>(handle[0]);
  a.relay_token = MutableDataOf<bool>(handle[1]);
  return Launched(op, internode_dispatch(call, a), RegionTooSmall(call));
}

ffi::Error CachedDispatch(const char* op, const InternodeCall& call, ffi::AnyBuffer x, ffi::AnyBuffer recv_src_index,
                          ffi::AnyBuffer is_token_in_rank, ffi::Result<ffi::AnyBuffer> recv_x) {
  InternodeCachedDispatchArgs a;
  a.x = x.untyped_data();
  a.row_bytes = RowBytes(x);
  a.num_tokens = LeadingDim(x);
  a.capacity = LeadingDim(*recv_x);
  if (!IsVector(recv_src_index, ffi::DataType::S32, a.capacity) || RowBytes(*recv_x) != a.row_bytes ||
      !IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.num_tokens, call.group.num_ranks))
    return Invalid(op, "recv_src_index [C], is_token_in_rank [T, R], x and the result disagree in shape");
  a.recv_src_index = DataOf<int32_t>(recv_src_index);
  a.is_token_in_rank = DataOf<bool>(is_token_in_rank);
  a.recv_x = recv_x->untyped_data();
  return Launched(op, internode_cached_dispatch(call, a), RegionTooSmall(call));
}

// args: y [C, ...], recv_src_index [C], is_token_in_rank [T, R], relay_row [N*T, P], relay_token [N*T],
// [bias [T, ...]]; result [T, ...] of y's type or float32.
ffi::Error Combine(const char* op, const InternodeCall& call, ffi::AnyBuffer y, ffi::AnyBuffer recv_src_index,
                   ffi::AnyBuffer is_token_in_rank, ffi::AnyBuffer relay_row, ffi::AnyBuffer relay_token,
                   std::optional<ffi::AnyBuffer> bias, ffi::Result<ffi::AnyBuffer> out) {
  InternodeCombineArgs a;
  if (auto err = DecodeCombineOutput(op, y, *out, bias, &a); err.failure()) return err;
  if (!IsVector(recv_src_index, ffi::DataType::S32, a.capacity) ||
      !IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.num_tokens, call.group.num_ranks) ||
      !IsRelay(call.group, a.num_tokens, relay_row, relay_token))
    return Invalid(op, "the handle must hold recv_src_index int32 [C], is_token_in_rank bool [T, R], relay_row "
                        "int32 [N*T, P] and relay_token bool [N*T]");
  a.recv_src_index = DataOf<int32_t>(recv_src_index);
  a.is_token_in_rank = DataOf<bool>(is_token_in_rank);
  a.relay_row = DataOf<int32_t>(relay_row);
  a.relay_token = DataOf<bool>(relay_token);
  const cudaError_t err = internode_combine(call, a);
  if (err == cudaErrorInvalidValue)
    return Invalid(op, "the result and bias must have y's dtype or float32, and 16-bit rows an even length");
  return Launched(op, err, RegionTooSmall(call));
}

// ---- expert-major ops (expert_major_decode.h, plus the relay part and is_token_in_rank) ------------------------

// Rets: the intranode expert-major dispatch's, then relay_row [N*T, P] and relay_token [N*T].
ffi::Error ExpertMajorDispatch(const char* op, const InternodeCall& call, ffi::RemainingArgs remaining_args,
                               ffi::RemainingRets remaining_rets, int64_t num_payloads, int64_t num_experts,
                               int64_t expert_alignment) {
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  InternodeExpertMajorDispatchArgs a;
  if (auto err = DecodeExpertMajorDispatch(op, call.group.num_ranks, args, rets, 2, num_payloads, num_experts,
                                           expert_alignment, &a.rows);
      err.failure())
    return err;
  const ffi::AnyBuffer& relay_row = rets[rets.size() - 2];
  const ffi::AnyBuffer& relay_token = rets[rets.size() - 1];
  if (!IsRelay(call.group, a.rows.num_tokens, relay_row, relay_token))
    return Invalid(op, "the last results must be relay_row int32 [N*T, P] and relay_token bool [N*T]");
  a.relay_row = MutableDataOf<int32_t>(relay_row);
  a.relay_token = MutableDataOf<bool>(relay_token);
  const cudaError_t err = internode_expert_major_dispatch(call, a);
  if (err == cudaErrorInvalidValue) return Invalid(op, kBlockCountsTooFew);
  return Launched(op, err, RegionTooSmall(call));
}

// args: x [T, ...], pair_row [R*T, P], recv_src_index [C], rows_end [1], is_token_in_rank [T, R]; ret: recv_x.
ffi::Error ExpertMajorCachedDispatch(const char* op, const InternodeCall& call, ffi::AnyBuffer x,
                                     ffi::AnyBuffer pair_row, ffi::AnyBuffer recv_src_index, ffi::AnyBuffer rows_end,
                                     ffi::AnyBuffer is_token_in_rank, ffi::Result<ffi::AnyBuffer> recv_x) {
  InternodeExpertMajorCachedDispatchArgs a;
  if (auto err = DecodeExpertMajorCachedDispatch(op, call.group.num_ranks, x, pair_row, recv_src_index, rows_end,
                                                 *recv_x, &a.rows);
      err.failure())
    return err;
  if (!IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.rows.num_tokens, call.group.num_ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a.is_token_in_rank = DataOf<bool>(is_token_in_rank);
  return Launched(op, internode_expert_major_cached_dispatch(call, a), RegionTooSmall(call));
}

// args: d_out [T, ...], y [C, ...], pair_row [R*T, P], recv_src_index [C], rows_end [1], is_token_in_rank [T, R],
// then weights float32 [C] when `weighted`; rets: d_y, then d_weights when `weighted`.
ffi::Error ExpertMajorCombineBackward(const char* op, const InternodeCall& call, ffi::AnyBuffer d_out,
                                      ffi::AnyBuffer y, ffi::AnyBuffer pair_row, ffi::AnyBuffer recv_src_index,
                                      ffi::AnyBuffer rows_end, ffi::AnyBuffer is_token_in_rank,
                                      ffi::RemainingArgs optional_args, ffi::Result<ffi::AnyBuffer> d_y,
                                      std::optional<ffi::Result<ffi::AnyBuffer>> d_weights, int64_t weighted) {
  std::vector<ffi::AnyBuffer> optional;
  if (auto err = Collect(optional_args, &optional); err.failure()) return err;
  InternodeExpertMajorCombineBackwardArgs a;
  if (auto err = DecodeExpertMajorCombineBackward(op, call.group.num_ranks, d_out, y, pair_row, recv_src_index,
                                                  rows_end, optional, *d_y,
                                                  d_weights ? &**d_weights : nullptr, weighted, &a.gradients);
      err.failure())
    return err;
  if (!IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.gradients.rows.num_tokens, call.group.num_ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a.is_token_in_rank = DataOf<bool>(is_token_in_rank);
  return Launched(op, internode_expert_major_combine_backward(call, a), RegionTooSmall(call));
}

// args: y [C, ...], pair_row [R*T, P], is_token_in_rank [T, R], relay_row [N*T, P], relay_token [N*T], then
// weights float32 [C] when `weighted`, then the bias [T, ...] when given; ret: out [T, ...] of y's type or float32.
ffi::Error ExpertMajorCombine(const char* op, const InternodeCall& call, ffi::AnyBuffer y, ffi::AnyBuffer pair_row,
                              ffi::AnyBuffer is_token_in_rank, ffi::AnyBuffer relay_row, ffi::AnyBuffer relay_token,
                              ffi::RemainingArgs optional_args, ffi::Result<ffi::AnyBuffer> out, int64_t weighted) {
  std::vector<ffi::AnyBuffer> optional;
  if (auto err = Collect(optional_args, &optional); err.failure()) return err;
  InternodeExpertMajorCombineArgs a;
  if (auto err = DecodeExpertMajorCombine(op, call.group.num_ranks, y, pair_row, is_token_in_rank, optional, *out,
                                          weighted, &a.partials);
      err.failure())
    return err;
  if (!IsRelay(call.group, a.partials.num_tokens, relay_row, relay_token))
    return Invalid(op, "relay_row must be int32 [N*T, P] and relay_token bool [N*T]");
  // The relay and origin sums read the staged partials: R*T rows of y's type, one per item.
  InternodeCombineArgs& sums = a.sums;
  static_cast<NormalCombineArgs&>(sums) = a.partials;
  sums.capacity = call.group.num_ranks * a.partials.num_tokens;
  sums.is_token_in_rank = a.partials.is_token_in_rank;
  sums.relay_row = DataOf<int32_t>(relay_row);
  sums.relay_token = DataOf<bool>(relay_token);
  sums.bias = a.partials.bias;
  sums.bias_type = a.partials.bias_type;
  sums.out = a.partials.out;
  sums.out_type = a.partials.out_type;
  const cudaError_t err = internode_expert_major_combine(call, a);
  if (err == cudaErrorInvalidValue)
    return Invalid(op, "the result and bias must have y's dtype or float32, and 16-bit rows an even length");
  return Launched(op, err, RegionTooSmall(call));
}

// The tails of the bindings (handlers.h, JAX_EP_DEFINE_NORMAL_HANDLERS).
constexpr auto kCachedDispatchTail = [](auto&& binding) {  // x, recv_src_index, is_token_in_rank; recv_x
  return AnyBufferArgs<3>(std::move(binding)).template Ret<ffi::AnyBuffer>();
};
constexpr auto kCombineTail = [](auto&& binding) {
  return AnyBufferArgs<5>(std::move(binding))  // y and the handle's four arrays
      .template OptionalArg<ffi::AnyBuffer>()     // bias
      .template Ret<ffi::AnyBuffer>();
};
constexpr auto kExpertMajorCachedDispatchTail = [](auto&& binding) {
  return AnyBufferArgs<5>(std::move(binding))  // x, pair_row, recv_src_index, rows_end, is_token_in_rank
      .template Ret<ffi::AnyBuffer>();            // recv_x
};
constexpr auto kExpertMajorCombineTail = [](auto&& binding) {
  return AnyBufferArgs<5>(std::move(binding))  // y, pair_row, is_token_in_rank, the relay part
      .RemainingArgs()                            // [weights], [bias]
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("weighted");
};
constexpr auto kExpertMajorCombineBackwardTail = [](auto&& binding) {
  return AnyBufferArgs<6>(std::move(binding))  // d_out, y, pair_row, recv_src_index, rows_end, is_token_in_rank
      .RemainingArgs()                            // [weights]
      .template Ret<ffi::AnyBuffer>()             // d_y
      .template OptionalRet<ffi::AnyBuffer>()     // [d_weights]
      .template Attr<int64_t>("weighted");
};

}  // namespace

JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeDispatch, InternodeCall, "internode dispatch",
                              (DispatchBody<InternodeCall, InternodeDispatchArgs>(Dispatch)), kDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeCachedDispatch, InternodeCall, "internode cached dispatch", CachedDispatch,
                              kCachedDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeCombine, InternodeCall, "internode combine", Combine, kCombineTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeExpertMajorDispatch, InternodeCall, "internode expert-major dispatch",
                              ExpertMajorDispatch, kDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeExpertMajorCachedDispatch, InternodeCall,
                              "internode expert-major cached dispatch", ExpertMajorCachedDispatch,
                              kExpertMajorCachedDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeExpertMajorCombine, InternodeCall, "internode expert-major combine",
                              ExpertMajorCombine, kExpertMajorCombineTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(InternodeExpertMajorCombineBackward, InternodeCall,
                              "internode expert-major combine backward", ExpertMajorCombineBackward,
                              kExpertMajorCombineBackwardTail);

}  // namespace jax_ep::ffi_handlers
