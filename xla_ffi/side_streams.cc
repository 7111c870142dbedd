// jax_ep's side streams (handlers.h, "side streams"; docs/design.md, "Side streams"): a few non-blocking streams per
// CUDA device with two events each, and the join target that makes XLA's stream wait for one.
#include <array>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {
namespace {

ffi::Error CudaFailed(const std::string& op, const char* call, cudaError_t err) {
  return ffi::Error::Internal("jax_ep " + op + ": " + call + " failed: " + cudaGetErrorName(err) + " (" +
                              cudaGetErrorString(err) + ")");
}

// Created on `device` (made current for the calls, then restored: XLA does not say which device is current when it
// calls a handler).
ffi::Error CreateSideStream(const std::string& op, int device, SideStream* out) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return CudaFailed(op, "cudaGetDevice", err);
  if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return CudaFailed(op, "cudaSetDevice", err);
  const char* failed = "cudaStreamCreateWithFlags";
  err = cudaStreamCreateWithFlags(&out->stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    failed = "cudaEventCreateWithFlags";
    err = cudaEventCreateWithFlags(&out->xla_ready, cudaEventDisableTiming);
  }
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&out->done, cudaEventDisableTiming);
  if (err != cudaSuccess) {  // nothing half made is kept: what was created goes
    if (out->xla_ready) cudaEventDestroy(out->xla_ready);
    if (out->stream) cudaStreamDestroy(out->stream);
    *out = SideStream{};
  }
  const cudaError_t restored = previous != device ? cudaSetDevice(previous) : cudaSuccess;
  if (err != cudaSuccess) return CudaFailed(op, failed, err);
  if (restored != cudaSuccess) return CudaFailed(op, "cudaSetDevice", restored);
  return ffi::Error::Success();
}

// Error-checked CUDA call inside a function returning ffi::Error.
#define JAX_EP_SIDE_STREAM_CHECK(op, call)                                  \
  do {                                                                      \
    const cudaError_t side_stream_err_ = (call);                            \
    if (side_stream_err_ != cudaSuccess) return CudaFailed(op, #call, side_stream_err_); \
  } while (0)

// Refuses when XLA's stream is being captured (an XLA command buffer): a capture cannot end while a stream it forked
// still runs, nor wait for one outside it. The side-stream targets are registered without the command-buffer trait,
// so XLA runs them outside its graphs; this catches any other capture.
ffi::Error RefuseCapture(const std::string& op, cudaStream_t xla_stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAX_EP_SIDE_STREAM_CHECK(op, cudaStreamIsCapturing(xla_stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return Invalid(op, "runs on a jax_ep side stream, which a CUDA graph capture (an XLA command buffer) cannot "
                       "hold; call the op on XLA's stream inside captured programs");
  return ffi::Error::Success();
}

// args: the arrays to return (as the results, which alias them), then any arrays to keep alive until here (the
// started ops' inputs, which their kernels may still read); attribute side_stream: which side stream to wait for.
ffi::Error Join(cudaStream_t stream, int32_t device, int64_t side_stream, ffi::RemainingArgs remaining_args,
                ffi::RemainingRets remaining_rets) {
  const std::string op = "side stream join";
  std::vector<ffi::AnyBuffer> args, rets;
  if (auto err = Collect(remaining_args, &args); err.failure()) return err;
  if (auto err = Collect(remaining_rets, &rets); err.failure()) return err;
  if (rets.size() > args.size()) return Invalid(op, "more results than operands");
  SideStream side;
  if (auto err = RefuseCapture(op, stream); err.failure()) return err;
  if (auto err = FindSideStream(op, device, side_stream, &side); err.failure()) return err;
  JAX_EP_SIDE_STREAM_CHECK(op, cudaStreamWaitEvent(stream, side.done, 0));
  for (size_t i = 0; i < rets.size(); ++i) {
    if (rets[i].size_bytes() != args[i].size_bytes() || rets[i].element_type() != args[i].element_type())
      return Invalid(op, "result " + std::to_string(i) + " must be operand " + std::to_string(i) + "'s array");
    if (rets[i].untyped_data() != args[i].untyped_data())  // not aliased (jax_ep asks XLA to): a copy, in order
      JAX_EP_SIDE_STREAM_CHECK(op, cudaMemcpyAsync(rets[i].untyped_data(), args[i].untyped_data(),
                                                   args[i].size_bytes(), cudaMemcpyDeviceToDevice, stream));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error FindSideStream(const std::string& op, int device, int64_t index, SideStream* out) {
  if (index < 1 || index > kMaxSideStreams)
    return Invalid(op, "side_stream must be 1 to " + std::to_string(kMaxSideStreams) + ", got " +
                           std::to_string(index));
  static std::mutex mutex;
  static auto* streams = new std::map<std::pair<int, int64_t>, SideStream>();  // never freed: process lifetime
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams->find({device, index});
  if (it == streams->end()) {
    SideStream created;
    if (auto err = CreateSideStream(op, device, &created); err.failure()) return err;
    created.in_order = new std::mutex();  // never freed: process lifetime, as the stream
    it = streams->emplace(std::make_pair(device, index), created).first;
  }
  *out = it->second;
  return ffi::Error::Success();
}

ffi::Error EnterSideStream(const std::string& op, cudaStream_t xla_stream, const SideStream& side) {
  if (auto err = RefuseCapture(op, xla_stream); err.failure()) return err;
  JAX_EP_SIDE_STREAM_CHECK(op, cudaEventRecord(side.xla_ready, xla_stream));
  JAX_EP_SIDE_STREAM_CHECK(op, cudaStreamWaitEvent(side.stream, side.xla_ready, 0));
  return ffi::Error::Success();
}

ffi::Error LeaveSideStream(const std::string& op, const SideStream& side) {
  JAX_EP_SIDE_STREAM_CHECK(op, cudaEventRecord(side.done, side.stream));
  return ffi::Error::Success();
}

// Not command-buffer compatible: a capture could not hold the wait for a stream outside it.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SideStreamJoin, Join,
                              CudaBinding().Attr<int64_t>("side_stream").RemainingArgs().RemainingRets());

}  // namespace jax_ep::ffi_handlers
