// CUDA XLA FFI handlers of the internode normal mode (NVSHMEM builds), in the normal-mode frame of handlers.h: decode
// buffers and attributes, call csrc/api.h. Command-buffer compatible: the kernels keep their call numbers in device
// memory and the handlers never synchronise.
#include <optional>
#include <string>
#include <vector>

#include "api.h"
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeDispatch,
                              (NormalDispatchHandler<InternodeCall, InternodeDispatchArgs>("internode dispatch",
                                                                                          Dispatch)),
                              NormalDispatchBinding(), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCachedDispatch,
                              NormalHandler<InternodeCall>("internode cached dispatch", CachedDispatch),
                              AnyBufferArgs<3>(NormalBinding()).Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCombine, NormalHandler<InternodeCall>("internode combine", Combine),
                              AnyBufferArgs<5>(NormalBinding())  // y and the handle's four arrays
                                  .OptionalArg<ffi::AnyBuffer>()    // bias
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
