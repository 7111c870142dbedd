// CUDA XLA FFI handlers of the intranode normal mode (groups in one process or across processes), in the normal-mode
// frame of handlers.h: decode buffers and attributes, call csrc/api.h. Command-buffer compatible: under graph replay
// only the kernels run, and they keep their own state.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "api.h"
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

// ---- expert-major ops (api.h: ExpertMajorDispatchArgs and the two below) -----------------------------------------

// args: x payloads (num_payloads), topk_idx [T, K], [topk_weights [T, K]]; rets: recv payloads, [recv_weights],
// group_sizes [L], group_offsets [L], num_kept, num_dropped, invalid_ids, rows_needed, recv_src_index [C],
// is_token_in_rank [T, R], pair_row [R*T, min(K, L)], topk_row [R*T, K], rows_end [1], block_counts (scratch [rows, E]).
ffi::Error ExpertMajorDispatch(const char* op, const IntranodeCall& call, ffi::RemainingArgs remaining_args,
                               ffi::RemainingRets remaining_rets, int64_t num_payloads, int64_t num_experts,
                               int64_t expert_alignment) {
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  if (num_payloads < 1 || num_payloads > 2) return Invalid(op, "num_payloads must be 1 or 2");
  const size_t payloads = static_cast<size_t>(num_payloads);
  if (args.size() != payloads + 1 && args.size() != payloads + 2) return Invalid(op, "wrong number of operands");
  const bool has_weights = args.size() == payloads + 2;
  if (rets.size() != payloads + (has_weights ? 13 : 12)) return Invalid(op, "wrong number of results");
  const int ranks = call.group.num_ranks;
  const ffi::AnyBuffer& topk_idx = args[payloads];
  const auto idx_dims = topk_idx.dimensions();
  if (topk_idx.element_type() != ffi::DataType::S32 || idx_dims.size() != 2 || idx_dims[1] < 1 ||
      idx_dims[1] > kNormalMaxTopk)
    return Invalid(op, "topk_idx must be int32 [num_tokens, 1 to " + std::to_string(kNormalMaxTopk) + "]");
  if (num_experts < ranks || num_experts % ranks || num_experts > kExpertMajorMaxExperts)
    return Invalid(op, "num_experts must be a multiple of the ranks, at most " +
                           std::to_string(kExpertMajorMaxExperts));
  if (expert_alignment < 1) return Invalid(op, "expert_alignment must be positive");
  ExpertMajorDispatchArgs a;
  a.num_payloads = static_cast<int32_t>(payloads);
  a.num_tokens = idx_dims[0];
  a.num_topk = idx_dims[1];
  a.num_experts = num_experts;
  a.capacity = LeadingDim(rets[0]);
  a.expert_alignment = expert_alignment;
  for (size_t p = 0; p < payloads; ++p) {
    if (LeadingDim(args[p]) != a.num_tokens || LeadingDim(rets[p]) != a.capacity || RowBytes(args[p]) != RowBytes(rets[p]))
      return Invalid(op, "payload shapes disagree with topk_idx or the capacity");
    a.x[p] = args[p].untyped_data();
    a.x_row_bytes[p] = RowBytes(args[p]);
    a.recv_x[p] = rets[p].untyped_data();
  }
  a.topk_idx = DataOf<int32_t>(topk_idx);
  size_t i = payloads;
  if (has_weights) {
    if (!IsMatrix(args[payloads + 1], ffi::DataType::F32, a.num_tokens, a.num_topk) ||
        !IsVector(rets[i], ffi::DataType::F32, a.capacity))
      return Invalid(op, "topk_weights must be float32 like topk_idx, recv_weights float32 [capacity]");
    a.topk_weights = DataOf<float>(args[payloads + 1]);
    a.recv_weights = MutableDataOf<float>(rets[i++]);
  }
  const int64_t local = num_experts / ranks, items = ranks * a.num_tokens;
  const int64_t pair_columns = std::min<int64_t>(a.num_topk, local);
  const struct {
    int32_t** out;
    int64_t size;
  } int_results[] = {{&a.group_sizes, local}, {&a.group_offsets, local}, {&a.num_kept, 1},   {&a.num_dropped, 1},
                     {&a.invalid_ids, 1},     {&a.rows_needed, 1},     {&a.recv_src_index, a.capacity}};
  for (const auto& result : int_results) {
    if (rets[i].element_type() != ffi::DataType::S32 || static_cast<int64_t>(rets[i].element_count()) != result.size)
      return Invalid(op, "result " + std::to_string(i) + " must be int32 of " + std::to_string(result.size));
    *result.out = MutableDataOf<int32_t>(rets[i++]);
  }
  if (!IsMatrix(rets[i], ffi::DataType::PRED, a.num_tokens, ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a.is_token_in_rank = MutableDataOf<bool>(rets[i++]);
  if (!IsMatrix(rets[i], ffi::DataType::S32, items, pair_columns))
    return Invalid(op, "pair_row must be int32 [num_ranks * num_tokens, min(num_topk, local experts)]");
  a.pair_row = MutableDataOf<int32_t>(rets[i++]);
  if (!IsMatrix(rets[i], ffi::DataType::S32, items, a.num_topk))
    return Invalid(op, "topk_row must be int32 [num_ranks * num_tokens, num_topk]");
  a.topk_row = MutableDataOf<int32_t>(rets[i++]);
  if (rets[i].element_type() != ffi::DataType::S32 || rets[i].element_count() != 1)
    return Invalid(op, "rows_end must be int32 [1]");
  a.rows_end = MutableDataOf<int32_t>(rets[i++]);
  const auto scratch_dims = rets[i].dimensions();
  if (rets[i].element_type() != ffi::DataType::S32 || scratch_dims.size() != 2 || scratch_dims[1] != num_experts)
    return Invalid(op, "block_counts must be int32 [rows, num_experts]");
  a.block_counts = MutableDataOf<int32_t>(rets[i]);
  a.block_count_rows = scratch_dims[0];
  const cudaError_t err = intranode_expert_major_dispatch(call, a);
  if (err == cudaErrorInvalidValue) return Invalid(op, "block_counts must have a row per block of the launch (num_sms)");
  return Launched(op, err, WorkspaceTooSmall);
}

// args: x [T, ...], pair_row [R*T, P], recv_src_index [C], rows_end [1]; ret: recv_x [C, ...]. Decoded into *out.
ffi::Error DecodeExpertMajorCachedDispatch(const char* op, const IntranodeCall& call, ffi::AnyBuffer x,
                                           ffi::AnyBuffer pair_row, ffi::AnyBuffer recv_src_index,
                                           ffi::AnyBuffer rows_end, ffi::Result<ffi::AnyBuffer> recv_x,
                                           ExpertMajorCachedDispatchArgs* out) {
  ExpertMajorCachedDispatchArgs& a = *out;
  a.x = x.untyped_data();
  a.row_bytes = RowBytes(x);
  a.num_tokens = LeadingDim(x);
  a.capacity = LeadingDim(*recv_x);
  const auto pair_dims = pair_row.dimensions();
  if (pair_row.element_type() != ffi::DataType::S32 || pair_dims.size() != 2 ||
      pair_dims[0] != call.group.num_ranks * a.num_tokens)
    return Invalid(op, "pair_row must be int32 [num_ranks * num_tokens, pair columns]");
  a.num_pair_columns = pair_dims[1];
  if (!IsVector(recv_src_index, ffi::DataType::S32, a.capacity) || RowBytes(*recv_x) != a.row_bytes)
    return Invalid(op, "recv_src_index, x and the result disagree in shape");
  if (rows_end.element_type() != ffi::DataType::S32 || rows_end.element_count() != 1)
    return Invalid(op, "rows_end must be int32 [1]");
  a.pair_row = DataOf<int32_t>(pair_row);
  a.recv_src_index = DataOf<int32_t>(recv_src_index);
  a.rows_end = DataOf<int32_t>(rows_end);
  a.recv_x = recv_x->untyped_data();
  return ffi::Error::Success();
}

ffi::Error ExpertMajorCachedDispatch(const char* op, const IntranodeCall& call, ffi::AnyBuffer x, ffi::AnyBuffer pair_row,
                                     ffi::AnyBuffer recv_src_index, ffi::AnyBuffer rows_end,
                                     ffi::Result<ffi::AnyBuffer> recv_x) {
  ExpertMajorCachedDispatchArgs a;
  if (auto err = DecodeExpertMajorCachedDispatch(op, call, x, pair_row, recv_src_index, rows_end, recv_x, &a);
      err.failure())
    return err;
  return Launched(op, intranode_expert_major_cached_dispatch(call, a), WorkspaceTooSmall);
}

// args: d_out [T, ...], y [C, ...], pair_row [R*T, P], recv_src_index [C], rows_end [1], then weights float32 [C]
// when `weighted`; rets: d_y [C, ...] of y's type, then d_weights float32 [C] when `weighted`.
ffi::Error ExpertMajorCombineBackward(const char* op, const IntranodeCall& call, ffi::AnyBuffer d_out,
                                      ffi::AnyBuffer y, ffi::AnyBuffer pair_row, ffi::AnyBuffer recv_src_index,
                                      ffi::AnyBuffer rows_end, ffi::RemainingArgs optional_args,
                                      ffi::Result<ffi::AnyBuffer> d_y,
                                      std::optional<ffi::Result<ffi::AnyBuffer>> d_weights, int64_t weighted) {
  std::vector<ffi::AnyBuffer> optional;
  if (auto err = Collect(optional_args, &optional); err.failure()) return err;
  if (weighted != 0 && weighted != 1) return Invalid(op, "weighted must be 0 or 1");
  if (optional.size() != static_cast<size_t>(weighted) || d_weights.has_value() != (weighted == 1))
    return Invalid(op, "expects d_out, y, pair_row, recv_src_index, rows_end, [weights]; d_y, [d_weights]");
  ExpertMajorCombineBackwardArgs a;
  if (auto err = DecodeExpertMajorCachedDispatch(op, call, d_out, pair_row, recv_src_index, rows_end, d_y, &a.rows);
      err.failure())
    return err;
  if (!AsFloatType(d_out.element_type(), &a.type) || y.element_type() != d_out.element_type() ||
      d_y->element_type() != d_out.element_type() || LeadingDim(y) != a.rows.capacity ||
      RowBytes(y) != a.rows.row_bytes || a.rows.row_bytes % 16 != 0)
    return Invalid(op, "d_out, y and d_y must be float32, bfloat16 or float16 rows of one type and width (whole "
                       "16-byte vectors), y and d_y of capacity rows");
  a.y = y.untyped_data();
  if (weighted) {
    if (!IsVector(optional[0], ffi::DataType::F32, a.rows.capacity) ||
        !IsVector(**d_weights, ffi::DataType::F32, a.rows.capacity))
      return Invalid(op, "weights and d_weights must be float32 [capacity]");
    a.weights = DataOf<float>(optional[0]);
    a.d_weights = MutableDataOf<float>(**d_weights);
  }
  return Launched(op, intranode_expert_major_combine_backward(call, a), WorkspaceTooSmall);
}

// args: y [C, ...], pair_row [R*T, P], is_token_in_rank [T, R], then weights float32 [C] when `weighted`, then the
// bias [T, ...] when given; rets: out [T, ...] of y's type or float32, and in a group of one process the slots
// ((R - 1) * T rows of y's row bytes, any type) where the peers store their partials.
ffi::Error ExpertMajorCombine(const char* op, const IntranodeCall& call, ffi::AnyBuffer y, ffi::AnyBuffer pair_row,
                              ffi::AnyBuffer is_token_in_rank, ffi::RemainingArgs optional_args,
                              ffi::Result<ffi::AnyBuffer> out, std::optional<ffi::Result<ffi::AnyBuffer>> slots,
                              int64_t weighted) {
  std::vector<ffi::AnyBuffer> optional;
  if (auto err = Collect(optional_args, &optional); err.failure()) return err;
  if (weighted != 0 && weighted != 1) return Invalid(op, "weighted must be 0 or 1");
  if (optional.size() < static_cast<size_t>(weighted) || optional.size() > static_cast<size_t>(weighted) + 1)
    return Invalid(op, "expects y, pair_row, is_token_in_rank, [weights], [bias]");
  const std::optional<ffi::AnyBuffer> bias =
      optional.size() > static_cast<size_t>(weighted) ? std::optional<ffi::AnyBuffer>(optional.back()) : std::nullopt;
  const bool with_slots = !call.group.staged && call.group.num_ranks > 1;
  if (slots.has_value() != with_slots)
    return Invalid(op, with_slots ? "in one process expects the result and the slots" : "expects one result");
  ExpertMajorCombineArgs a;
  if (auto err = DecodeCombineOutput(op, y, *out, bias, &a); err.failure()) return err;
  const auto pair_dims = pair_row.dimensions();
  if (pair_row.element_type() != ffi::DataType::S32 || pair_dims.size() != 2 ||
      pair_dims[0] != call.group.num_ranks * a.num_tokens)
    return Invalid(op, "pair_row must be int32 [num_ranks * num_tokens, pair columns]");
  if (!IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.num_tokens, call.group.num_ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a.pair_row = DataOf<int32_t>(pair_row);
  a.num_pair_columns = pair_dims[1];
  a.is_token_in_rank = DataOf<bool>(is_token_in_rank);
  if (weighted) {
    if (!IsVector(optional[0], ffi::DataType::F32, a.capacity)) return Invalid(op, "weights must be float32 [capacity]");
    a.weights = DataOf<float>(optional[0]);
  }
  if (with_slots) {
    const int64_t need = (call.group.num_ranks - 1) * a.num_tokens * RowBytes(y);
    if (static_cast<int64_t>((*slots)->size_bytes()) < need)
      return Invalid(op, "the slots result must hold (num_ranks - 1) * num_tokens rows of y");
    a.slots = (*slots)->untyped_data();
  }
  if (a.num_pair_columns < 1 || a.num_pair_columns > kNormalMaxTopk)
    return Invalid(op, "pair_row must have 1 to " + std::to_string(kNormalMaxTopk) + " columns");
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeDispatch,
                              (NormalDispatchHandler<IntranodeCall, DispatchArgs>("dispatch", Dispatch)),
                              NormalDispatchBinding(), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeCachedDispatch,
                              NormalHandler<IntranodeCall>("cached dispatch", CachedDispatch),
                              NormalBinding()  // x, recv_src_index; recv_x
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeCombine, NormalHandler<IntranodeCall>("combine", Combine),
                              AnyBufferArgs<3>(NormalBinding())  // y, send_row, recv_src_index
                                  .OptionalArg<ffi::AnyBuffer>()    // bias
                                  .Ret<ffi::AnyBuffer>()
                                  .OptionalRet<ffi::AnyBuffer>()    // the slots of a push in one process
                                  .Attr<int64_t>("method")
                                  .Attr<int64_t>("push_warps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeExpertMajorDispatch,
                              NormalHandler<IntranodeCall>("expert-major dispatch", ExpertMajorDispatch),
                              Int64Attrs(NormalBinding().RemainingArgs().RemainingRets(), "num_payloads", "num_experts",
                                         "expert_alignment"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeExpertMajorCachedDispatch,
                              NormalHandler<IntranodeCall>("expert-major cached dispatch", ExpertMajorCachedDispatch),
                              AnyBufferArgs<4>(NormalBinding())  // x, pair_row, recv_src_index, rows_end; recv_x
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeExpertMajorCombine,
                              NormalHandler<IntranodeCall>("expert-major combine", ExpertMajorCombine),
                              AnyBufferArgs<3>(NormalBinding())  // y, pair_row, is_token_in_rank
                                  .RemainingArgs()                  // [weights], [bias]
                                  .Ret<ffi::AnyBuffer>()
                                  .OptionalRet<ffi::AnyBuffer>()    // the slots in one process
                                  .Attr<int64_t>("weighted"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeExpertMajorCombineBackward,
                              NormalHandler<IntranodeCall>("expert-major combine backward", ExpertMajorCombineBackward),
                              AnyBufferArgs<5>(NormalBinding())  // d_out, y, pair_row, recv_src_index, rows_end
                                  .RemainingArgs()                  // [weights]
                                  .Ret<ffi::AnyBuffer>()            // d_y
                                  .OptionalRet<ffi::AnyBuffer>()    // [d_weights]
                                  .Attr<int64_t>("weighted"),
                              {ffi::Traits::kCmdBufferCompatible});

#if defined(JAX_EP_INSTRUMENT)
XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeStoreProbe, NormalHandler<IntranodeCall>("store probe", StoreProbe),
                              NormalBinding().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_ep::ffi_handlers
