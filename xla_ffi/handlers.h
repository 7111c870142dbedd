// The frame of jax_ep's XLA FFI handlers (cpu_handlers.cc, cuda_handlers.cc, intranode_handlers.cc,
// internode_handlers.cc, low_latency_handlers.cc): errors that name the op, the bindings every CUDA handler starts
// with, the normal-mode handler that finds this device's rank, and the decoding of buffers. csrc/api.h is the one
// header of the kernels and runtime that the handlers see. module.cc exports the handler symbols declared last.
#pragma once
#include <optional>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_handlers {

namespace ffi = xla::ffi;

// An op's bad-argument error: "jax_ep <op>: <message>" (op names the mode where it matters, e.g.
// "internode dispatch").
inline ffi::Error Invalid(const std::string& op, const std::string& message) {
  return ffi::Error::InvalidArgument("jax_ep " + op + ": " + message);
}

// The layout handlers' shared argument check (CPU and CUDA).
inline ffi::Error CheckLayoutArgs(const ffi::Buffer<ffi::S32>& topk_idx, int64_t num_experts, int64_t num_ranks) {
  if (topk_idx.dimensions().size() != 2) return Invalid("layout", "topk_idx must be rank 2");
  if (num_ranks <= 0 || num_experts % num_ranks != 0)
    return Invalid("layout", "num_experts must be a positive multiple of num_ranks");
  return ffi::Error::Success();
}

// Int64 attributes appended to a binding by name, in order (jax_ep's call sites send every attribute as np.int64).
// Bindings only move along a chain of calls (their move constructor is private: each is taken by rvalue reference
// and its member calls make the next), so the last name ends the recursion.
template <typename Binding>
auto Int64Attrs(Binding&& binding, const char* name) {
  return std::move(binding).template Attr<int64_t>(name);
}

template <typename Binding, typename... Names>
auto Int64Attrs(Binding&& binding, const char* name, const char* next, Names... names) {
  return Int64Attrs(std::move(binding).template Attr<int64_t>(name), next, names...);
}

// N operands of any type appended to a binding (the handlers check their types and shapes themselves, to name
// what is wrong).
template <size_t N, typename Binding>
auto AnyBufferArgs(Binding&& binding) {
  if constexpr (N == 1)
    return std::move(binding).template Arg<ffi::AnyBuffer>();
  else
    return AnyBufferArgs<N - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
}

// The layout op's signature after a binding's start (CPU: nothing; CUDA: the stream): topk_idx, the attributes
// num_experts and num_ranks, and the results num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank and
// invalid_ids.
template <typename Binding>
auto WithLayoutSignature(Binding binding) {
  return Int64Attrs(std::move(binding).template Arg<ffi::Buffer<ffi::S32>>(), "num_experts", "num_ranks")
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::PRED>>()
      .template Ret<ffi::Buffer<ffi::S32>>();
}

#if defined(JAX_EP_WITH_CUDA)
// The answer to a launch function's error (cudaSuccess: none). Launch functions refuse arguments with
// cudaErrorMemoryAllocation (the Buffer's memory is too small for the call; `too_small()` words why) and
// cudaErrorInvalidValue (outside the kernel's limits); anything else is a failed launch.
template <typename TooSmall>
ffi::Error Launched(const std::string& op, cudaError_t err, TooSmall too_small) {
  if (err == cudaSuccess) return ffi::Error::Success();
  if (err == cudaErrorMemoryAllocation) return Invalid(op, too_small());
  if (err == cudaErrorInvalidValue) return Invalid(op, "arguments outside the kernel's limits");
  return ffi::Error::Internal("jax_ep " + op + ": kernel launch failed: " + cudaGetErrorString(err));
}

// Every CUDA handler's binding starts with this device's stream and its ordinal.
inline auto CudaBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

// ---- normal mode (intranode_handlers.cc, internode_handlers.cc) -----------------------------------------------------

// A normal-mode handler's binding: the stream, the ordinal and the attributes of every normal-mode call; the op's
// operands, results and attributes follow.
inline auto NormalBinding() { return Int64Attrs(CudaBinding(), "buffer_id", "num_sms", "timeout_ns"); }

// This device's rank of a normal-mode Buffer (api.h's lookups, by rank type), and the words for its absence.
inline bool FindRank(int64_t buffer_id, int device, IntranodeRank* rank) {
  return intranode_lookup(buffer_id, device, rank);
}
inline const char* MissingRank(const IntranodeRank&) { return "no intranode state"; }
inline const char* CreatedWith(const IntranodeRank&) { return "with backend='cuda'"; }
#if defined(JAX_EP_WITH_NVSHMEM)
inline bool FindRank(int64_t buffer_id, int device, InternodeRank* rank) {
  return internode_lookup(buffer_id, device, rank);
}
inline const char* MissingRank(const InternodeRank&) { return "no internode state"; }
inline const char* CreatedWith(const InternodeRank&) { return "with ranks_per_node"; }
#endif

// The implementation of a normal-mode handler bound by NormalBinding(): finds this device's rank of the Buffer,
// fills the launch settings (Call: IntranodeCall or InternodeCall), then returns body(op, call, the op's decoded
// operands...). `op` names the op in errors.
template <typename Call, typename Body>
auto NormalHandler(const char* op, Body body) {
  return [op, body](cudaStream_t stream, int32_t device, int64_t buffer_id, int64_t num_sms, int64_t timeout_ns,
                    auto... operands) -> ffi::Error {
    Call call;
    if (!FindRank(buffer_id, device, &call.group))
      return Invalid(op, std::string(MissingRank(call.group)) + " of buffer " + std::to_string(buffer_id) +
                             " on CUDA device " + std::to_string(device) + " (create the Buffer " +
                             CreatedWith(call.group) +
                             " over a mesh holding this device and keep it alive while programs that use it run)");
    if (num_sms < 1 || timeout_ns < 1) return Invalid(op, "num_sms and timeout_ns must be positive");
    call.num_sms = static_cast<int32_t>(num_sms);
    call.timeout_ns = timeout_ns;
    call.stream = stream;
    return body(op, call, std::move(operands)...);
  };
}

// ---- side streams (side_streams.cc; docs/design.md, "Side streams") ---------------------------------------------
// Each normal-mode op has a twin target, `<target>_on_side_stream`, that launches its kernel on one of jax_ep's side
// streams of the device instead of XLA's stream and returns at once; XLA's kernels that follow run beside it until
// the join target makes XLA's stream wait for the side stream. Two events per side stream order them: `xla_ready`
// (recorded on XLA's stream, waited for by the side stream before the launch: the op's inputs are written) and
// `done` (recorded on the side stream after the launch, waited for by XLA's stream in the join).
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t xla_ready = nullptr;
  cudaEvent_t done = nullptr;
  // Held by a twin from its first record to its last: a wait takes an event's latest record, so two host threads
  // launching on one side stream at once could otherwise make one's launch wait for the other's XLA stream.
  std::mutex* in_order = nullptr;
};

// Side stream `index` (1 to kMaxSideStreams) of CUDA device `device`, created at its first use (a non-blocking
// stream, events without timing) and kept for the life of the process.
ffi::Error FindSideStream(const std::string& op, int device, int64_t index, SideStream* out);

// Before a launch on `side` (its in_order lock held): refuses when XLA's stream is being captured (an XLA command
// buffer: a capture cannot end while a stream it forked still runs; the twin targets are registered without the
// command-buffer trait, so XLA runs them outside its graphs), then makes the side stream wait for XLA's stream.
ffi::Error EnterSideStream(const std::string& op, cudaStream_t xla_stream, const SideStream& side);

// After the launch: where the side stream's work ends, for the join.
ffi::Error LeaveSideStream(const std::string& op, const SideStream& side);

// A normal-mode op on a side stream: bound by SideStreamBinding() (NormalBinding's attributes, then `side_stream`),
// the same body as NormalHandler's, its launch on the side stream.
inline auto SideStreamBinding() {
  return Int64Attrs(CudaBinding(), "buffer_id", "num_sms", "timeout_ns", "side_stream");
}

template <typename Call, typename Body>
auto SideStreamHandler(const char* op, Body body) {
  return [op, on_stream = NormalHandler<Call>(op, body)](cudaStream_t stream, int32_t device, int64_t buffer_id,
                                                         int64_t num_sms, int64_t timeout_ns, int64_t side_stream,
                                                         auto... operands) -> ffi::Error {
    SideStream side;
    if (auto err = FindSideStream(op, device, side_stream, &side); err.failure()) return err;
    std::lock_guard<std::mutex> in_order(*side.in_order);
    if (auto err = EnterSideStream(op, stream, side); err.failure()) return err;
    if (auto err = on_stream(side.stream, device, buffer_id, num_sms, timeout_ns, std::move(operands)...);
        err.failure())
      return err;
    return LeaveSideStream(op, side);
  };
}

// Defines the handler symbols of a normal-mode op: `name` on XLA's stream (command-buffer compatible: under graph
// replay only the kernel runs, and it keeps its own state) and `name##OnSideStream`. `tail` adds the op's operands,
// results and attributes to a binding.
#define JAX_EP_DEFINE_NORMAL_HANDLERS(name, Call, op, body, tail)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (NormalHandler<Call>(op, body)), tail(NormalBinding()),              \
                                {ffi::Traits::kCmdBufferCompatible});                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##OnSideStream, (SideStreamHandler<Call>(op, body)), tail(SideStreamBinding()))

// The operands and results every normal-mode dispatch handler decodes alike into the NormalDispatchArgs part of
// its args. args: x payloads (num_payloads: 1, or 2 for the FP8 pair), topk_idx, [topk_weights]; rets: recv
// payloads, recv_topk_idx, [recv_topk_weights], num_recv_tokens, num_recv_tokens_per_expert, num_dropped,
// invalid_ids, recv_src_index, is_token_in_rank, then the mode's `handle_results` handle arrays, which it returns
// in *handle.
ffi::Error DecodeDispatch(const std::string& op, ffi::RemainingArgs remaining_args,
                          ffi::RemainingRets remaining_rets, int64_t num_payloads, int64_t num_experts,
                          int64_t expert_alignment, int num_ranks, size_t handle_results, NormalDispatchArgs* a,
                          std::vector<ffi::AnyBuffer>* handle);

// The dispatch of either mode: its binding's tail, and its body, which decodes what every dispatch has (see
// DecodeDispatch) into Args (DispatchArgs or InternodeDispatchArgs), then returns launch(op, call, a, handle), where
// `handle` holds the mode's two handle results.
inline constexpr auto kDispatchTail = [](auto&& binding) {
  return Int64Attrs(std::move(binding).RemainingArgs().RemainingRets(), "num_payloads", "num_experts",
                    "expert_alignment");
};

template <typename Call, typename Args, typename Launch>
auto DispatchBody(Launch launch) {
  return [launch](const char* op, const Call& call, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t num_payloads, int64_t num_experts, int64_t expert_alignment) {
    Args a;
    std::vector<ffi::AnyBuffer> handle;
    if (auto err = DecodeDispatch(op, args, rets, num_payloads, num_experts, expert_alignment, call.group.num_ranks,
                                  /*handle_results=*/2, &a, &handle);
        err.failure())
      return err;
    return launch(op, call, a, handle);
  };
}

// ---- decoding buffers -----------------------------------------------------------------------------------------------

inline int64_t LeadingDim(const ffi::AnyBuffer& buffer) {
  const auto dims = buffer.dimensions();
  return dims.size() == 0 ? 1 : dims[0];
}

// Bytes of one row: everything after the leading axis.
inline int64_t RowBytes(const ffi::AnyBuffer& buffer) {
  const auto dims = buffer.dimensions();
  int64_t elements = 1;
  for (size_t i = 1; i < dims.size(); ++i) elements *= dims[i];
  return elements * static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
}

// Elements of one row: everything after the leading axis.
inline int64_t RowElements(const ffi::AnyBuffer& buffer) {
  return RowBytes(buffer) / static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
}

inline bool IsMatrix(const ffi::AnyBuffer& buffer, ffi::DataType type, int64_t rows, int64_t cols) {
  const auto dims = buffer.dimensions();
  return buffer.element_type() == type && dims.size() == 2 && dims[0] == rows && dims[1] == cols;
}

inline bool IsVector(const ffi::AnyBuffer& buffer, ffi::DataType type, int64_t size) {
  const auto dims = buffer.dimensions();
  return buffer.element_type() == type && dims.size() == 1 && dims[0] == size;
}

template <typename T>
const T* DataOf(const ffi::AnyBuffer& buffer) {
  return static_cast<const T*>(buffer.untyped_data());
}

template <typename T>
T* MutableDataOf(const ffi::AnyBuffer& buffer) {
  return static_cast<T*>(buffer.untyped_data());
}

// The buffers of a variable operand or result list (the dispatches, whose payloads are one array or the FP8 pair).
template <typename Remaining>
ffi::Error Collect(const Remaining& remaining, std::vector<ffi::AnyBuffer>* out) {
  for (size_t i = 0; i < remaining.size(); ++i) {
    auto buffer = remaining.template get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    if constexpr (std::is_same_v<Remaining, ffi::RemainingRets>)
      out->push_back(**buffer);
    else
      out->push_back(*buffer);
  }
  return ffi::Error::Success();
}

inline bool AsFloatType(ffi::DataType dtype, FloatType* out) {
  switch (dtype) {
    case ffi::DataType::F32: *out = FloatType::kF32; return true;
    case ffi::DataType::BF16: *out = FloatType::kBF16; return true;
    case ffi::DataType::F16: *out = FloatType::kF16; return true;
    default: return false;
  }
}

// The result and the optional bias of both normal-mode combines (Args: CombineArgs or InternodeCombineArgs), once
// y [C, ...] is decoded: out [T, ...] of y's row length and type or float32, bias floating [T, ...] like out.
template <typename Args>
ffi::Error DecodeCombineOutput(const std::string& op, const ffi::AnyBuffer& y, const ffi::AnyBuffer& out,
                               const std::optional<ffi::AnyBuffer>& bias, Args* a) {
  if (!AsFloatType(y.element_type(), &a->y_type) || !AsFloatType(out.element_type(), &a->out_type))
    return Invalid(op, "y and the result must be float32, bfloat16 or float16");
  a->y = y.untyped_data();
  a->row_elements = RowElements(y);
  a->capacity = LeadingDim(y);
  a->num_tokens = LeadingDim(out);
  if (RowElements(out) != a->row_elements) return Invalid(op, "y and the result differ in row size");
  a->out = out.untyped_data();
  if (bias.has_value()) {
    if (!AsFloatType(bias->element_type(), &a->bias_type) || LeadingDim(*bias) != a->num_tokens ||
        RowElements(*bias) != a->row_elements)
      return Invalid(op, "bias must be floating [num_tokens, ...] like the result");
    a->bias = bias->untyped_data();
  }
  return ffi::Error::Success();
}

#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCpu);
#if defined(JAX_EP_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeDispatch);  // intranode_handlers.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorCombineBackward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCachedDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeCombineOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorCachedDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorCombineOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeExpertMajorCombineBackwardOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SideStreamJoin);  // side_streams.cc
#if defined(JAX_EP_INSTRUMENT)
XLA_FFI_DECLARE_HANDLER_SYMBOL(IntranodeStoreProbe);
#endif
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchSend);  // low_latency_handlers.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyCombineRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyMask);
#endif
#if defined(JAX_EP_WITH_NVSHMEM)
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeDispatch);  // internode_handlers.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorCachedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorCombineBackward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeCachedDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeCombineOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorCachedDispatchOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorCombineOnSideStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(InternodeExpertMajorCombineBackwardOnSideStream);
#endif

}  // namespace jax_ep::ffi_handlers
