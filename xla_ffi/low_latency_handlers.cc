// CUDA XLA FFI handlers of the low-latency mode: decode buffers and attributes, find this device's rank and LL
// region by (buffer_id, DeviceOrdinal, transport), check that the region is large enough, call csrc/api.h.
// Command-buffer compatible: the kernels keep their call numbers on the device and the handlers never sync.
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {
namespace {

// The attributes every LL handler takes, after the stream and the device (the Python side's LowLatencyParams).
struct LowLatencyAttrs {
  cudaStream_t stream;
  int32_t device;
  int64_t buffer_id, transport, ll_offset, num_max_tokens, num_experts, timeout_ns, mask_on_timeout;
};

inline auto LowLatencyBinding() {
  return Int64Attrs(CudaBinding(), "buffer_id", "transport", "ll_offset", "num_max_tokens", "num_experts",
                    "timeout_ns", "mask_on_timeout");
}

// The implementation of an LL handler bound by LowLatencyBinding(): body(op, attrs, the op's decoded operands...).
template <typename Body>
auto LowLatencyHandler(const char* op, Body body) {
  return [op, body](cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t transport, int64_t ll_offset,
                    int64_t num_max_tokens, int64_t num_experts, int64_t timeout_ns, int64_t mask_on_timeout,
                    auto... operands) -> ffi::Error {
    const LowLatencyAttrs attrs{stream, device, buffer_id, transport, ll_offset, num_max_tokens, num_experts,
                                timeout_ns, mask_on_timeout};
    return body(op, attrs, std::move(operands)...);
  };
}

// The Buffer's rank on this device and its LL region under the Buffer's transport (call->group, the region's
// pointers), and the region's bytes from ll_offset (available): what every LL handler looks up first.
ffi::Error FindRegion(const char* op, int32_t device, int64_t buffer_id, int64_t transport, int64_t ll_offset,
                      LowLatencyCall* call, int64_t* available) {
  if (transport != static_cast<int64_t>(LowLatencyTransport::kPeerStores) &&
      transport != static_cast<int64_t>(LowLatencyTransport::kNvshmem))
    return Invalid(op, "unknown transport " + std::to_string(transport));
  if (ll_offset < 0 || ll_offset % kLowLatencyAlign)
    return Invalid(op, "the low-latency region offset " + std::to_string(ll_offset) + " is not " +
                           std::to_string(kLowLatencyAlign) + "-byte aligned");
  if (const std::string missing = low_latency_lookup(buffer_id, device, static_cast<LowLatencyTransport>(transport),
                                                     ll_offset, call, available);
      !missing.empty())
    return Invalid(op, missing + " (create the Buffer with backend='cuda' over a mesh holding this device and keep "
                                 "it alive while programs that use it run)");
  return ffi::Error::Success();
}

// The launch of an LL op: FindRegion, then the sizes that region was made for (hidden: from the op's arrays).
ffi::Error MakeCall(const char* op, const LowLatencyAttrs& attrs, int64_t hidden, LowLatencyCall* call) {
  const int64_t ll_offset = attrs.ll_offset, max_tokens = attrs.num_max_tokens;
  const int64_t num_experts = attrs.num_experts;
  int64_t available = 0;
  if (auto err = FindRegion(op, attrs.device, attrs.buffer_id, attrs.transport, ll_offset, call, &available);
      err.failure())
    return err;
  const int num_ranks = call->group.num_ranks;
  if (max_tokens < 1 || hidden < 128 || hidden % 128 || attrs.timeout_ns < 1)
    return Invalid(op, "num_max_tokens, timeout_ns must be positive and hidden a multiple of 128");
  if (num_experts < num_ranks || num_experts % num_ranks || num_experts > kLowLatencyMaxExperts)
    return Invalid(op, "num_experts must be a multiple of the ranks, at most " + std::to_string(kLowLatencyMaxExperts));
  const bool staged_combine = call->transport == LowLatencyTransport::kNvshmem;
  const int64_t needed = LowLatencyLayout(max_tokens, hidden, num_ranks, num_experts, staged_combine).total;
  if (needed > available)
    return Invalid(op, "the low-latency region needs " + std::to_string(needed) + " bytes, the Buffer has " +
                           std::to_string(available) + " at offset " + std::to_string(ll_offset) +
                           ": create the Buffer with num_max_dispatch_tokens_per_rank, hidden and num_experts");
  call->num_max_tokens = max_tokens;
  call->hidden = hidden;
  call->num_experts = num_experts;
  call->timeout_ns = attrs.timeout_ns;
  call->mask_on_timeout = attrs.mask_on_timeout != 0;
  call->stream = attrs.stream;
  return ffi::Error::Success();
}

// The LL launch functions never run out of memory: their region was checked by MakeCall.
std::string NeverTooSmall() { return "the low-latency region is too small"; }

// Shape [L, R*M, width] of the given type.
bool IsExpertRows(const ffi::AnyBuffer& buffer, ffi::DataType type, const LowLatencyCall& call, int64_t width) {
  const auto dims = buffer.dimensions();
  const int64_t ranks = call.group.num_ranks;
  return buffer.element_type() == type && dims.size() == 3 && dims[0] == call.num_experts / ranks &&
         dims[1] == ranks * call.num_max_tokens && dims[2] == width;
}

bool IsPayload(int64_t payload) {
  return payload == static_cast<int64_t>(LowLatencyPayload::kBF16) ||
         payload == static_cast<int64_t>(LowLatencyPayload::kFP8) ||
         payload == static_cast<int64_t>(LowLatencyPayload::kFP8UE8M0);
}
bool IsCompression(int64_t compression) {
  return compression >= 0 && compression < static_cast<int64_t>(std::size(kLowLatencyCompressionNames));
}

ffi::Error DispatchSend(const char* op, const LowLatencyAttrs& attrs, ffi::AnyBuffer x, ffi::AnyBuffer topk_idx,
                        ffi::Result<ffi::AnyBuffer> token, ffi::Result<ffi::AnyBuffer> invalid_ids, int64_t payload,
                        int64_t round_scale) {
  const auto x_dims = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || x_dims.size() != 2) return Invalid(op, "x must be bf16 [T, H]");
  LowLatencyCall call;
  if (auto err = MakeCall(op, attrs, x_dims[1], &call); err.failure()) return err;
  const auto idx_dims = topk_idx.dimensions();
  if (idx_dims.size() != 2 || !IsMatrix(topk_idx, ffi::DataType::S32, x_dims[0], idx_dims[1]) ||
      idx_dims[1] > kLowLatencyMaxTopk || x_dims[0] < 1 || x_dims[0] > call.num_max_tokens ||
      x_dims[0] * idx_dims[1] > kLowLatencyMaxEntries)
    return Invalid(op, "topk_idx must be int32 [T, K] with 1 <= T <= num_max_tokens, K <= " +
                           std::to_string(kLowLatencyMaxTopk) + " and T * K <= " +
                           std::to_string(kLowLatencyMaxEntries));
  if (!IsPayload(payload)) return Invalid(op, "unknown payload");
  if (token->element_type() != ffi::DataType::U32 || invalid_ids->element_count() != 1)
    return Invalid(op, "wrong result shapes");
  LowLatencyDispatchSendArgs a;
  a.x = x.untyped_data();
  a.topk_idx = DataOf<int32_t>(topk_idx);
  a.num_tokens = x_dims[0];
  a.num_topk = idx_dims[1];
  a.payload = static_cast<LowLatencyPayload>(payload);
  a.round_scale = round_scale != 0 || a.payload == LowLatencyPayload::kFP8UE8M0;
  a.invalid_ids = MutableDataOf<int32_t>(*invalid_ids);
  a.token = MutableDataOf<uint32_t>(*token);
  return Launched(op, low_latency_dispatch_send(call, a), NeverTooSmall);
}

// rets: recv_x, [scales], recv_count, src_token_index, src_topk_index, layout_range.
ffi::Error DispatchRecv(const char* op, const LowLatencyAttrs& attrs, ffi::AnyBuffer token, ffi::RemainingRets rets,
                        int64_t hidden, int64_t payload) {
  LowLatencyCall call;
  if (auto err = MakeCall(op, attrs, hidden, &call); err.failure()) return err;
  if (!IsPayload(payload) || token.element_type() != ffi::DataType::U32) return Invalid(op, "bad token or payload");
  const auto kind = static_cast<LowLatencyPayload>(payload);
  const size_t with_scales = kind == LowLatencyPayload::kBF16 ? 0 : 1;
  if (rets.size() != 5 + with_scales) return Invalid(op, "wrong number of results");
  std::vector<ffi::AnyBuffer> outs;
  if (auto err = Collect(rets, &outs); err.failure()) return err;
  const int64_t ranks = call.group.num_ranks, experts_per_rank = call.num_experts / ranks;
  const bool values_ok = kind == LowLatencyPayload::kBF16
                             ? IsExpertRows(outs[0], ffi::DataType::BF16, call, hidden)
                             : IsExpertRows(outs[0], ffi::DataType::F8E4M3FN, call, hidden);
  const bool scales_ok = kind == LowLatencyPayload::kBF16 ||
                         (kind == LowLatencyPayload::kFP8 ? IsExpertRows(outs[1], ffi::DataType::F32, call, hidden / 128)
                                                          : IsExpertRows(outs[1], ffi::DataType::S32, call, hidden / 512));
  const ffi::AnyBuffer* rest = outs.data() + 1 + with_scales;
  const int64_t rows = ranks * call.num_max_tokens;
  if (!values_ok || !scales_ok || rest[0].element_count() != static_cast<size_t>(experts_per_rank) ||
      !IsMatrix(rest[1], ffi::DataType::S32, experts_per_rank, rows) ||
      !IsMatrix(rest[2], ffi::DataType::S32, experts_per_rank, rows) ||
      rest[3].element_count() != static_cast<size_t>(experts_per_rank * ranks * 2))
    return Invalid(op, "wrong result shapes");
  LowLatencyDispatchRecvArgs a;
  a.token = DataOf<uint32_t>(token);
  a.payload = kind;
  a.recv_x = outs[0].untyped_data();
  a.recv_scales = with_scales ? outs[1].untyped_data() : nullptr;
  a.recv_count = MutableDataOf<int32_t>(rest[0]);
  a.src_token_index = MutableDataOf<int32_t>(rest[1]);
  a.src_topk_index = MutableDataOf<int32_t>(rest[2]);
  a.layout_range = MutableDataOf<int32_t>(rest[3]);
  return Launched(op, low_latency_dispatch_recv(call, a), NeverTooSmall);
}

ffi::Error CombineSend(const char* op, const LowLatencyAttrs& attrs, ffi::AnyBuffer y, ffi::AnyBuffer src_token_index,
                       ffi::AnyBuffer src_topk_index, ffi::AnyBuffer layout_range, ffi::Result<ffi::AnyBuffer> token,
                       int64_t compression) {
  const auto y_dims = y.dimensions();
  if (y_dims.size() != 3) return Invalid(op, "y must be bf16 [L, R*M, H]");
  LowLatencyCall call;
  if (auto err = MakeCall(op, attrs, y_dims[2], &call); err.failure()) return err;
  const int64_t ranks = call.group.num_ranks, experts_per_rank = call.num_experts / ranks;
  if (!IsExpertRows(y, ffi::DataType::BF16, call, call.hidden) ||
      !IsMatrix(src_token_index, ffi::DataType::S32, experts_per_rank, ranks * call.num_max_tokens) ||
      !IsMatrix(src_topk_index, ffi::DataType::S32, experts_per_rank, ranks * call.num_max_tokens) ||
      layout_range.element_type() != ffi::DataType::S32 ||
      layout_range.element_count() != static_cast<size_t>(experts_per_rank * ranks * 2) ||
      token->element_type() != ffi::DataType::U32)
    return Invalid(op, "y and the handle must be bf16 [L, R*M, H], int32 [L, R*M] twice and int32 [L, R, 2]");
  LowLatencyCombineSendArgs a;
  a.y = y.untyped_data();
  a.src_token_index = DataOf<int32_t>(src_token_index);
  a.src_topk_index = DataOf<int32_t>(src_topk_index);
  a.layout_range = DataOf<int32_t>(layout_range);
  a.token = MutableDataOf<uint32_t>(*token);
  if (!IsCompression(compression)) return Invalid(op, "unknown compression " + std::to_string(compression));
  a.compression = static_cast<LowLatencyCompression>(compression);
  return Launched(op, low_latency_combine_send(call, a), NeverTooSmall);
}

ffi::Error CombineRecv(const char* op, const LowLatencyAttrs& attrs, ffi::AnyBuffer token, ffi::AnyBuffer topk_idx,
                       ffi::AnyBuffer topk_weights, ffi::Result<ffi::AnyBuffer> out, int64_t compression) {
  const auto out_dims = out->dimensions();
  if (out->element_type() != ffi::DataType::BF16 || out_dims.size() != 2) return Invalid(op, "out must be bf16 [T, H]");
  LowLatencyCall call;
  if (auto err = MakeCall(op, attrs, out_dims[1], &call); err.failure()) return err;
  const auto idx_dims = topk_idx.dimensions();
  if (idx_dims.size() != 2 || !IsMatrix(topk_idx, ffi::DataType::S32, out_dims[0], idx_dims[1]) ||
      !IsMatrix(topk_weights, ffi::DataType::F32, out_dims[0], idx_dims[1]) || idx_dims[1] > kLowLatencyMaxTopk ||
      out_dims[0] > call.num_max_tokens || token.element_type() != ffi::DataType::U32)
    return Invalid(op, "topk_idx / topk_weights must be int32 / float32 [T, K] with T <= num_max_tokens and K <= " +
                           std::to_string(kLowLatencyMaxTopk));
  LowLatencyCombineRecvArgs a;
  a.token = DataOf<uint32_t>(token);
  a.topk_idx = DataOf<int32_t>(topk_idx);
  a.topk_weights = DataOf<float>(topk_weights);
  a.num_tokens = out_dims[0];
  a.num_topk = idx_dims[1];
  a.out = out->untyped_data();
  if (!IsCompression(compression)) return Invalid(op, "unknown compression " + std::to_string(compression));
  a.compression = static_cast<LowLatencyCompression>(compression);
  return Launched(op, low_latency_combine_recv(call, a), NeverTooSmall);
}

// masked [R] int32: this rank's view of its peers (LowLatencyHeader::masked). Reads the header only: no sizes.
ffi::Error Mask(cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t transport, int64_t ll_offset,
                ffi::Result<ffi::AnyBuffer> masked) {
  const char* op = "low_latency_mask";
  LowLatencyCall call;
  int64_t available = 0;
  if (auto err = FindRegion(op, device, buffer_id, transport, ll_offset, &call, &available); err.failure()) return err;
  if (masked->element_type() != ffi::DataType::S32 ||
      masked->element_count() != static_cast<size_t>(call.group.num_ranks))
    return Invalid(op, "masked must be int32 [num_ranks]");
  call.stream = stream;
  return Launched(op, low_latency_read_masks(call, MutableDataOf<int32_t>(*masked)), NeverTooSmall);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyMask, Mask,
                              Int64Attrs(CudaBinding(), "buffer_id", "transport", "ll_offset").Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSend, LowLatencyHandler("low_latency_dispatch (send)", DispatchSend),
                              Int64Attrs(AnyBufferArgs<2>(LowLatencyBinding())  // x, topk_idx
                                             .Ret<ffi::AnyBuffer>()               // token
                                             .Ret<ffi::AnyBuffer>(),              // invalid_ids
                                         "payload", "round_scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecv,
                              LowLatencyHandler("low_latency_dispatch (receive)", DispatchRecv),
                              Int64Attrs(LowLatencyBinding().Arg<ffi::AnyBuffer>().RemainingRets(), "hidden",
                                         "payload"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSend, LowLatencyHandler("low_latency_combine (send)", CombineSend),
                              Int64Attrs(AnyBufferArgs<4>(LowLatencyBinding()).Ret<ffi::AnyBuffer>(), "compression"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecv,
                              LowLatencyHandler("low_latency_combine (receive)", CombineRecv),
                              Int64Attrs(AnyBufferArgs<3>(LowLatencyBinding()).Ret<ffi::AnyBuffer>(), "compression"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
