"""Tuning and sizing: `Config` for the normal-mode kernels and size hints for `Buffer`."""
from __future__ import annotations

import dataclasses

# FP8 payloads carry one float32 scale per this many channels (ARCHITECTURE.md §3).
FP8_GROUP = 128
# Hidden sizes must be a multiple of this (16-byte rows for bf16 and FP8 scale groups).
HIDDEN_ALIGNMENT = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Kernel tuning for normal-mode dispatch/combine (ignored by the `xla` backend).

    num_sms: SMs (thread blocks, one per SM) each op's kernel occupies, as DeepEP's `Config.num_sms`. Every
        block both reads peers' rows and writes this rank's outputs, so any count works; the kernels pull
        over NVLink and have no chunked ring queues to size.
    timeout_s: bound on every spin-wait; a stalled peer raises an error naming the op and rank.
    """

    num_sms: int = 24
    timeout_s: float = 30.0

    def __post_init__(self):
        if not isinstance(self.num_sms, int) or self.num_sms < 1:
            raise ValueError(f"Config.num_sms must be a positive integer, got {self.num_sms}")
        if self.timeout_s <= 0:
            raise ValueError(f"Config.timeout_s must be positive, got {self.timeout_s}")


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the low-latency buffer per rank (two buffer sets, each with a BF16 receive region of
    `M` rows per (local expert, source rank) for dispatch and for combine, plus count flags)."""
    experts_per_rank = num_experts // num_ranks
    row = hidden * 2 + (hidden // FP8_GROUP) * 4 + 16
    per_set = 2 * experts_per_rank * num_ranks * num_max_dispatch_tokens_per_rank * row + num_experts * 8
    return 2 * per_set
