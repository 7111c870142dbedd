"""Expert computation: one SwiGLU, applied with the matmul each layout needs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep.grouped_matmul import grouped_matmul


def swiglu(x, w_gate, w_up, w_down, matmul=jnp.matmul):
    """down(silu(x @ gate) * (x @ up)). With jnp.matmul, leading expert axes of the weights broadcast:
    x [T, D] with [D, F] weights is one dense FFN, x [L, N, D] or [1, T, D] with [L, D, F] weights is a batch
    of experts."""
    return matmul(jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up), w_down)


def grouped_swiglu(rows, local_ids, weights, w_gate, w_up, w_down):
    """The local experts applied to received rows, weighted and summed per row.

    rows [C, D]; local_ids int32 [C, K] (-1: the expert is elsewhere, or a padding row); weights float32
    [C, K] (0 where the id is -1); w_gate/w_up [L, D, F], w_down [L, F, D]. The (row, expert) pairs are
    sorted by expert so that one jax_ep.grouped_matmul per projection runs every expert on its own rows; pairs
    without an expert sort last, beyond every group, and cost no matmul work. Rows move by gathers only, in
    both directions (`_gather_rows`), and each row's K results are summed in float32 in top-k order: no
    scatter-add, so the result and its gradients are the same bits run after run. Returns float32 [C, D]."""
    num_rows, num_topk = local_ids.shape
    num_local = w_gate.shape[0]
    expert = jnp.where(local_ids >= 0, local_ids, num_local).reshape(-1)
    order = jnp.argsort(expert, stable=True)  # sorted position -> pair (row * K + k)
    pairs = jnp.arange(order.size, dtype=order.dtype)
    # pair -> sorted position: the inverse permutation, one scatter of distinct indices (no second sort)
    position = jnp.zeros_like(order).at[order].set(pairs, unique_indices=True)
    group_sizes = jnp.bincount(expert, length=num_local + 1)[:num_local].astype(jnp.int32)
    sorted_rows = _gather_rows(rows, order // num_topk, position, num_topk)
    matmul = functools.partial(grouped_matmul, group_sizes=group_sizes)
    sorted_out = swiglu(sorted_rows, w_gate, w_up, w_down, matmul=matmul)
    pair_out = _gather_rows(sorted_out, position, order, 1).reshape(num_rows, num_topk, -1)
    return jnp.einsum("ck,ckd->cd", weights, pair_out.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_rows(table, index, users, copies):
    """table[index], where each row of table is read by exactly `copies` output rows: those listed in
    users[c * copies : (c + 1) * copies] for table row c. The VJP gathers too: d_table[c] is the float32 sum of
    those rows' cotangents in that order, so it needs no scatter-add (whose order, and so its rounding, varies
    on a GPU)."""
    return table[index]


def _gather_rows_fwd(table, index, users, copies):
    return table[index], users


def _gather_rows_bwd(copies, users, cotangent):
    gathered = cotangent[users].reshape(users.shape[0] // copies, copies, cotangent.shape[1])
    if copies == 1:
        return gathered[:, 0], None, None
    return jnp.sum(gathered.astype(jnp.float32), axis=1).astype(cotangent.dtype), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def dense_gates(topk_idx, topk_weights, num_experts):
    """float32 [T, E]: the gate weight of each expert per token (0 for experts not chosen)."""
    return jnp.sum(jnp.where(topk_idx[..., None] == jnp.arange(num_experts), topk_weights[..., None], 0.0), axis=1)
