"""Tuning and sizing: `Config` for the normal-mode kernels and size hints for `Buffer`."""
from __future__ import annotations

import dataclasses

from jax_ep import _native
from jax_ep.masks import ON_TIMEOUT

# FP8 payloads carry one float32 scale per this many channels (docs/design.md, "FP8 payloads").
FP8_GROUP = 128
# Hidden sizes must be a multiple of this (16-byte rows for bf16 and FP8 scale groups).
HIDDEN_ALIGNMENT = 128


# How the intranode combine moves rows (see jax_ep.backends.cuda.intranode): pull (read the peers' rows) or push
# (store rows into the tokens' home ranks).
COMBINE_METHODS = ("push", "pull")
# Warps of each push-combine block that may push: all of the block's warps (csrc/kernel_limits.h). None when the
# extension did not load: then only the xla backend runs, which reads no push_warps, and only their sign is checked.
MAX_PUSH_WARPS = _native.limit("combine_max_push_warps")
# Warps of each push-combine block that push at the start: half of them, since pushing is bound by the SM's NVLink
# stores, which a few warps keep busy, and reducing by each warp's local read latency.
DEFAULT_PUSH_WARPS = 8
# Config.host_timeout_s's default: processes reach a Buffer's creation up to minutes apart (start-up, compilation).
DEFAULT_HOST_TIMEOUT_S = 120.0
# Buffer(low_latency_transport=...): "auto" (peer stores inside the NVLink domain) or "nvshmem".
LOW_LATENCY_TRANSPORTS = ("auto", "nvshmem")


def is_push_warps(value) -> bool:
    """Whether `value` is a valid push_warps: an integer from 1 to MAX_PUSH_WARPS (any positive one when the
    extension did not load: only the xla backend runs then, which reads none)."""
    return isinstance(value, int) and 1 <= value and (MAX_PUSH_WARPS is None or value <= MAX_PUSH_WARPS)


@dataclasses.dataclass(frozen=True)
class Config:
    """Kernel tuning for normal-mode dispatch/combine (ignored by the `xla` backend). Each field changes the
    compiled programs of the Buffer that holds it.

    num_sms: SMs (thread blocks, one per SM) each op's kernel occupies, as DeepEP's `Config.num_sms`. Every
        block both reads peers' rows and writes this rank's outputs, so any count works.
    timeout_s: the kernels' bound on every spin-wait; a stalled peer raises an error naming the op and rank.
    host_timeout_s: the host's bound on each wait for the other processes of a group while a Buffer is created
        or destroyed (they arrive at different times, after start-up and compilation, so it is longer).
    combine: "push", "pull", or None: pull where one process drives the whole EP group (peers read `y` in
        place), push where the group spans processes (pulling would first stage every row of `y`); both give
        the same sums bit for bit. $JAX_EP_COMBINE overrides None (jax_ep.environment).
    push_warps: warps of each push-combine block (1 to 16) that push before they help reduce; None: 8, or
        $JAX_EP_COMBINE_PUSH_WARPS.
    on_timeout: what a low-latency op does when a wait on a peer passes timeout_s: "trap" (the program fails; the
        process must restart) or "mask" (the rank masks that peer and goes on; jax_ep.masks, Buffer.mask_ranks).
        "mask" also makes the low-latency ops honour masks set by hand; Buffer.reset_low_latency lets ranks back
        in. Both backends; the normal-mode ops always trap (docs/design.md, "Masked ranks").
    """

    num_sms: int = 24
    timeout_s: float = 30.0
    host_timeout_s: float = DEFAULT_HOST_TIMEOUT_S
    combine: str | None = None
    push_warps: int | None = None
    on_timeout: str = "trap"

    def __post_init__(self):
        if not isinstance(self.num_sms, int) or self.num_sms < 1:
            raise ValueError(f"Config.num_sms must be a positive integer, got {self.num_sms}")
        for name in ("timeout_s", "host_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Config.{name} must be positive, got {getattr(self, name)}")
        if self.combine not in (None,) + COMBINE_METHODS:
            raise ValueError(f"Config.combine must be one of {COMBINE_METHODS} or None, got {self.combine!r}")
        if self.on_timeout not in ON_TIMEOUT:
            raise ValueError(f"Config.on_timeout must be one of {ON_TIMEOUT}, got {self.on_timeout!r}")
        if self.push_warps is not None and not is_push_warps(self.push_warps):
            raise ValueError(f"Config.push_warps must be an integer from 1 to {MAX_PUSH_WARPS} or None, "
                             f"got {self.push_warps!r}")

    def with_overrides(self, combine: str | None, push_warps: int | None) -> "Config":
        """This Config with the fields it leaves open (None) taken from environment overrides."""
        return dataclasses.replace(self, combine=self.combine or combine, push_warps=self.push_warps or push_warps)


# Top-k entries per token the low-latency CUDA kernels support (csrc/kernel_limits.h): the combine region keeps one
# row per (token, top-k entry).
LOW_LATENCY_MAX_TOPK = _native.limit("low_latency_max_topk")


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int, *,
                             transport: str = "peer_stores") -> int:
    """Bytes of the low-latency region of each rank, computed by the native extension from the layout the kernels
    use (csrc/kernel_limits.h, LowLatencyLayout; csrc/low_latency_state.h says what each part holds). In order: a
    header of call counters and credits; the kernels' trace of their recent calls (for the benchmark); the dispatch
    send's counter per expert (uint64) and the combine send's counter per (local expert, source rank) (uint32); this
    rank's `M` staged rows, each a row header of top-k ids then `2 * hidden` bytes (a BF16 row; FP8 values and
    scales are smaller); then two buffer sets, calls alternating between them, each holding

    - a dispatch flag and a combine flag per expert (uint64);
    - the dispatch index: the source token of each of `M` positions per (local expert, source rank), int32;
    - the dispatch receive slots: `M` rows per source rank (a token crosses to a rank once), `R * M` rows of a
      row header and `2 * hidden` bytes;
    - the combine receive slots: one row of `2 * hidden` bytes per (token, top-k entry), `M * LOW_LATENCY_MAX_TOPK`;

    and with `transport="nvshmem"` (the Buffer's `low_latency_transport`; internode Buffers use it) the combine
    send's staging rows last: `num_experts * M` rows of `2 * hidden` bytes, the copies of y that NVSHMEM puts read
    (network transports read registered memory only). Each array starts aligned; `jax_ep._C.limits()` gives the
    alignment and the fixed sizes."""
    if transport not in ("peer_stores", "nvshmem"):
        raise ValueError(f"jax_ep.low_latency_buffer_bytes: transport must be 'peer_stores' or 'nvshmem', "
                         f"got {transport!r}")
    native = _native.extension("jax_ep.low_latency_buffer_bytes")
    return native.low_latency_region_bytes(int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_ranks),
                                           int(num_experts), transport == "nvshmem")
