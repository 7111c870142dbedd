// CUDA XLA FFI handlers of the intranode normal mode (groups in one process or across processes): decode
// buffers and attributes, find this device's rank by (buffer_id, DeviceOrdinal), call csrc/api.h.
// Command-buffer compatible: under graph replay only the kernels run, and they keep their own state.
#include <string>
#include <vector>

#include "api.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace jax_ep::ffi_handlers {
namespace {

using namespace buffer_args;

ffi::Error Launched(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  if (err == cudaErrorMemoryAllocation)  // the launch functions' answer when staged inputs do not fit
    return Invalid(op, "the Buffer's workspace is too small for this call's inputs staged for peers in other "
                       "processes, or for the rows they push to it (combine); jax_ep checks this while tracing: "
                       "create the Buffer with a larger num_nvl_bytes");
  return LaunchFailed(op, err);
}

ffi::Error MakeCall(const char* op, cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t num_sms,
                    int64_t timeout_ns, IntranodeCall* call) {
  return MakeNormalCall(op, intranode_lookup, "intranode", "with backend='cuda'", stream, device, buffer_id, num_sms,
                        timeout_ns, call);
}

// args: x payloads (num_payloads: 1, or 2 for the FP8 pair), topk_idx, [topk_weights].
// rets: recv payloads, recv_topk_idx, [recv_topk_weights], num_recv_tokens, num_recv_tokens_per_expert,
//       num_dropped, invalid_ids, recv_src_index, is_token_in_rank, send_offset (scratch), send_row.
ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs remaining_args,
                        ffi::RemainingRets remaining_rets, int64_t buffer_id, int64_t num_payloads,
                        int64_t num_experts, int64_t expert_alignment, int64_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "dispatch";
  IntranodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  DispatchArgs a;
  size_t next = 0;
  if (auto err = DecodeDispatch(std::string("jax_ep ") + kOp, args, rets, num_payloads, num_experts, expert_alignment,
                                call.group.num_ranks, /*handle_results=*/2, &a, &next);
      err.failure())
    return err;
  a.send_offset = static_cast<int32_t*>(rets[next++].untyped_data());
  a.send_row = static_cast<int32_t*>(rets[next++].untyped_data());
  return Launched(kOp, intranode_dispatch(call, a));
}

ffi::Error CachedDispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32> recv_src_index, ffi::Result<ffi::AnyBuffer> recv_x,
                              int64_t buffer_id, int64_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "cached dispatch";
  IntranodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  CachedDispatchArgs a;
  a.x = x.untyped_data();
  a.row_bytes = RowBytes(x);
  a.num_tokens = LeadingDim(x);
  a.capacity = LeadingDim(*recv_x);
  if (recv_src_index.element_count() != static_cast<size_t>(a.capacity) || RowBytes(*recv_x) != a.row_bytes)
    return Invalid(kOp, "recv_src_index, x and the result disagree in shape");
  a.recv_src_index = recv_src_index.typed_data();
  a.recv_x = recv_x->untyped_data();
  return Launched(kOp, intranode_cached_dispatch(call, a));
}

// args: y [C, ...], send_row [T, R], recv_src_index [C], [bias [T, ...]]; rets: out [T, ...] of y's type or
// float32, and when pushing in a group of one process the slots ((R - 1) * T rows of y's row bytes, any type):
// scratch where the peers store their rows. push_warps: 0 pulls, 1 to 16 push (CombineArgs::push_warps).
ffi::Error CombineImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs remaining_args,
                       ffi::RemainingRets remaining_rets, int64_t buffer_id, int64_t num_sms, int64_t timeout_ns,
                       int64_t push_warps) {
  constexpr const char* kOp = "combine";
  IntranodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  if (args.size() != 3 && args.size() != 4)
    return Invalid(kOp, "expects y, send_row, recv_src_index and optionally bias");
  if (push_warps < 0 || push_warps > 16) return Invalid(kOp, "push_warps must be 0 (pull) or 1 to 16 (push)");
  const bool with_slots = push_warps > 0 && !call.group.staged;
  if (rets.size() != (with_slots ? 2u : 1u))
    return Invalid(kOp, with_slots ? "the push combine in one process expects the result and the slots"
                                   : "expects one result");
  const ffi::AnyBuffer* out = &rets[0];
  const ffi::AnyBuffer& y = args[0];
  const ffi::AnyBuffer& send_row = args[1];
  const ffi::AnyBuffer& recv_src_index = args[2];
  CombineArgs a;
  if (!AsFloatType(y.element_type(), &a.y_type) || !AsFloatType(out->element_type(), &a.out_type))
    return Invalid(kOp, "y and the result must be float32, bfloat16 or float16");
  a.row_elements = RowElements(y);
  a.capacity = LeadingDim(y);
  a.num_tokens = LeadingDim(*out);
  const auto row_dims = send_row.dimensions();
  if (send_row.element_type() != ffi::DataType::S32 || row_dims.size() != 2 || row_dims[0] != a.num_tokens ||
      row_dims[1] != call.group.num_ranks)
    return Invalid(kOp, "send_row must be int32 [num_tokens, num_ranks]");
  if (RowElements(*out) != a.row_elements)
    return Invalid(kOp, "y and the result differ in row size");
  if (recv_src_index.element_type() != ffi::DataType::S32 || recv_src_index.dimensions().size() != 1 ||
      LeadingDim(recv_src_index) != a.capacity)
    return Invalid(kOp, "recv_src_index must be int32 [capacity]");
  a.y = y.untyped_data();
  a.send_row = static_cast<const int32_t*>(send_row.untyped_data());
  a.recv_src_index = static_cast<const int32_t*>(recv_src_index.untyped_data());
  if (args.size() == 4) {
    if (!DecodeBias(args[3], &a)) return Invalid(kOp, "bias must be floating [num_tokens, ...] like the result");
  }
  a.out = out->untyped_data();
  a.push_warps = static_cast<int32_t>(push_warps);
  if (with_slots) {
    const int64_t need = (call.group.num_ranks - 1) * a.num_tokens * RowBytes(y);
    if (static_cast<int64_t>(rets[1].size_bytes()) < need)
      return Invalid(kOp, "the slots result must hold (num_ranks - 1) * num_tokens rows of y");
    a.slots = rets[1].untyped_data();
  }
  const cudaError_t err = intranode_combine(call, a);
  if (err == cudaErrorInvalidValue) return Invalid(kOp, "the result and bias must have y's dtype or float32");
  return Launched(kOp, err);
}

// arg: token (any array: orders the call after its producer); ret: out [num_ranks * bytes_per_peer] bytes.
ffi::Error StoreProbeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out,
                          int64_t buffer_id, int64_t num_sms, int64_t timeout_ns) {
  constexpr const char* kOp = "store probe";
  (void)token;
  IntranodeCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, num_sms, timeout_ns, &call); err.failure()) return err;
  StoreProbeArgs a;
  a.out = out->untyped_data();
  const int64_t bytes = static_cast<int64_t>(out->size_bytes());
  if (bytes % (16 * call.group.num_ranks) != 0) return Invalid(kOp, "the result must hold num_ranks * 16k bytes");
  a.bytes_per_peer = bytes / call.group.num_ranks;
  const cudaError_t err = intranode_store_probe(call, a);
  if (err == cudaErrorNotSupported) return Invalid(kOp, "needs one process driving every GPU of the group");
  return Launched(kOp, err);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeStoreProbe, StoreProbeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeDispatch, DispatchImpl,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeCachedDispatch, CachedDispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeCombine, CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("push_warps"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
