"""The portable `xla` backend: docs/design.md ("Semantics") with `jax.lax` collectives that run on every platform
(CPU has no `ragged_all_to_all`, so tokens travel with dense `all_gather` / `all_to_all`).

Every function here is per rank and runs inside `shard_map` over the EP axis; `XlaBackend` is them behind the
backend interface. It moves about R times the bytes the CUDA kernels move; it is the reference the kernels are
tested against and the fallback elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from jax_ep import fp8, logfmt
from jax_ep._cotangents import zero_cotangent
from jax_ep.backends import Backend, LowLatencyCast
from jax_ep.masks import RankMasks
from jax_ep.types import DispatchLayout, LowLatencyHandle

int32 = jnp.int32


class XlaHandle(NamedTuple):
    """Normal-mode routing of the `xla` backend."""

    recv_src_index: jax.Array  # int32 [C]: source rank * T + source token of each row; R*T for padding rows
    is_token_in_rank: jax.Array  # bool [T, R]: this rank's tokens per destination (also fixes T for combine)


def sanitize_ids(topk_idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Ids outside [-1, E) become -1; returns (ids, number of such entries)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    invalid = jnp.sum((topk_idx != -1) & ~valid, dtype=int32)
    return jnp.where(valid, topk_idx, -1), invalid


def _any_equal(ids: jax.Array, n: int, offset=0) -> jax.Array:
    """bool [..., n]: whether any entry on the last axis of `ids` equals offset + j."""
    return jnp.any(ids[..., :, None] == offset + jnp.arange(n, dtype=ids.dtype), axis=-2)


def gather_rows(table: jax.Array, index: jax.Array, fill=0) -> jax.Array:
    """table[index] where index == len(table) selects a row of `fill`."""
    pad = jnp.full((1, *table.shape[1:]), fill, table.dtype)
    return jnp.concatenate([table, pad])[index]


def _gather_from_all_ranks(x: jax.Array, axis_name: str) -> jax.Array:
    """[T, ...] per rank -> [R*T, ...] ordered by (source rank, source token)."""
    gathered = jax.lax.all_gather(x, axis_name)
    return gathered.reshape(gathered.shape[0] * x.shape[0], *x.shape[1:])


def layout(topk_idx: jax.Array, num_experts: int, num_ranks: int) -> DispatchLayout:
    ids, invalid = sanitize_ids(topk_idx, num_experts)
    token_in_expert = _any_equal(ids, num_experts)  # [T, E]
    is_token_in_rank = token_in_expert.reshape(ids.shape[0], num_ranks, num_experts // num_ranks).any(axis=-1)
    return DispatchLayout(
        num_tokens_per_rank=jnp.sum(is_token_in_rank, axis=0, dtype=int32),
        num_tokens_per_expert=jnp.sum(token_in_expert, axis=0, dtype=int32),
        is_token_in_rank=is_token_in_rank,
        invalid_ids=invalid,
    )


def dispatch(x_leaves, topk_idx, topk_weights, *, axis_name, num_ranks, num_experts, capacity, expert_alignment):
    """Normal dispatch. Returns (recv leaves, recv_topk_idx, recv_topk_weights, num_recv_tokens,
    num_recv_tokens_per_expert, num_dropped, invalid_ids, handle)."""
    num_tokens, num_topk = topk_idx.shape
    experts_per_rank = num_experts // num_ranks
    rank = jax.lax.axis_index(axis_name)
    ids, invalid = sanitize_ids(topk_idx, num_experts)

    ids_all = _gather_from_all_ranks(ids, axis_name)  # [R*T, K]
    kept = (ids_all >= 0) & (ids_all // experts_per_rank == rank)  # entries whose expert is here
    selected = jnp.any(kept, axis=1)
    row = jnp.cumsum(selected, dtype=int32) - 1
    num_needed = jnp.sum(selected, dtype=int32)
    num_recv = jnp.minimum(num_needed, capacity)
    total = num_ranks * num_tokens
    row_of_source = jnp.where(selected & (row < capacity), row, capacity)
    recv_src_index = jnp.full((capacity,), total, int32).at[row_of_source].set(
        jnp.arange(total, dtype=int32), mode="drop"
    )

    recv_leaves = tuple(gather_rows(_gather_from_all_ranks(leaf, axis_name), recv_src_index) for leaf in x_leaves)
    local_ids = jnp.where(kept, ids_all - rank * experts_per_rank, -1)
    recv_topk_idx = gather_rows(local_ids, recv_src_index, fill=-1)
    recv_topk_weights = None
    if topk_weights is not None:
        weights_all = _gather_from_all_ranks(topk_weights, axis_name)
        recv_topk_weights = gather_rows(jnp.where(kept, weights_all, 0.0), recv_src_index)

    per_expert = jnp.sum(_any_equal(recv_topk_idx, experts_per_rank), axis=0, dtype=int32)
    per_expert = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
    # This rank's tokens per destination, from the sanitized ids: ranks only, no per-expert layout needed.
    is_token_in_rank = _any_equal(jnp.where(ids >= 0, ids // experts_per_rank, -1), num_ranks)
    handle = XlaHandle(recv_src_index=recv_src_index, is_token_in_rank=is_token_in_rank)
    return (recv_leaves, recv_topk_idx, recv_topk_weights, num_recv, per_expert, num_needed - num_recv, invalid, handle)


def cached_dispatch(leaf: jax.Array, handle: XlaHandle, *, axis_name) -> jax.Array:
    """Dispatch new data [T, ...] along the routing of `handle` -> [C, ...]."""
    return gather_rows(_gather_from_all_ranks(leaf, axis_name), handle.recv_src_index)


def combine(y: jax.Array, handle: XlaHandle, *, axis_name, num_ranks) -> jax.Array:
    """y [C, ...] -> float32 [T, ...]: each token's rows summed over the ranks that received it, rank order."""
    num_tokens = handle.is_token_in_rank.shape[0]
    total = num_ranks * num_tokens
    slots = jnp.zeros((total + 1, *y.shape[1:]), y.dtype).at[handle.recv_src_index].set(y)  # padding -> slot `total`
    returned = jax.lax.all_to_all(slots[:total].reshape(num_ranks, num_tokens, *y.shape[1:]), axis_name, 0, 0)
    out = jnp.zeros(returned.shape[1:], jnp.float32)
    for r in range(num_ranks):  # fixed rank order: deterministic and equal to the oracle's sum
        out = out + returned[r].astype(jnp.float32)
    return out


# ---- low latency ---------------------------------------------------------------------------------------

def low_latency_dispatch_send(x, topk_idx, *, axis_name, num_experts, use_fp8, round_scale, use_ue8m0):
    """Send half: cast (FP8 or BF16) and move every token to every rank. Returns the pending state. (Entries naming
    the experts of masked ranks come as -1: jax_ep.ops leaves them out.)"""
    ids, invalid = sanitize_ids(topk_idx, num_experts)
    payload = fp8.per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0) if use_fp8 else (x.astype(jnp.bfloat16),)
    gathered = tuple(jax.lax.all_gather(p, axis_name) for p in payload)  # [R, T, ...]
    return gathered, jax.lax.all_gather(ids, axis_name), invalid


def low_latency_dispatch_recv(pending, *, axis_name, num_ranks, num_experts, num_max_tokens, masked=None):
    """Receive half: pack each local expert's rows by (source rank, source token); none from the ranks in
    `masked` (bool [R], this rank's masked ranks (jax_ep.masks), or None). Returns (recv, recv_count, handle,
    invalid_ids)."""
    gathered, ids_all, invalid = pending
    _, num_tokens, _ = ids_all.shape
    experts_per_rank = num_experts // num_ranks
    rank = jax.lax.axis_index(axis_name)
    has = _any_equal(ids_all, experts_per_rank, offset=rank * experts_per_rank)  # [R, T, L]
    if masked is not None:
        has = has & ~masked[:, None, None]
    selected = jnp.moveaxis(has, -1, 0).reshape(experts_per_rank, num_ranks * num_tokens)
    row = jnp.cumsum(selected, axis=1, dtype=int32) - 1
    rows = num_ranks * num_max_tokens
    total = num_ranks * num_tokens
    target = jnp.where(selected, row, rows)
    expert = jnp.arange(experts_per_rank)[:, None]
    src = jnp.full((experts_per_rank, rows), total, int32).at[expert, target].set(
        jnp.broadcast_to(jnp.arange(total, dtype=int32), selected.shape), mode="drop"
    )
    recv = tuple(gather_rows(g.reshape(total, *g.shape[2:]), src) for g in gathered)
    per_source = jnp.sum(has, axis=1, dtype=int32).T  # [L, R]
    begin = jnp.cumsum(per_source, axis=1, dtype=int32) - per_source
    handle = LowLatencyHandle(
        src_token_index=jnp.where(src < total, src % num_tokens, -1),
        layout_range=jnp.stack([begin, per_source], axis=-1),
        num_tokens=num_tokens,
    )
    return recv, jnp.sum(selected, axis=1, dtype=int32), handle, invalid


# The low-latency combine's compressions (`compression=`, beside None): the module of each, whose encode(rows) and
# decode(words, hidden) are its definition. The cuda backend's kernels name the same ones (_C.enums()).
COMBINE_CODECS = {"logfmt": logfmt}


def low_latency_combine_send(y, handle: LowLatencyHandle, num_tokens, *, axis_name, num_ranks, compression=None,
                             masked=None):
    """Send half: return each expert output row to its source rank -> [R, T, L, H] per home rank (with a
    compression: each row encoded by COMBINE_CODECS[compression], e.g. LogFMT's [R, T, L, words_per_row(H)]
    uint32); none to the ranks in `masked` (bool [R], or None)."""
    experts_per_rank, rows, hidden = y.shape
    begin, count = handle.layout_range[..., 0], handle.layout_range[..., 1]
    row = jnp.arange(rows)
    # Source rank of a row: the number of (contiguous, rank-ordered) source ranges that end at or before it.
    src_rank = jnp.sum(row[None, :, None] >= (begin + count)[:, None, :], axis=-1)
    valid = handle.src_token_index >= 0
    if masked is not None:
        valid = valid & ~masked[jnp.minimum(src_rank, num_ranks - 1)]
    slots = num_ranks * num_tokens * experts_per_rank
    slot = jnp.where(valid, (src_rank * num_tokens + handle.src_token_index) * experts_per_rank
                     + jnp.arange(experts_per_rank)[:, None], slots)
    send = jnp.zeros((slots + 1, hidden), y.dtype).at[slot.reshape(-1)].set(y.reshape(experts_per_rank * rows, hidden))
    send = send[:slots].reshape(num_ranks, num_tokens, experts_per_rank, hidden)
    if compression is not None:
        send = COMBINE_CODECS[compression].encode(send)
    return jax.lax.all_to_all(send, axis_name, 0, 0)


def low_latency_combine_recv(returned, topk_idx, topk_weights, *, num_experts):
    """Receive half: out[t] = sum_k w[t,k] * y_{expert k}[row of t], float32 in k order, BF16 out. (Entries naming
    the experts of masked ranks come as -1; a rank that masks this one returned no row: its slots hold zeros.)"""
    _, num_tokens, experts_per_rank, hidden = returned.shape
    ids, _ = sanitize_ids(topk_idx, num_experts)
    tokens = jnp.arange(num_tokens)
    out = jnp.zeros((num_tokens, hidden), jnp.float32)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        e = jnp.where(valid, ids[:, k], 0)
        rows = returned[e // experts_per_rank, tokens, e % experts_per_rank].astype(jnp.float32)
        out = out + jnp.where(valid, topk_weights[:, k], 0.0)[:, None] * rows
    return out.astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _compressed_combine_recv(compression, axis_name, num_ranks, num_experts, returned, y, handle, topk_idx,
                             topk_weights, masked):
    """The receive half of a compressed combine: decodes `returned` (encoded rows of y) and sums. y, the handle
    and the send's mask are there for the gradients, those of the uncompressed combine (the encoding counts as the
    identity; its bit casts would otherwise cut the gradient of y)."""
    decoded = COMBINE_CODECS[compression].decode(returned, y.shape[-1])
    return low_latency_combine_recv(decoded, topk_idx, topk_weights, num_experts=num_experts)


def _compressed_combine_recv_fwd(compression, axis_name, num_ranks, num_experts, returned, y, handle, topk_idx,
                                 topk_weights, masked):
    out = _compressed_combine_recv(compression, axis_name, num_ranks, num_experts, returned, y, handle, topk_idx,
                                   topk_weights, masked)
    return out, (returned, y, handle, topk_idx, topk_weights, masked)


def _compressed_combine_recv_bwd(compression, axis_name, num_ranks, num_experts, residuals, cotangent):
    returned, y, handle, topk_idx, topk_weights, masked = residuals

    def uncompressed(y, topk_weights):
        sent = low_latency_combine_send(y, handle, topk_idx.shape[0], axis_name=axis_name, num_ranks=num_ranks,
                                        masked=masked)
        return low_latency_combine_recv(sent, topk_idx, topk_weights, num_experts=num_experts)

    _, vjp = jax.vjp(uncompressed, y, topk_weights)
    d_y, d_weights = vjp(cotangent)
    return (zero_cotangent(returned), d_y, zero_cotangent(handle), zero_cotangent(topk_idx), d_weights,
            zero_cotangent(masked))


_compressed_combine_recv.defvjp(_compressed_combine_recv_fwd, _compressed_combine_recv_bwd)


# ---- the backend ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class XlaBackend(Backend):
    """The functions above for a Buffer's EP axis."""

    name: ClassVar[str] = "xla"
    axis_name: str
    num_ranks: int
    # The host's copy of each rank's masked peers (jax_ep.masks), which low_latency_mask reads.
    masks: RankMasks = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "masks", RankMasks(self.num_ranks))

    def dispatch(self, x_leaves, topk_idx, topk_weights, *, num_experts, capacity, expert_alignment):
        return dispatch(x_leaves, topk_idx, topk_weights, axis_name=self.axis_name, num_ranks=self.num_ranks,
                        num_experts=num_experts, capacity=capacity, expert_alignment=expert_alignment)

    def all_gather(self, x):
        return _gather_from_all_ranks(x, self.axis_name)

    def cached_dispatch(self, leaf, handle):
        return cached_dispatch(leaf, handle, axis_name=self.axis_name)

    def combine(self, y, handle, *, bias=None, out_dtype=jnp.float32):
        out = combine(y, handle, axis_name=self.axis_name, num_ranks=self.num_ranks)
        return (out if bias is None else out + bias.astype(jnp.float32)).astype(out_dtype)

    def check_low_latency(self, op, *, num_experts):
        pass  # any sizes

    def low_latency_dispatch_send(self, x, topk_idx, *, num_experts, num_max_tokens, cast: LowLatencyCast):
        return low_latency_dispatch_send(x, topk_idx, axis_name=self.axis_name, num_experts=num_experts,
                                         use_fp8=cast.use_fp8, round_scale=cast.round_scale, use_ue8m0=cast.use_ue8m0)

    def low_latency_dispatch_recv(self, state, *, num_experts, num_max_tokens, cast, masked=None):
        return low_latency_dispatch_recv(state, axis_name=self.axis_name, num_ranks=self.num_ranks,
                                         num_experts=num_experts, num_max_tokens=num_max_tokens, masked=masked)

    def low_latency_combine_send(self, y, handle, topk_idx, topk_weights, *, num_experts, num_max_tokens,
                                 compression=None, masked=None):
        returned = low_latency_combine_send(y, handle, topk_idx.shape[0], axis_name=self.axis_name,
                                            num_ranks=self.num_ranks, compression=compression, masked=masked)
        return (returned, topk_idx, topk_weights) + ((y, handle, masked) if compression else ())

    def low_latency_combine_recv(self, state, *, num_experts, num_max_tokens, compression=None):
        if compression is not None:
            returned, topk_idx, topk_weights, y, handle, masked = state
            return _compressed_combine_recv(compression, self.axis_name, self.num_ranks, num_experts, returned, y,
                                            handle, topk_idx, topk_weights, masked)
        returned, topk_idx, topk_weights = state
        return low_latency_combine_recv(returned, topk_idx, topk_weights, num_experts=num_experts)

    def reset_low_latency(self, *, num_max_tokens, hidden, num_experts, resets):
        self.masks.reset()  # the ops keep no other state between calls

    def low_latency_mask(self, op):
        # Read from the host at every run of the compiled program, so that a mask set between calls applies to
        # the next one; a dispatch counts as one more call of its rank (RankMasks.since).
        rank = jax.lax.axis_index(self.axis_name)
        return io_callback(lambda r: self.masks.row(int(r), dispatch=op.startswith("low_latency_dispatch")),
                           jax.ShapeDtypeStruct((self.num_ranks,), jnp.bool_), rank, ordered=False)

    def destroy(self):
        return ""  # no memory of its own

    def errors(self):
        return []  # no bounded waits of its own
