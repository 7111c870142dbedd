"""Loads the native extension and registers its XLA FFI targets with JAX (once, at import)."""
from __future__ import annotations

import warnings

import jax

try:
    from jax_ep import _C
except ImportError as err:  # pragma: no cover - exercised only on a broken install
    _C = None
    _IMPORT_ERROR = err
    warnings.warn(f"jax_ep: the native extension jax_ep._C did not load ({err}); only the portable xla backend "
                  "runs. Install jax_ep with pip (from a checkout: pip install -e .).", RuntimeWarning, stacklevel=2)
else:
    _IMPORT_ERROR = None

# Platforms (as XLA names them) for which each FFI target has a handler.
_TARGET_PLATFORMS: dict[str, set[str]] = {}


def _register_targets() -> None:
    if _C is None:
        return
    for target, handlers in _C.registrations().items():
        for platform, capsule in handlers.items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform)
            _TARGET_PLATFORMS.setdefault(target, set()).add(platform.lower())


_register_targets()


def available() -> bool:
    """Whether the native extension (jax_ep._C) loaded."""
    return _C is not None


def with_cuda() -> bool:
    """Whether the extension was built with the CUDA kernels."""
    return _C is not None and bool(_C.with_cuda)


def with_nvshmem() -> bool:
    """Whether the extension was built and linked against NVSHMEM."""
    return _C is not None and bool(_C.with_nvshmem)


def with_instrumentation() -> bool:
    """Whether the extension was built with the benchmarks' instrumentation (kernel timers, the low-latency
    kernels' trace, the store probe): CMake option JAX_EP_INSTRUMENT, off by default."""
    return _C is not None and bool(getattr(_C, "with_instrumentation", False))


INSTRUMENTED_BUILD = ("pip install --no-build-isolation -e . "
                      "--config-settings=cmake.define.JAX_EP_INSTRUMENT=ON")


def require_instrumentation(feature: str) -> None:
    """Raises a clear error when a benchmark's instrument is asked for and the build has none."""
    if not with_instrumentation():
        raise RuntimeError(f"jax_ep: {feature} needs a build with the benchmarks' instrumentation; rebuild with "
                           f"`{INSTRUMENTED_BUILD}`")


# The kernels' limits and fixed sizes (csrc/kernel_limits.h), read once from the extension; empty when it did not load.
_LIMITS: dict[str, int] = {} if _C is None else dict(_C.limits())


def limit(name: str) -> int | None:
    """The kernels' limit or fixed size `name` (a key of `_C.limits()`, defined in csrc/kernel_limits.h), or None
    when the extension did not load: then only the xla backend runs, and no code that checks these limits is
    reached."""
    if _C is None:
        return None
    return _LIMITS[name]


# FFI target names and the enums passed as FFI attributes, as the extension defines them (xla_ffi/module.cc).
_TARGET_NAMES: dict[str, str] = {} if _C is None else dict(_C.target_names())
_ENUMS: dict[str, dict[str, int]] = {} if _C is None else {name: dict(members) for name, members in _C.enums().items()}
# The normal-mode targets' twins that run on a jax_ep side stream (xla_ffi/module.cc, kSideStreamKeys).
_SIDE_STREAM_TWINS: dict[str, str] = {} if _C is None else dict(_C.side_stream_twins())
_SIDE_STREAM_TWIN_NAMES = frozenset(_SIDE_STREAM_TWINS.values())


def target(key: str) -> str | None:
    """The FFI target name of `key` (e.g. "dispatch" -> the name XLA knows the intranode dispatch by), or None
    when the extension did not load (then no custom call is built)."""
    if _C is None:
        return None
    return _TARGET_NAMES[key]


def side_stream_twin(target_name: str) -> str:
    """The FFI target that runs normal-mode target `target_name`'s kernel on a jax_ep side stream."""
    return _SIDE_STREAM_TWINS[target_name]


def is_side_stream_twin(target_name: str) -> bool:
    """Whether FFI target `target_name` launches its kernel on a jax_ep side stream."""
    return target_name in _SIDE_STREAM_TWIN_NAMES


def enum(name: str) -> dict[str, int]:
    """{member: value} of the csrc enum `name` passed as an FFI attribute (e.g. "low_latency_payload"); empty
    when the extension did not load."""
    if _C is None:
        return {}
    return _ENUMS[name]


def extension(feature: str):
    """The extension module `_C`, or a clear error naming `feature` when it did not load."""
    if _C is None:
        raise RuntimeError(f"jax_ep: {feature} needs the native extension jax_ep._C, which did not load "
                           f"({_IMPORT_ERROR}); install jax_ep with pip (from a checkout: pip install -e .)")
    return _C


def has_target(target: str, platform: str) -> bool:
    """Whether `target` has a handler for `platform` ("cpu" or "cuda")."""
    return platform.lower() in _TARGET_PLATFORMS.get(target, set())


def require_nvshmem(feature: str) -> None:
    """Raises a clear error when an NVSHMEM feature is asked for and the build has none."""
    if not with_nvshmem():
        raise RuntimeError(
            f"jax_ep: {feature} needs NVSHMEM, but this jax_ep was built without it. Install the NVSHMEM wheel "
            "(pip install 'jax_ep[cuda13]' or '[cuda12]') and rebuild jax_ep with nvcc on the PATH."
        )


def import_error() -> Exception | None:
    return _IMPORT_ERROR
