"""NVSHMEM for jax_ep, one PE per process (docs/design.md, "Transports"): bootstrapped from a unique id that process 0
creates and the `jax.distributed` key-value store carries to every process. jax_ep owns NVSHMEM in the
process: keep XLA's experimental NVSHMEM flag (`--xla_gpu_experimental_enable_nvshmem`) off."""
from __future__ import annotations

import jax

from jax_ep import _native, environment

_UID_KEY = "jax_ep/nvshmem/unique_id"


def available() -> bool:
    return _native.with_nvshmem()


# Room left in NVSHMEM's symmetric heap, when jax_ep sizes it, for NVSHMEM's own allocations.
HEAP_MARGIN = 256 << 20


def initialize(timeout_s: float = 60.0, symmetric_bytes: int | None = None) -> None:
    """Collective over every jax process (each with exactly one local GPU); a no-op once done.

    symmetric_bytes: the symmetric memory per PE that the caller will allocate; NVSHMEM_SYMMETRIC_SIZE becomes that
    plus HEAP_MARGIN (NVSHMEM's own allocations) when the variable is not set (NVSHMEM reads it once, here). Set it
    yourself when several Buffers with symmetric memory live at once."""
    if not available():
        raise RuntimeError("jax_ep: this build has no NVSHMEM (install the cuda12/cuda13 extra and rebuild)")
    if _native._C.nvshmem_is_initialized():
        return
    if symmetric_bytes is not None:
        environment.set_default("NVSHMEM_SYMMETRIC_SIZE", str(int(symmetric_bytes) + HEAP_MARGIN))
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax_ep: NVSHMEM needs jax.distributed.initialize() (one process per GPU)")
    local = jax.local_devices()
    if len(local) != 1 or local[0].platform != "gpu":
        raise RuntimeError(f"jax_ep: NVSHMEM needs exactly one local GPU per process, this process has {local}")
    if jax.process_index() == 0:
        client.key_value_set(_UID_KEY, _native._C.nvshmem_unique_id().hex())
    try:
        unique_id = bytes.fromhex(client.blocking_key_value_get(_UID_KEY, int(timeout_s * 1000)))
    except Exception as e:  # the client raises a runtime error on its deadline
        raise RuntimeError(f"jax_ep: process 0 did not publish the NVSHMEM unique id within {timeout_s} s: {e}") from e
    _native._C.nvshmem_initialize(int(local[0].local_hardware_id), jax.process_index(), jax.process_count(), unique_id)


def ring_check() -> int:
    """Collective transport check: returns the rank of the previous PE when puts work."""
    return _native._C.nvshmem_ring_check()
