// The nanobind module jax_ep._C: FFI handler capsules per (target, platform), build facts and the intranode
// runtime entry points (C++ exceptions from the runtime become Python exceptions).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "api.h"
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
#if defined(JAX_EP_WITH_CUDA)
  auto cuda_only = [](nb::capsule handler) {
    nb::dict platforms;
    platforms["CUDA"] = handler;
    return platforms;
  };
  targets["jax_ep_dispatch"] = cuda_only(Capsule(IntranodeDispatch));
  targets["jax_ep_cached_dispatch"] = cuda_only(Capsule(IntranodeCachedDispatch));
  targets["jax_ep_combine"] = cuda_only(Capsule(IntranodeCombine));
#endif
  return targets;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native extension: XLA FFI handlers and the device runtime";
  m.def("registrations", &Registrations, "{target name: {platform: FFI handler capsule}}");
#if defined(JAX_EP_WITH_CUDA)
  m.def("create_intranode", &jax_ep::intranode_create, nb::arg("buffer_id"), nb::arg("device_ordinals"),
        "Allocates one intranode group's state (device_ordinals: CUDA ordinals in EP-rank order) and enables peer "
        "access between its devices.");
  m.def("destroy_intranode", &jax_ep::intranode_destroy, nb::arg("buffer_id"),
        "Waits for and frees every group of buffer_id; returns '' or the CUDA errors met.");
  m.def("intranode_errors", &jax_ep::intranode_errors, nb::arg("buffer_id"),
        "One line per rank of buffer_id whose kernel timed out waiting for a peer (readable after the trap).");
  m.def("intranode_kernel_times", &jax_ep::intranode_kernel_times, nb::arg("buffer_id"), nb::arg("reset") = false,
        "[(calls, summed kernel ns)] per device of buffer_id in rank order since the last reset (benchmark figure).");
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
