"""The one module of jax_ep that reads or sets the process environment.

Overrides for tests and benchmarks that switch a whole run. They are read when a Buffer is created (never while
tracing, so a compiled program depends on its Buffer alone), and each applies only where the Buffer's own
argument leaves the choice open:

  JAX_EP_COMBINE=push|pull          the intranode combine method, where `Config.combine` is None
  JAX_EP_COMBINE_PUSH_WARPS=1..16   pushing warps per block of the push combine, where `Config.push_warps` is None
  JAX_EP_LL_TRANSPORT=auto|nvshmem  the low-latency transport, where `Buffer(low_latency_transport="auto")`

Besides those: JAX_PLATFORMS (whether the benchmark's workers run on CPU), the environment handed to worker
processes, and defaults for NVSHMEM's and XLA's own variables.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from jax_ep.config import COMBINE_METHODS, LOW_LATENCY_TRANSPORTS, MAX_PUSH_WARPS, is_push_warps

COMBINE = "JAX_EP_COMBINE"
PUSH_WARPS = "JAX_EP_COMBINE_PUSH_WARPS"
LOW_LATENCY_TRANSPORT = "JAX_EP_LL_TRANSPORT"


class Overrides(NamedTuple):
    combine: str | None  # "push" / "pull", or None: no override
    push_warps: int | None
    low_latency_transport: str | None  # "nvshmem", or None ("auto" and unset leave the Buffer's choice)


def overrides(environ=None) -> Overrides:
    """The overrides set in `environ` (default: this process's environment), checked."""
    environ = os.environ if environ is None else environ
    combine = environ.get(COMBINE, "")
    if combine not in ("",) + COMBINE_METHODS:
        raise ValueError(f"jax_ep: ${COMBINE} must be one of {COMBINE_METHODS} or unset, got {combine!r}")
    warps = environ.get(PUSH_WARPS, "")
    if warps and not (warps.isdigit() and is_push_warps(int(warps))):
        raise ValueError(f"jax_ep: ${PUSH_WARPS} must be an integer from 1 to {MAX_PUSH_WARPS} or unset, got {warps!r}")
    transport = environ.get(LOW_LATENCY_TRANSPORT, "")
    if transport not in ("",) + LOW_LATENCY_TRANSPORTS:
        raise ValueError(f"jax_ep.Buffer: ${LOW_LATENCY_TRANSPORT} must be one of {LOW_LATENCY_TRANSPORTS} or unset, "
                         f"got {transport!r}")
    return Overrides(combine or None, int(warps) if warps else None,
                     transport if transport not in ("", "auto") else None)


def runs_on_cpu() -> bool:
    """Whether JAX_PLATFORMS asks for the CPU first."""
    return os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu"


def for_subprocess(**changes: str) -> dict[str, str]:
    """This process's environment with `changes`, for a worker process."""
    return dict(os.environ, **changes)


def set_default(name: str, value: str) -> None:
    """Sets `name` unless the user already did (e.g. NVSHMEM_SYMMETRIC_SIZE before NVSHMEM starts)."""
    os.environ.setdefault(name, value)


def virtual_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices unless XLA_FLAGS already sets a count. Takes effect if JAX has not yet
    started its CPU backend; only the CPU platform reads it, so it is harmless on GPUs."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
