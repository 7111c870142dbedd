// CUDA XLA FFI handlers of the intranode normal mode (groups in one process or across processes), in the normal-mode
// frame of handlers.h: decode buffers and attributes, call csrc/api.h. On XLA's stream command-buffer compatible:
// under graph replay only the kernels run, and they keep their own state; each op's twin runs on a side stream.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "api.h"
#include "expert_major_decode.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {
namespace {

// The launch functions' cudaErrorMemoryAllocation: staged inputs or pushed rows do not fit the workspace.
std::string WorkspaceTooSmall() {
  return "the Buffer's workspace is too small for this call's inputs staged for peers in other processes, or for the "
         "rows they push to it (combine); jax_ep checks this while tracing: create the Buffer with a larger "
         "num_nvl_bytes";
}

// The dispatch's handle results: send_offset (scratch) and send_row.
ffi::Error Dispatch(const char* op, const IntranodeCall& call, DispatchArgs& a,
                    const std::vector<ffi::AnyBuffer>& handle) {
  a.send_offset = MutableDataOf<int32_t>(handle[0]);
  a.send_row = MutableDataOf<int32_t>(handle[1]);
  return Launched(op, intranode_dispatch(call, a), WorkspaceTooSmall);
}

ffi::Error CachedDispatch(const char* op, const IntranodeCall& call, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32> recv_src_index, ffi::Result<ffi::AnyBuffer> recv_x) {
  CachedDispatchArgs a;
  a.x = x.untyped_data();
  a.row_bytes = RowBytes(x);
  a.num_tokens = LeadingDim(x);
  a.capacity = LeadingDim(*recv_x);
  if (recv_src_index.element_count() != static_cast<size_t>(a.capacity) || RowBytes(*recv_x) != a.row_bytes)
    return Invalid(op, "recv_src_index, x and the result disagree in shape");
  a.recv_src_index = recv_src_index.typed_data();
  a.recv_x = recv_x->untyped_data();
  return Launched(op, intranode_cached_dispatch(call, a), WorkspaceTooSmall);
}

// args: y [C, ...], send_row [T, R], recv_src_index [C], [bias [T, ...]]; rets: out [T, ...] of y's type or
// float32, and when pushing in a group of one process the slots ((R - 1) * T rows of y's row bytes, any type):
// scratch where the peers store their rows. method: a CombineMethod; push_warps: 1 to kCombineMaxPushWarps for a
// push, 0 for a pull (CombineArgs::push_warps).
ffi::Error Combine(const char* op, const IntranodeCall& call, ffi::AnyBuffer y, ffi::AnyBuffer send_row,
                   ffi::AnyBuffer recv_src_index, std::optional<ffi::AnyBuffer> bias, ffi::Result<ffi::AnyBuffer> out,
                   std::optional<ffi::Result<ffi::AnyBuffer>> slots, int64_t method, int64_t push_warps) {
  const bool push = method == static_cast<int64_t>(CombineMethod::kPush);
  if (!push && method != static_cast<int64_t>(CombineMethod::kPull))
    return Invalid(op, "unknown combine method " + std::to_string(method));
  if (push ? push_warps < 1 || push_warps > kCombineMaxPushWarps : push_warps != 0)
    return Invalid(op, "push_warps must be 1 to " + std::to_string(kCombineMaxPushWarps) + " for a push, 0 for a pull");
  const bool with_slots = push && !call.group.staged;
  if (slots.has_value() != with_slots)
    return Invalid(op, with_slots ? "the push combine in one process expects the result and the slots"
                                   : "expects one result");
  CombineArgs a;
  if (auto err = DecodeCombineOutput(op, y, *out, bias, &a); err.failure()) return err;
  if (!IsMatrix(send_row, ffi::DataType::S32, a.num_tokens, call.group.num_ranks))
    return Invalid(op, "send_row must be int32 [num_tokens, num_ranks]");
  if (!IsVector(recv_src_index, ffi::DataType::S32, a.capacity))
    return Invalid(op, "recv_src_index must be int32 [capacity]");
  a.send_row = DataOf<int32_t>(send_row);
  a.recv_src_index = DataOf<int32_t>(recv_src_index);
  a.method = static_cast<CombineMethod>(method);
  a.push_warps = static_cast<int32_t>(push_warps);
  if (with_slots) {
    const int64_t need = (call.group.num_ranks - 1) * a.num_tokens * RowBytes(y);
    if (static_cast<int64_t>((*slots)->size_bytes()) < need)
      return Invalid(op, "the slots result must hold (num_ranks - 1) * num_tokens rows of y");
    a.slots = (*slots)->untyped_data();
  }
  const cudaError_t err = intranode_combine(call, a);
  if (err == cudaErrorInvalidValue) return Invalid(op, "the result and bias must have y's dtype or float32");
  return Launched(op, err, WorkspaceTooSmall);
}

// ---- expert-major ops (expert_major_decode.h) ------------------------------------------------------------------

ffi::Error ExpertMajorDispatch(const char* op, const IntranodeCall& call, ffi::RemainingArgs remaining_args,
                               ffi::RemainingRets remaining_rets, int64_t num_payloads, int64_t num_experts,
                               int64_t expert_alignment) {
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  ExpertMajorDispatchArgs a;
  if (auto err = DecodeExpertMajorDispatch(op, call.group.num_ranks, args, rets, 0, num_payloads, num_experts,
                                           expert_alignment, &a);
      err.failure())
    return err;
  const cudaError_t err = intranode_expert_major_dispatch(call, a);
  if (err == cudaErrorInvalidValue) return Invalid(op, kBlockCountsTooFew);
  return Launched(op, err, WorkspaceTooSmall);
}

ffi::Error ExpertMajorCachedDispatch(const char* op, const IntranodeCall& call, ffi::AnyBuffer x, ffi::AnyBuffer pair_row,
                                     ffi::AnyBuffer recv_src_index, ffi::AnyBuffer rows_end,
                                     ffi::Result<ffi::AnyBuffer> recv_x) {
  ExpertMajorCachedDispatchArgs a;
  if (auto err = DecodeExpertMajorCachedDispatch(op, call.group.num_ranks, x, pair_row, recv_src_index, rows_end,
                                                 *recv_x, &a);
      err.failure())
    return err;
  return Launched(op, intranode_expert_major_cached_dispatch(call, a), WorkspaceTooSmall);
}

ffi::Error ExpertMajorCombineBackward(const char* op, const IntranodeCall& call, ffi::AnyBuffer d_out,
                                      ffi::AnyBuffer y, ffi::AnyBuffer pair_row, ffi::AnyBuffer recv_src_index,
                                      ffi::AnyBuffer rows_end, ffi::RemainingArgs optional_args,
                                      ffi::Result<ffi::AnyBuffer> d_y,
                                      std::optional<ffi::Result<ffi::AnyBuffer>> d_weights, int64_t weighted) {
  std::vector<ffi::AnyBuffer> optional;
  if (auto err = Collect(optional_args, &optional); err.failure()) return err;
  ExpertMajorCombineBackwardArgs a;
  if (auto err = DecodeExpertMajorCombineBackward(op, call.group.num_ranks, d_out, y, pair_row, recv_src_index,
                                                  rows_end, optional, *d_y,
                                                  d_weights ? &**d_weights : nullptr, weighted, &a);
      err.failure())
    return err;
  return Launched(op, intranode_expert_major_combine_backward(call, a), WorkspaceTooSmall);
}

// Rets: out, and in a group of one process the slots ((R - 1) * T rows of y's row bytes, any type) where the peers
// store their partials.
ffi::Error ExpertMajorCombine(const char* op, const IntranodeCall& call, ffi::AnyBuffer y, ffi::AnyBuffer pair_row,
                              ffi::AnyBuffer is_token_in_rank, ffi::RemainingArgs optional_args,
                              ffi::Result<ffi::AnyBuffer> out, std::optional<ffi::Result<ffi::AnyBuffer>> slots,
                              int64_t weighted) {
  std::vector<ffi::AnyBuffer> optional;
  if (auto err = Collect(optional_args, &optional); err.failure()) return err;
  const bool with_slots = !call.group.staged && call.group.num_ranks > 1;
  if (slots.has_value() != with_slots)
    return Invalid(op, with_slots ? "in one process expects the result and the slots" : "expects one result");
  ExpertMajorCombineArgs a;
  if (auto err = DecodeExpertMajorCombine(op, call.group.num_ranks, y, pair_row, is_token_in_rank, optional, *out,
                                          weighted, &a);
      err.failure())
    return err;
  if (with_slots) {
    const int64_t need = (call.group.num_ranks - 1) * a.num_tokens * RowBytes(y);
    if (static_cast<int64_t>((*slots)->size_bytes()) < need)
      return Invalid(op, "the slots result must hold (num_ranks - 1) * num_tokens rows of y");
    a.slots = (*slots)->untyped_data();
  }
  const cudaError_t err = intranode_expert_major_combine(call, a);
  if (err == cudaErrorInvalidValue) return Invalid(op, "the result and bias must have y's dtype or float32");
  return Launched(op, err, WorkspaceTooSmall);
}

#if defined(JAX_EP_INSTRUMENT)
// arg: token (any array: orders the call after its producer); ret: out [num_ranks * bytes_per_peer] bytes.
ffi::Error StoreProbe(const char* op, const IntranodeCall& call, ffi::AnyBuffer /*token*/,
                      ffi::Result<ffi::AnyBuffer> out) {
  StoreProbeArgs a;
  a.out = out->untyped_data();
  const int64_t bytes = static_cast<int64_t>(out->size_bytes());
  if (bytes % (16 * call.group.num_ranks) != 0) return Invalid(op, "the result must hold num_ranks * 16k bytes");
  a.bytes_per_peer = bytes / call.group.num_ranks;
  const cudaError_t err = intranode_store_probe(call, a);
  if (err == cudaErrorNotSupported) return Invalid(op, "needs one process driving every GPU of the group");
  return Launched(op, err, WorkspaceTooSmall);
}
#endif

// The tails of the bindings (handlers.h, JAX_EP_DEFINE_NORMAL_HANDLERS).
constexpr auto kCachedDispatchTail = [](auto&& binding) {  // x, recv_src_index; recv_x
  return std::move(binding).template Arg<ffi::AnyBuffer>().template Arg<ffi::Buffer<ffi::S32>>().template Ret<ffi::AnyBuffer>();
};
constexpr auto kCombineTail = [](auto&& binding) {
  return AnyBufferArgs<3>(std::move(binding))  // y, send_row, recv_src_index
      .template OptionalArg<ffi::AnyBuffer>()     // bias
      .template Ret<ffi::AnyBuffer>()
      .template OptionalRet<ffi::AnyBuffer>()     // the slots of a push in one process
      .template Attr<int64_t>("method")
      .template Attr<int64_t>("push_warps");
};
constexpr auto kExpertMajorCachedDispatchTail = [](auto&& binding) {
  return AnyBufferArgs<4>(std::move(binding))  // x, pair_row, recv_src_index, rows_end; recv_x
      .template Ret<ffi::AnyBuffer>();
};
constexpr auto kExpertMajorCombineTail = [](auto&& binding) {
  return AnyBufferArgs<3>(std::move(binding))  // y, pair_row, is_token_in_rank
      .RemainingArgs()                            // [weights], [bias]
      .template Ret<ffi::AnyBuffer>()
      .template OptionalRet<ffi::AnyBuffer>()     // the slots in one process
      .template Attr<int64_t>("weighted");
};
constexpr auto kExpertMajorCombineBackwardTail = [](auto&& binding) {
  return AnyBufferArgs<5>(std::move(binding))  // d_out, y, pair_row, recv_src_index, rows_end
      .RemainingArgs()                            // [weights]
      .template Ret<ffi::AnyBuffer>()             // d_y
      .template OptionalRet<ffi::AnyBuffer>()     // [d_weights]
      .template Attr<int64_t>("weighted");
};

}  // namespace

JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeDispatch, IntranodeCall, "dispatch",
                              (DispatchBody<IntranodeCall, DispatchArgs>(Dispatch)), kDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeCachedDispatch, IntranodeCall, "cached dispatch", CachedDispatch,
                              kCachedDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeCombine, IntranodeCall, "combine", Combine, kCombineTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeExpertMajorDispatch, IntranodeCall, "expert-major dispatch",
                              ExpertMajorDispatch, kDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeExpertMajorCachedDispatch, IntranodeCall, "expert-major cached dispatch",
                              ExpertMajorCachedDispatch, kExpertMajorCachedDispatchTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeExpertMajorCombine, IntranodeCall, "expert-major combine",
                              ExpertMajorCombine, kExpertMajorCombineTail);
JAX_EP_DEFINE_NORMAL_HANDLERS(IntranodeExpertMajorCombineBackward, IntranodeCall, "expert-major combine backward",
                              ExpertMajorCombineBackward, kExpertMajorCombineBackwardTail);

#if defined(JAX_EP_INSTRUMENT)
XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeStoreProbe, NormalHandler<IntranodeCall>("store probe", StoreProbe),
                              NormalBinding().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_ep::ffi_handlers
