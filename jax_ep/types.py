"""Result types of the public ops: named pytrees (NamedTuples) whose fields follow docs/design.md ("Semantics")."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

Array = jax.Array
# A token payload: one array [T, H], or the FP8 pair (x_e4m3 [T, H], scales float32 [T, H/128]).
Payload = Any


class DispatchLayout(NamedTuple):
    num_tokens_per_rank: Array  # int32 [R]: local tokens that go to each rank (once per rank)
    num_tokens_per_expert: Array  # int32 [E]: local tokens that go to each expert (once per expert)
    is_token_in_rank: Array  # bool [T, R]
    invalid_ids: Array  # int32 scalar: top-k entries outside [-1, E), treated as -1


class DispatchResult(NamedTuple):
    recv_x: Payload  # [C, H] (or the FP8 pair), rows ordered by (source rank, source token), zero padding
    recv_topk_idx: Array | None  # int32 [C, K]: local expert ids, -1 where the expert is elsewhere / padding
    recv_topk_weights: Array | None  # float32 [C, K]: the weight where the id is kept, else 0
    num_recv_tokens: Array | None  # int32 scalar: valid rows
    num_recv_tokens_per_expert: Array | None  # int32 [L]: received (token, local expert) pairs, aligned
    num_dropped: Array | None  # int32 scalar: received tokens that did not fit the capacity
    invalid_ids: Array | None  # int32 scalar: this rank's top-k entries outside [-1, E)
    handle: Any  # opaque, backend-specific pytree for combine and cached dispatch


class ExpertMajorDispatchResult(NamedTuple):
    """`dispatch(..., layout="expert_major")` (docs/design.md, "Expert-major layout")."""

    recv_x: Payload  # [C, H] (or the FP8 pair): received (token, local expert) pairs grouped by expert, zero padding
    recv_weights: Array | None  # float32 [C]: each pair's weight (its entries' weights summed), 0 elsewhere
    num_recv_tokens: Array | None  # int32 scalar: kept pairs
    num_recv_tokens_per_expert: Array | None  # int32 [L]: group sizes (pairs rounded up to expert_alignment)
    expert_offsets: Array | None  # int32 [L]: first row of each group
    num_dropped: Array | None  # int32 scalar: pairs past C
    invalid_ids: Array | None  # int32 scalar: this rank's top-k entries outside [-1, E)
    handle: Any  # ExpertMajorHandle, for combine and cached dispatch


class CombineResult(NamedTuple):
    x: Array  # [T, H], dtype of y
    topk_weights: Array | None  # float32 [T, K] when weights were combined


class LowLatencyDispatchResult(NamedTuple):
    recv_x: Payload  # bf16 [L, R*M, H], or (e4m3 [L, R*M, H], scales) with use_fp8
    recv_count: Array  # int32 [L]: valid rows per local expert
    handle: Any  # per-row source token index and per-(expert, source rank) ranges
    cumulative_local_expert_recv_stats: Array | None  # int32 [L] when statistics were passed in
    invalid_ids: Array  # int32 scalar
    num_masked: Array  # int32 scalar: top-k entries not sent, their expert's rank masked (jax_ep.masks); else 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    src_token_index: Array  # int32 [L, R*M]: source token of each row, -1 for unused rows
    layout_range: Array  # int32 [L, R, 2]: (first row, row count) per (local expert, source rank)
    # T of the dispatch (static): its combine must take that many tokens, rows past them were never sent.
    num_tokens: int = dataclasses.field(metadata={"static": True})
