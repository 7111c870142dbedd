"""Expert computation: one SwiGLU, applied with the matmul each layout needs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def swiglu(x, w_gate, w_up, w_down, matmul=jnp.matmul):
    """down(silu(x @ gate) * (x @ up)). With jnp.matmul, leading expert axes of the weights broadcast:
    x [T, D] with [D, F] weights is one dense FFN, x [L, N, D] or [1, T, D] with [L, D, F] weights is a batch
    of experts."""
    return matmul(jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up), w_down)


def grouped_swiglu(rows, local_ids, weights, w_gate, w_up, w_down):
    """The local experts applied to received rows, weighted and summed per row.

    rows [C, D]; local_ids int32 [C, K] (-1: the expert is elsewhere, or a padding row); weights float32
    [C, K] (0 where the id is -1); w_gate/w_up [L, D, F], w_down [L, F, D]. The (row, expert) pairs are
    sorted by expert so that one jax.lax.ragged_dot per projection runs every expert on its own rows; pairs
    without an expert sort last, beyond every group, and contribute nothing. Returns float32 [C, D]."""
    num_rows, num_topk = local_ids.shape
    num_local = w_gate.shape[0]
    expert = jnp.where(local_ids >= 0, local_ids, num_local).reshape(-1)
    order = jnp.argsort(expert, stable=True)
    row = order // num_topk
    group_sizes = jnp.bincount(expert, length=num_local + 1)[:num_local].astype(jnp.int32)
    out = swiglu(rows[row], w_gate, w_up, w_down, matmul=functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes))
    weighted = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((num_rows, rows.shape[1]), jnp.float32).at[row].add(weighted)


def dense_gates(topk_idx, topk_weights, num_experts):
    """float32 [T, E]: the gate weight of each expert per token (0 for experts not chosen)."""
    return jnp.sum(jnp.where(topk_idx[..., None] == jnp.arange(num_experts), topk_weights[..., None], 0.0), axis=1)
