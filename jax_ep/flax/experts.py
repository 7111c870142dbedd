"""Expert computation: one SwiGLU, applied with the matmul each layout needs."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.grouped_activation import expert_swiglu


def swiglu(x, w_gate_up, w_down, matmul=jnp.matmul):
    """(silu(gate) * up) @ w_down with gate, up = split(x @ w_gate_up): w_gate_up holds the gate's F columns,
    then the up projection's (one matmul for both, as wide as the two). With jnp.matmul, leading expert axes of
    the weights broadcast: x [T, D] with w_gate_up [D, 2F] is one dense FFN, x [L, N, D] or [1, T, D] with
    [L, D, 2F] is a batch of experts."""
    gate, up = jnp.split(matmul(x, w_gate_up), 2, axis=-1)
    return matmul(jax.nn.silu(gate) * up, w_down)


def grouped_swiglu(rows, group_sizes, w_gate_up, w_down, *, zero_past_groups=True):
    """The local experts on rows sorted by expert (an expert-major dispatch's recv_x [C, D]): rows
    group_sizes[0] rows of expert 0, then expert 1's, ...; two jax_ep.grouped_matmul calls (gate and up together,
    then down) with silu(gate) * up between them (`grouped_activation.expert_swiglu`: rounded once, in the first
    matmul's kernel where it fits, and its gradient in the down projection's dx kernel where that fits); rows past
    the groups give zeros (with zero_past_groups=False, as grouped_matmul's: zeros on rows_read_past_groups() of
    them, the rest of them, and of the gradient's, unspecified and not written: the MoE block's combine reads only
    its pairs' rows). On grouped_matmul's own kernels (and the activation's,
    where their blocks tile the shape) the three steps' work ends near the last group: the matmuls skip those rows,
    the activation stops at the end of the block holding the last group's end (its gradient
    rows_read_past_groups() rows later). w_gate_up [L, D, 2F], w_down [L, F, D]."""
    return expert_swiglu(rows, w_gate_up, w_down, group_sizes, zero_past_groups=zero_past_groups)


def dense_gates(topk_idx, topk_weights, num_experts):
    """float32 [T, E]: the gate weight of each expert per token (0 for experts not chosen)."""
    return jnp.sum(jnp.where(topk_idx[..., None] == jnp.arange(num_experts), topk_weights[..., None], 0.0), axis=1)
