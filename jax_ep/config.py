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

    num_sms: SMs the kernels occupy (half send, half receive), as DeepEP's `Config.num_sms`.
    num_max_send_tokens: tokens a sender moves per chunk before publishing its tail.
    num_max_recv_tokens: ring-queue capacity per (channel, source rank), in tokens.
    timeout_s: bound on every spin-wait; a stalled peer raises an error naming the op and rank.
    """

    num_sms: int = 24
    num_max_send_tokens: int = 6
    num_max_recv_tokens: int = 256
    timeout_s: float = 30.0

    def __post_init__(self):
        if self.num_sms < 2 or self.num_sms % 2:
            raise ValueError(f"Config.num_sms must be an even number >= 2, got {self.num_sms}")
        if not 0 < self.num_max_send_tokens <= self.num_max_recv_tokens:
            raise ValueError(
                "Config needs 0 < num_max_send_tokens <= num_max_recv_tokens, got "
                f"{self.num_max_send_tokens} and {self.num_max_recv_tokens}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"Config.timeout_s must be positive, got {self.timeout_s}")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def nvl_buffer_bytes(self, hidden: int, num_ranks: int, hidden_bytes_per_channel: int = 2) -> int:
        """Bytes of the NVLink buffer one rank needs for normal mode at this hidden size: one ring queue of
        `num_max_recv_tokens` rows per (channel, source rank), each row carrying the payload, its FP8 scales,
        top-k ids and weights and the source index, plus head/tail counters."""
        row = hidden * hidden_bytes_per_channel + (hidden // FP8_GROUP) * 4 + 64 * 8 + 16
        return self.num_channels * num_ranks * (self.num_max_recv_tokens * row + 64)


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the low-latency buffer per rank (two buffer sets, each with a BF16 receive region of
    `M` rows per (local expert, source rank) for dispatch and for combine, plus count flags)."""
    experts_per_rank = num_experts // num_ranks
    row = hidden * 2 + (hidden // FP8_GROUP) * 4 + 16
    per_set = 2 * experts_per_rank * num_ranks * num_max_dispatch_tokens_per_rank * row + num_experts * 8
    return 2 * per_set
