// The nanobind module jax_ep._C: FFI handler capsules per (target, platform) and build facts.
#include <nanobind/nanobind.h>

#include "handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

nb::dict Registrations() {
  using namespace jax_ep::ffi_handlers;
  nb::dict layout;
  layout["cpu"] = Capsule(LayoutCpu);
#if defined(JAX_EP_WITH_CUDA)
  layout["CUDA"] = Capsule(LayoutCuda);
#endif
  nb::dict targets;
  targets["jax_ep_layout"] = layout;
  return targets;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native extension: XLA FFI handlers and the device runtime";
  m.def("registrations", &Registrations, "{target name: {platform: FFI handler capsule}}");
#if defined(JAX_EP_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
#if defined(JAX_EP_WITH_NVSHMEM)
  m.attr("with_nvshmem") = true;
#else
  m.attr("with_nvshmem") = false;
#endif
}
