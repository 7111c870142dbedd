// CUDA XLA FFI handlers of the low-latency mode: decode buffers and attributes, find this device's rank and LL
// region by (buffer_id, DeviceOrdinal, transport), check that the region is large enough, call csrc/api.h.
// Command-buffer compatible: the kernels keep their call numbers on the device and the handlers never sync.
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "handlers.h"
#include "low_latency_state.h"

namespace ffi = xla::ffi;

namespace jax_ep::ffi_handlers {
namespace {

ffi::Error Launched(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  if (err == cudaErrorInvalidValue) return Invalid(op, "arguments outside the kernel's limits");
  return LaunchFailed(op, err);
}

// The attributes every LL handler takes, decoded into a launch: the Buffer's rank on this device, its LL
// region under the Buffer's transport and the sizes that region was made for.
ffi::Error MakeCall(const char* op, cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t transport,
                    int64_t ll_offset, int64_t max_tokens, int64_t hidden, int64_t num_experts, int64_t timeout_ns,
                    LowLatencyCall* call) {
  if (transport != static_cast<int64_t>(LowLatencyTransport::kPeerStores) &&
      transport != static_cast<int64_t>(LowLatencyTransport::kNvshmem))
    return Invalid(op, "unknown transport " + std::to_string(transport));
  if (ll_offset < 0 || ll_offset % kLowLatencyAlign)
    return Invalid(op, "the low-latency region offset " + std::to_string(ll_offset) + " is not " +
                           std::to_string(kLowLatencyAlign) + "-byte aligned");
  int64_t available = 0;
  if (const std::string missing = low_latency_lookup(buffer_id, device, static_cast<LowLatencyTransport>(transport),
                                                     ll_offset, call, &available);
      !missing.empty())
    return Invalid(op, missing + " (create the Buffer with backend='cuda' over a mesh holding this device and keep "
                                 "it alive while programs that use it run)");
  const int num_ranks = call->group.num_ranks;
  if (max_tokens < 1 || hidden < 128 || hidden % 128 || timeout_ns < 1)
    return Invalid(op, "num_max_tokens, timeout_ns must be positive and hidden a multiple of 128");
  if (num_experts < num_ranks || num_experts % num_ranks || num_experts > kLowLatencyMaxExperts)
    return Invalid(op, "num_experts must be a multiple of the ranks, at most " + std::to_string(kLowLatencyMaxExperts));
  const int64_t needed = LowLatencyLayout(max_tokens, hidden, num_ranks, num_experts).total;
  if (needed > available)
    return Invalid(op, "the low-latency region needs " + std::to_string(needed) + " bytes, the Buffer has " +
                           std::to_string(available) + " at offset " + std::to_string(ll_offset) +
                           ": create the Buffer with num_max_dispatch_tokens_per_rank, hidden and num_experts");
  call->num_max_tokens = max_tokens;
  call->hidden = hidden;
  call->num_experts = num_experts;
  call->timeout_ns = timeout_ns;
  call->stream = stream;
  return ffi::Error::Success();
}

using buffer_args::IsMatrix;  // handlers.h

// Shape [L, R*M, width] of the given type.
bool IsExpertRows(const ffi::AnyBuffer& buffer, ffi::DataType type, const LowLatencyCall& call, int64_t width) {
  const auto dims = buffer.dimensions();
  const int64_t ranks = call.group.num_ranks;
  return buffer.element_type() == type && dims.size() == 3 && dims[0] == call.num_experts / ranks &&
         dims[1] == ranks * call.num_max_tokens && dims[2] == width;
}

bool IsPayload(int64_t payload) { return payload >= 0 && payload <= 2; }

ffi::Error DispatchSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer topk_idx,
                            ffi::Result<ffi::AnyBuffer> token, ffi::Result<ffi::AnyBuffer> invalid_ids,
                            int64_t payload, int64_t round_scale, int64_t buffer_id, int64_t transport,
                            int64_t ll_offset, int64_t num_max_tokens, int64_t num_experts, int64_t timeout_ns) {
  constexpr const char* kOp = "low_latency_dispatch (send)";
  const auto x_dims = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || x_dims.size() != 2) return Invalid(kOp, "x must be bf16 [T, H]");
  LowLatencyCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, transport, ll_offset, num_max_tokens, x_dims[1],
                          num_experts, timeout_ns, &call);
      err.failure())
    return err;
  const auto idx_dims = topk_idx.dimensions();
  if (idx_dims.size() != 2 || !IsMatrix(topk_idx, ffi::DataType::S32, x_dims[0], idx_dims[1]) ||
      idx_dims[1] > kLowLatencyMaxTopk || x_dims[0] < 1 || x_dims[0] > num_max_tokens ||
      x_dims[0] * idx_dims[1] > kLowLatencyMaxEntries)
    return Invalid(kOp, "topk_idx must be int32 [T, K] with 1 <= T <= num_max_tokens, K <= " +
                            std::to_string(kLowLatencyMaxTopk) + " and T * K <= " +
                            std::to_string(kLowLatencyMaxEntries));
  if (!IsPayload(payload)) return Invalid(kOp, "unknown payload");
  if (token->element_type() != ffi::DataType::U32 || invalid_ids->element_count() != 1)
    return Invalid(kOp, "wrong result shapes");
  LowLatencyDispatchSendArgs a;
  a.x = x.untyped_data();
  a.topk_idx = static_cast<const int32_t*>(topk_idx.untyped_data());
  a.num_tokens = x_dims[0];
  a.num_topk = idx_dims[1];
  a.payload = static_cast<LowLatencyPayload>(payload);
  a.round_scale = round_scale != 0 || a.payload == LowLatencyPayload::kFP8UE8M0;
  a.invalid_ids = static_cast<int32_t*>(invalid_ids->untyped_data());
  a.token = static_cast<uint32_t*>(token->untyped_data());
  return Launched(kOp, low_latency_dispatch_send(call, a));
}

// rets: recv_x, [scales], recv_count, src_token_index, src_topk_index, layout_range.
ffi::Error DispatchRecvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer token, ffi::RemainingRets rets,
                            int64_t hidden, int64_t payload, int64_t buffer_id, int64_t transport, int64_t ll_offset,
                            int64_t num_max_tokens, int64_t num_experts, int64_t timeout_ns) {
  constexpr const char* kOp = "low_latency_dispatch (receive)";
  LowLatencyCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, transport, ll_offset, num_max_tokens, hidden, num_experts,
                          timeout_ns, &call);
      err.failure())
    return err;
  if (!IsPayload(payload) || token.element_type() != ffi::DataType::U32) return Invalid(kOp, "bad token or payload");
  const auto kind = static_cast<LowLatencyPayload>(payload);
  const size_t with_scales = kind == LowLatencyPayload::kBF16 ? 0 : 1;
  if (rets.size() != 5 + with_scales) return Invalid(kOp, "wrong number of results");
  std::vector<ffi::AnyBuffer> outs;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (!ret.has_value()) return ret.error();
    outs.push_back(**ret);
  }
  const int64_t ranks = call.group.num_ranks, experts_per_rank = num_experts / ranks;
  const bool values_ok = kind == LowLatencyPayload::kBF16
                             ? IsExpertRows(outs[0], ffi::DataType::BF16, call, hidden)
                             : IsExpertRows(outs[0], ffi::DataType::F8E4M3FN, call, hidden);
  const bool scales_ok = kind == LowLatencyPayload::kBF16 ||
                         (kind == LowLatencyPayload::kFP8 ? IsExpertRows(outs[1], ffi::DataType::F32, call, hidden / 128)
                                                          : IsExpertRows(outs[1], ffi::DataType::S32, call, hidden / 512));
  const ffi::AnyBuffer* rest = outs.data() + 1 + with_scales;
  const int64_t rows = ranks * num_max_tokens;
  if (!values_ok || !scales_ok || rest[0].element_count() != static_cast<size_t>(experts_per_rank) ||
      !IsMatrix(rest[1], ffi::DataType::S32, experts_per_rank, rows) ||
      !IsMatrix(rest[2], ffi::DataType::S32, experts_per_rank, rows) ||
      rest[3].element_count() != static_cast<size_t>(experts_per_rank * ranks * 2))
    return Invalid(kOp, "wrong result shapes");
  LowLatencyDispatchRecvArgs a;
  a.token = static_cast<const uint32_t*>(token.untyped_data());
  a.payload = kind;
  a.recv_x = outs[0].untyped_data();
  a.recv_scales = with_scales ? outs[1].untyped_data() : nullptr;
  a.recv_count = static_cast<int32_t*>(rest[0].untyped_data());
  a.src_token_index = static_cast<int32_t*>(rest[1].untyped_data());
  a.src_topk_index = static_cast<int32_t*>(rest[2].untyped_data());
  a.layout_range = static_cast<int32_t*>(rest[3].untyped_data());
  return Launched(kOp, low_latency_dispatch_recv(call, a));
}

ffi::Error CombineSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y, ffi::AnyBuffer src_token_index,
                           ffi::AnyBuffer src_topk_index, ffi::AnyBuffer layout_range,
                           ffi::Result<ffi::AnyBuffer> token, int64_t buffer_id, int64_t transport, int64_t ll_offset,
                           int64_t num_max_tokens, int64_t num_experts, int64_t timeout_ns) {
  constexpr const char* kOp = "low_latency_combine (send)";
  const auto y_dims = y.dimensions();
  if (y_dims.size() != 3) return Invalid(kOp, "y must be bf16 [L, R*M, H]");
  LowLatencyCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, transport, ll_offset, num_max_tokens, y_dims[2],
                          num_experts, timeout_ns, &call);
      err.failure())
    return err;
  const int64_t ranks = call.group.num_ranks, experts_per_rank = num_experts / ranks;
  if (!IsExpertRows(y, ffi::DataType::BF16, call, call.hidden) ||
      !IsMatrix(src_token_index, ffi::DataType::S32, experts_per_rank, ranks * num_max_tokens) ||
      !IsMatrix(src_topk_index, ffi::DataType::S32, experts_per_rank, ranks * num_max_tokens) ||
      layout_range.element_type() != ffi::DataType::S32 ||
      layout_range.element_count() != static_cast<size_t>(experts_per_rank * ranks * 2) ||
      token->element_type() != ffi::DataType::U32)
    return Invalid(kOp, "y and the handle must be bf16 [L, R*M, H], int32 [L, R*M] twice and int32 [L, R, 2]");
  LowLatencyCombineSendArgs a;
  a.y = y.untyped_data();
  a.src_token_index = static_cast<const int32_t*>(src_token_index.untyped_data());
  a.src_topk_index = static_cast<const int32_t*>(src_topk_index.untyped_data());
  a.layout_range = static_cast<const int32_t*>(layout_range.untyped_data());
  a.token = static_cast<uint32_t*>(token->untyped_data());
  return Launched(kOp, low_latency_combine_send(call, a));
}

ffi::Error CombineRecvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer token, ffi::AnyBuffer topk_idx,
                           ffi::AnyBuffer topk_weights, ffi::Result<ffi::AnyBuffer> out, int64_t buffer_id,
                           int64_t transport, int64_t ll_offset, int64_t num_max_tokens, int64_t num_experts,
                           int64_t timeout_ns) {
  constexpr const char* kOp = "low_latency_combine (receive)";
  const auto out_dims = out->dimensions();
  if (out->element_type() != ffi::DataType::BF16 || out_dims.size() != 2) return Invalid(kOp, "out must be bf16 [T, H]");
  LowLatencyCall call;
  if (auto err = MakeCall(kOp, stream, device, buffer_id, transport, ll_offset, num_max_tokens, out_dims[1],
                          num_experts, timeout_ns, &call);
      err.failure())
    return err;
  const auto idx_dims = topk_idx.dimensions();
  if (idx_dims.size() != 2 || !IsMatrix(topk_idx, ffi::DataType::S32, out_dims[0], idx_dims[1]) ||
      !IsMatrix(topk_weights, ffi::DataType::F32, out_dims[0], idx_dims[1]) || idx_dims[1] > kLowLatencyMaxTopk ||
      out_dims[0] > num_max_tokens || token.element_type() != ffi::DataType::U32)
    return Invalid(kOp, "topk_idx / topk_weights must be int32 / float32 [T, K] with T <= num_max_tokens and K <= " +
                            std::to_string(kLowLatencyMaxTopk));
  LowLatencyCombineRecvArgs a;
  a.token = static_cast<const uint32_t*>(token.untyped_data());
  a.topk_idx = static_cast<const int32_t*>(topk_idx.untyped_data());
  a.topk_weights = static_cast<const float*>(topk_weights.untyped_data());
  a.num_tokens = out_dims[0];
  a.num_topk = idx_dims[1];
  a.out = out->untyped_data();
  return Launched(kOp, low_latency_combine_recv(call, a));
}

// Every LL handler: this device's stream and ordinal first, and last the attributes MakeCall decodes.
auto Bound() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

template <typename Binding>
auto WithCallAttrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("buffer_id")
      .template Attr<int64_t>("transport")
      .template Attr<int64_t>("ll_offset")
      .template Attr<int64_t>("num_max_tokens")
      .template Attr<int64_t>("num_experts")
      .template Attr<int64_t>("timeout_ns");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSend, DispatchSendImpl,
                              WithCallAttrs(Bound()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()
                                                .Attr<int64_t>("payload")
                                                .Attr<int64_t>("round_scale")),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecv, DispatchRecvImpl,
                              WithCallAttrs(Bound()
                                                .Arg<ffi::AnyBuffer>()
                                                .RemainingRets()
                                                .Attr<int64_t>("hidden")
                                                .Attr<int64_t>("payload")),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSend, CombineSendImpl,
                              WithCallAttrs(Bound()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecv, CombineRecvImpl,
                              WithCallAttrs(Bound()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi_handlers
