"""Swap-in: the expert-parallel block built from a dense MoE block's trained weights, without retraining."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep.flax.moe import MoE


def _gate_up(gate_name: str, gate, up_name: str, up) -> tuple:
    """(gate, up), checked to have one shape: the parts of the block's kernel [..., 2F], concatenated below once
    cast to the parameter's dtype (so that the copy is no larger than the parameter)."""
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"jax_ep.flax.from_dense: {gate_name} {tuple(gate.shape)} and {up_name} {tuple(up.shape)} "
                         "must have one shape")
    return gate, up


def from_dense(router_kernel, w_gate, w_up, w_down, *, num_experts_per_tok: int, shared_w_gate=None,
               shared_w_up=None, shared_w_down=None, expert_bias=None, **moe_kwargs) -> MoE:
    """A `MoE` that holds the given weights, placed on its mesh (experts sharded over the EP axis).

    The weights use the x @ W layout of Flax kernels:
      router_kernel [D, E]                 the router's kernel (nnx.Linear / linen.Dense, no bias);
                                           a PyTorch nn.Linear weight [E, D] is its transpose
      w_gate, w_up [E, D, F], w_down [E, F, D]   the experts' SwiGLU kernels stacked along a leading expert
                                           axis (e.g. jnp.stack([expert.gate.kernel for expert in experts]))
      shared_w_gate, shared_w_up [D, Fs], shared_w_down [Fs, D]   a shared SwiGLU expert added to every token
      expert_bias [E]                      DeepSeek-V3's selection-only bias (e_score_correction_bias)
    num_experts_per_tok and **moe_kwargs (mesh=, dispatcher=, score_function=, norm_topk_prob=, ...) are MoE's
    arguments; d_model, d_ff, num_experts and shared_d_ff come from the shapes. The block holds each gate and up
    pair as one kernel, [..., D, 2F] (w_gate_up: the gate's F columns, then up's). Choose the router options that
    the dense block used (softmax or sigmoid scores, grouping, normalisation, scaling), and the outputs match it.
    """
    shared = (shared_w_gate, shared_w_up, shared_w_down)
    if len({value is None for value in shared}) != 1:
        raise ValueError("jax_ep.flax.from_dense: give all three shared expert weights or none")
    num_experts, d_model, d_ff = w_gate.shape
    weights = {"router_kernel": router_kernel, "w_gate_up": _gate_up("w_gate", w_gate, "w_up", w_up), "w_down": w_down}
    if shared_w_gate is not None:
        weights["shared_w_gate_up"] = _gate_up("shared_w_gate", shared_w_gate, "shared_w_up", shared_w_up)
        weights["shared_w_down"] = shared_w_down
    if expert_bias is not None:
        weights["expert_bias"] = expert_bias
    # Built abstractly (no random initialisation of weights about to be replaced), then filled.
    moe = nnx.eval_shape(lambda: MoE(
        d_model, d_ff, num_experts, num_experts_per_tok, expert_bias=expert_bias is not None,
        shared_d_ff=None if shared_w_gate is None else shared_w_gate.shape[1], rngs=nnx.Rngs(0), **moe_kwargs))
    for name, value in weights.items():
        variable = getattr(moe, name)
        parts = value if isinstance(value, tuple) else (value,)  # a gate and up pair, or one array
        value = jnp.concatenate([jnp.asarray(part, variable.dtype) for part in parts], axis=-1)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"jax_ep.flax.from_dense: {name} has shape {tuple(value.shape)}, the block with "
                             f"these shapes needs {tuple(variable.shape)}")
        if moe.mesh is not None:
            value = jax.device_put(value, NamedSharding(moe.mesh, P(*variable.get_metadata().get("out_sharding", ()))))
        variable.set_value(value)
    return moe
