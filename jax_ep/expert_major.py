"""The expert-major layout of the normal dispatch (docs/design.md, "Expert-major layout"), on any backend.

Two paths, chosen once per dispatch by the backend (`Backend.runs_expert_major_kernels`) and recorded in the handle:

- Kernels (the cuda backend's intranode and internode kernels): one launch per op. Dispatch sends each token once
  to each rank (internode: once to each node, relayed inside it) that holds one of its experts and writes it there
  into all of its pair rows; combine sums each received token's pairs into its partial where they are and sends
  one partial per (token, rank) home (internode: summed per node on the way).
- Composed, from what every backend has (the xla backend, more experts than the kernels take): a rank-major dispatch of the top-k alone (a 16-byte dummy row per token, capacity R*T: nothing dropped)
  tells each rank which tokens it receives and their local expert ids; `plan` derives the pair rows from those with
  a few integer passes; the backend's cached dispatch, along a handle whose `recv_src_index` names each row's
  source token, copies every pair's row from its source straight into its row. Combine sums each received token's
  pairs into its partial (one gather pass) and brings the partials home with the backend's rank-major combine
  along the routing dispatch's handle. With one rank nothing moves between ranks: the routing is the rank's own
  top-k, rows move by XLA gathers and the partials are the result.

Both compute the same results (docs/design.md). Every function runs per rank inside `shard_map` over the Buffer's
EP axis; `ops.dispatch` / `ops.combine` check the arguments and call the custom_vjp functions here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ep._cotangents import typed_like, types_of, zero_cotangent
from jax_ep.backends import Backend
from jax_ep.backends.xla import XlaHandle, gather_rows, sanitize_ids

int32 = jnp.int32
# Elements of the dummy row the routing dispatch carries per token (it needs a payload; 16 bytes of float32).
_ROUTING_ROW = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertMajorHandle:
    """Routing of an expert-major dispatch (C rows, P = min(K, L) pairs a token may have on a rank).

    pair_row and topk_row have a row per token the rank may receive: kernels, item s * T + t (source rank s, token
    t); composed, each row of the routing dispatch (R*T rows in (source rank, source token) order)."""

    # recv_src_index [C]: source rank * T + source token of each row, R*T for padding rows; and is_token_in_rank.
    # The internode kernels' handle is an InternodeHandle, whose relay part their combine follows.
    rows: XlaHandle
    pair_row: jax.Array  # int32 [R*T, P]: rows of each received token's pairs, ascending local expert (see below)
    topk_row: jax.Array  # int32 [R*T, K]: row of the pair of each received top-k entry; C for none
    routing: Any = None  # composed with R > 1: the rank-major handle of the routing dispatch (partials go home along it)
    rows_end: jax.Array | None = None  # kernels: int32 [1], min(C, the end of the last group)
    # Which path made it. pair_row's entries past a token's kept pairs: kernels, C for a dropped pair and -1 past the
    # token's pairs (-1 first: the token has no pair here); composed, C.
    by_kernels: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.rows.is_token_in_rank.shape[0]

    @property
    def capacity(self) -> int:
        return self.rows.recv_src_index.shape[0]


class Plan(NamedTuple):
    rows: jax.Array  # int32 [C]: source index of each row (R*T for padding)
    pair_weight: jax.Array | None  # float32 [C]
    group_sizes: jax.Array  # int32 [L]
    group_offsets: jax.Array  # int32 [L]
    num_kept: jax.Array  # int32 scalar
    num_dropped: jax.Array  # int32 scalar
    rows_needed: jax.Array  # int32 scalar: the capacity that would keep every pair (the last pair's row + 1)
    pair_row: jax.Array  # int32 [Cr, P]
    topk_row: jax.Array  # int32 [Cr, K]


def padding_rows(num_local_experts: int, alignment: int) -> int:
    """The most zero rows that padding the L groups to multiples of alignment can add."""
    return num_local_experts * (alignment - 1)


def default_capacity(num_ranks: int, num_tokens: int, num_topk: int, num_local_experts: int, alignment: int) -> int:
    """The rows that never drop: every received token with min(K, L) pairs, every group padded by alignment - 1."""
    return num_ranks * num_tokens * min(num_topk, num_local_experts) + padding_rows(num_local_experts, alignment)


def plan(recv_topk_idx, recv_topk_weights, recv_src_index, *, num_local_experts: int, capacity: int,
         alignment: int, num_sources: int) -> Plan:
    """The pair rows from the routing dispatch's received tokens (rows in (source rank, source token) order; local
    ids, -1 where the expert is elsewhere or the row is padding). num_sources = R*T, the padding source index."""
    num_received, num_topk = recv_topk_idx.shape
    experts = jnp.arange(num_local_experts, dtype=int32)
    names = recv_topk_idx[:, :, None] == experts  # [Cr, K, L]: entry k names local expert j
    present = jnp.any(names, axis=1)  # [Cr, L]: the received token has a pair with expert j
    counts = jnp.sum(present, axis=0, dtype=int32)
    sizes = (counts + alignment - 1) // alignment * alignment
    offsets = jnp.cumsum(sizes, dtype=int32) - sizes
    index_in_group = jnp.cumsum(present, axis=0, dtype=int32) - present  # rows in (source, token) order
    row = offsets + index_in_group
    kept = present & (row < capacity)
    row = jnp.where(kept, row, capacity)  # [Cr, L]; `capacity` = no row (dropped, or no pair)
    row_or_none = jnp.concatenate([row, jnp.full((num_received, 1), capacity, int32)], axis=1)  # column L: none

    local = jnp.where(recv_topk_idx >= 0, recv_topk_idx, num_local_experts)
    topk_row = jnp.take_along_axis(row_or_none, local, axis=1)
    # Each token's distinct local experts ascending, then L (none): sort, blank the repeats, sort again.
    ascending = jnp.sort(local, axis=1)
    repeat = jnp.concatenate([jnp.zeros((num_received, 1), bool), ascending[:, 1:] == ascending[:, :-1]], axis=1)
    distinct = jnp.sort(jnp.where(repeat, num_local_experts, ascending), axis=1)[:, :min(num_topk, num_local_experts)]
    pair_row = jnp.take_along_axis(row_or_none, distinct, axis=1)

    # Scatter indices: the kept rows, and for every other entry an index of its own past the end (dropped).
    flat_row = jnp.where(kept, row, capacity + jnp.arange(row.size, dtype=int32).reshape(row.shape)).reshape(-1)
    rows = jnp.full((capacity,), num_sources, int32).at[flat_row].set(
        jnp.broadcast_to(recv_src_index[:, None], row.shape).reshape(-1), mode="drop", unique_indices=True)
    pair_weight = None
    if recv_topk_weights is not None:
        weight = jnp.zeros(present.shape, jnp.float32)
        for k in range(num_topk):  # top-k order: the sum of a duplicated expert's weights is fixed
            weight = weight + jnp.where(names[:, k], recv_topk_weights[:, k:k + 1], 0.0)
        pair_weight = jnp.zeros((capacity,), jnp.float32).at[flat_row].set(
            weight.reshape(-1), mode="drop", unique_indices=True)
    num_kept = jnp.sum(kept, dtype=int32)
    rows_needed = jnp.max(jnp.where(counts > 0, offsets + counts, 0))
    return Plan(rows, pair_weight, sizes, offsets, num_kept, jnp.sum(present, dtype=int32) - num_kept, rows_needed,
                pair_row, topk_row)


def partial_sums(y, weights, pair_row):
    """float32 [Cr, H]: each received token's pairs, weights[row] * y[row] summed in ascending local expert."""
    total = jnp.zeros((pair_row.shape[0], *y.shape[1:]), jnp.float32)
    for q in range(pair_row.shape[1]):  # row C (no pair) reads zeros
        term = gather_rows(y, pair_row[:, q]).astype(jnp.float32)
        if weights is not None:
            term = gather_rows(weights, pair_row[:, q])[:, None] * term
        total = total + term
    return total


# ---- the ops ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NormalSpec:
    """Static parameters of one normal-mode call, either layout (hashable: a nondiff argument of the custom_vjps
    here and in jax_ep.ops, which imports this module)."""

    backend: Backend  # the Buffer's
    num_ranks: int
    num_experts: int
    capacity: int
    expert_alignment: int
    # Expert-major only: the backend's kernels run it (Backend.runs_expert_major_kernels), else the composed path.
    by_kernels: bool = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch(spec: NormalSpec, x_leaves, topk_idx, topk_weights):
    """Returns (recv leaves, pair weights or None, group sizes, offsets, kept pairs, dropped pairs, invalid ids,
    ExpertMajorHandle, the capacity that would keep every pair)."""
    if spec.by_kernels:
        return spec.backend.expert_major_dispatch(x_leaves, topk_idx, topk_weights, num_experts=spec.num_experts,
                                                  capacity=spec.capacity, expert_alignment=spec.expert_alignment)
    num_tokens = topk_idx.shape[0]
    if spec.num_ranks == 1:  # every token stays: the routing is this rank's own top-k
        recv_idx, invalid = sanitize_ids(topk_idx, spec.num_experts)
        recv_w = None if topk_weights is None else jnp.where(recv_idx >= 0, topk_weights, 0.0)
        recv_src_index = jnp.arange(num_tokens, dtype=int32)
        routing, is_token_in_rank = None, jnp.any(recv_idx >= 0, axis=1, keepdims=True)
    else:
        # zeros_like: the dummy varies over the shard_map axes as topk_idx does, and so do the routing's results.
        dummy = jnp.zeros_like(topk_idx, jnp.float32, shape=(num_tokens, _ROUTING_ROW))
        _, recv_idx, recv_w, _, _, _, invalid, routing = spec.backend.dispatch(
            (dummy,), topk_idx, topk_weights, num_experts=spec.num_experts, capacity=spec.num_ranks * num_tokens,
            expert_alignment=1)
        recv_src_index, is_token_in_rank = routing.recv_src_index, routing.is_token_in_rank
    p = plan(recv_idx, recv_w, recv_src_index, num_local_experts=spec.num_experts // spec.num_ranks,
             capacity=spec.capacity, alignment=spec.expert_alignment, num_sources=spec.num_ranks * num_tokens)
    handle = ExpertMajorHandle(XlaHandle(p.rows, is_token_in_rank), p.pair_row, p.topk_row, routing)
    recv = tuple(_rows(spec.backend, leaf, handle) for leaf in x_leaves)
    return (recv, p.pair_weight, p.group_sizes, p.group_offsets, p.num_kept, p.num_dropped, invalid, handle,
            p.rows_needed)


def _rows(backend: Backend, leaf, handle: ExpertMajorHandle):
    """leaf [T, ...] placed on the handle's rows: the kernels' cached dispatch, the rank-major cached dispatch along
    the rows, or with one rank a gather."""
    if handle.by_kernels:
        return backend.expert_major_cached_dispatch(leaf, handle)
    if handle.routing is None:
        return gather_rows(leaf, handle.rows.recv_src_index)
    return backend.cached_dispatch(leaf, handle.rows)


def _bring_home(backend: Backend, rows, handle: ExpertMajorHandle, bias=None, out_dtype=jnp.float32):
    """Composed path: the rank-major combine of rows [R*T, ...] (one per received token) along the routing
    dispatch."""
    if handle.routing is None:
        return (rows if bias is None else rows + bias.astype(jnp.float32)).astype(out_dtype)
    return backend.combine(rows, handle.routing, bias=bias, out_dtype=out_dtype)


def received_items(pair_row):
    """int32 [R*T, 1] from a kernels' handle's pair_row: each token the rank received as its own one "pair", row i
    of a table with a row per token (item), -1 for a token not received; the kernels' combine along it brings such
    a table's rows home."""
    items = jnp.arange(pair_row.shape[0], dtype=int32)[:, None]
    return jnp.where(pair_row[:, :1] >= 0, items, -1)


def _per_received_token(backend: Backend, rows, handle: ExpertMajorHandle):
    """float32 rows [R*T, ...], one per token the rank may receive (the handle's pair_row rows), summed home: each
    token's rows of the ranks that received it, in rank order (rows of a token no rank sent a pair of: 0)."""
    if not handle.by_kernels:
        return _bring_home(backend, rows, handle)
    return backend.expert_major_combine(rows, None, received_items(handle.pair_row), handle, out_dtype=jnp.float32)


def _dispatch_fwd(spec, x_leaves, topk_idx, topk_weights):
    out = dispatch(spec, x_leaves, topk_idx, topk_weights)
    return out, (out[7], types_of(x_leaves), topk_idx, types_of(topk_weights))


def _combine_cotangent_rows(backend, cotangent, handle, x_types):
    """d x of rows placed along `handle`: each token's rows summed (the unweighted combine), typed like x."""
    return tuple(typed_like(combine_rows(backend, g, None, handle).astype(g.dtype), x)
                 for g, x in zip(cotangent, x_types))


def _dispatch_bwd(spec, residual, cotangent):
    # Each cotangent is typed like its primal (typed_like): x, topk_weights and what the backends compute from them
    # may vary over different shard_map axes.
    handle, x_leaves, topk_idx, topk_weights = residual
    d_recv, d_weight = cotangent[0], cotangent[1]
    d_x = _combine_cotangent_rows(spec.backend, d_recv, handle, x_leaves)
    d_topk_weights = None
    if d_weight is not None:
        # Entry k of a received token gets its pair's cotangent; the routing combine adds the one rank holding it.
        per_entry = gather_rows(d_weight.astype(jnp.float32), handle.topk_row)
        d_topk_weights = typed_like(_per_received_token(spec.backend, per_entry, handle), topk_weights)
    return d_x, zero_cotangent(topk_idx), d_topk_weights


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine_rows(backend: Backend, y, weights, handle: ExpertMajorHandle, bias=None, out_dtype=None):
    """The expert-major combine without its VJP: per rank each token's partial (its pairs, weighted, summed in
    float32, rounded to y's dtype), then the partials summed home in float32 in rank order, + bias, cast."""
    out_dtype = out_dtype or jnp.float32
    if handle.by_kernels:
        return backend.expert_major_combine(y, weights, handle.pair_row, handle, bias=bias, out_dtype=out_dtype)
    partial = partial_sums(y, weights, handle.pair_row).astype(y.dtype)
    return _bring_home(backend, partial, handle, bias, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine(backend: Backend, y, handle: ExpertMajorHandle, weights, bias):
    return combine_rows(backend, y, weights, handle, bias, y.dtype)


def _combine_fwd(backend, y, handle, weights, bias):
    return combine(backend, y, handle, weights, bias), (y, handle, weights, bias)


def _combine_bwd(backend, residual, d_out):
    y, handle, weights, bias = residual
    if handle.by_kernels:  # one kernel: d_out crosses once per received token, nothing materialised in between
        d_y, d_weights = backend.expert_major_combine_backward(d_out, y, weights, handle)
    else:
        # dout[t] on each of t's rows; rows of no pair 0.
        has_pair = (handle.rows.recv_src_index < handle.rows.is_token_in_rank.size)[:, None]
        d_rows = jnp.where(has_pair, _rows(backend, d_out, handle).astype(jnp.float32), 0.0)
        d_y = d_rows if weights is None else weights[:, None] * d_rows
        d_weights = None if weights is None else jnp.sum(d_rows * jnp.where(has_pair, y.astype(jnp.float32), 0.0),
                                                         axis=1)
    d_bias = None if bias is None else typed_like(d_out.astype(bias.dtype), bias)
    if d_weights is not None:
        d_weights = typed_like(d_weights, weights)
    return typed_like(d_y.astype(y.dtype), y), zero_cotangent(handle), d_weights, d_bias


combine.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def cached_dispatch(backend: Backend, x_leaves, handle: ExpertMajorHandle):
    return tuple(_rows(backend, leaf, handle) for leaf in x_leaves)


def _cached_dispatch_fwd(backend, x_leaves, handle):
    return cached_dispatch(backend, x_leaves, handle), (handle, types_of(x_leaves))


def _cached_dispatch_bwd(backend, residual, cotangent):
    handle, x_types = residual
    return _combine_cotangent_rows(backend, cotangent, handle, x_types), zero_cotangent(handle)


cached_dispatch.defvjp(_cached_dispatch_fwd, _cached_dispatch_bwd)
