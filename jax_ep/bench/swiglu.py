"""The expert SwiGLU as the grouped_matmul and moe modes time it: the MoE shapes both take by name (SHAPES), its
FLOP count, its inputs, its loss, and the dense matmul chain of the same FLOPs that both print as the roofline
proxy beside their figures.

    gate, up = split(x @ W_gate_up); h = silu(gate) * up; y = h @ W_down
    forward + backward: the gradients of sum(y * cotangent) with respect to x, W_gate_up [D, 2F] and W_down [F, D]

The cotangent is an input (random), not ones: the gradient of a plain sum would let XLA turn a matmul with a
broadcast of ones into a reduction, flattering the proxy."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep.bench.harness import median_ms

DTYPE = jnp.bfloat16


class MoEShape(NamedTuple):  # field names are those of moe's overriding options (--d-model, ...)
    d_model: int
    d_ff: int
    experts: int
    topk: int


# "moe-a": issue 20's; "v3": DeepSeek-V3-like; "tiny": tests on CPU.
SHAPES = {"moe-a": MoEShape(2048, 1408, 64, 6), "v3": MoEShape(7168, 2048, 256, 8), "tiny": MoEShape(128, 64, 8, 2)}
SHAPES_TOKENS = 4096  # tokens per rank at which the shapes are timed by default


def shapes_help() -> str:
    return "; ".join(f"{name}: D={shape.d_model} F={shape.d_ff} E={shape.experts} K={shape.topk}"
                     for name, shape in SHAPES.items())


def swiglu_flops(rows: int, d_model: int, d_ff: int) -> int:
    """Useful FLOPs of forward + backward on `rows` rows: the forward is 3 matmuls (gate, up, down) of
    2·rows·D·F each; the backward twice the forward (dx and dW of each matmul)."""
    forward = 3 * 2 * rows * d_model * d_ff
    return 3 * forward


def swiglu_loss(x, w_gate_up, w_down, cotangent, matmul):
    gate, up = jnp.split(matmul(x, w_gate_up), 2, axis=-1)
    y = matmul(jax.nn.silu(gate) * up, w_down)
    return jnp.sum((y * cotangent).astype(jnp.float32))


@jax.jit
def dense_swiglu_grads(x, w_gate_up, w_down, cotangent):
    return jax.grad(swiglu_loss, argnums=(0, 1, 2))(x, w_gate_up, w_down, cotangent, jnp.dot)


def normal(key, shape, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(DTYPE)


def make_inputs(seed: int, rows: int, d_model: int, d_ff: int, groups: int | None):
    """x [rows, D], W_gate_up [D, 2F], W_down [F, D] (with a leading group axis unless groups is None),
    cotangent [rows, D]."""
    keys = jax.random.split(jax.random.key(seed), 4)
    lead = () if groups is None else (groups,)
    # Weights scaled by 1/sqrt(fan-in) keep the activations O(1).
    return (normal(keys[0], (rows, d_model)), normal(keys[1], (*lead, d_model, 2 * d_ff), d_model ** -0.5),
            normal(keys[2], (*lead, d_ff, d_model), d_ff ** -0.5), normal(keys[3], (rows, d_model)))


def dense_swiglu_step(rows: int, d_model: int, d_ff: int, input_sets: int = 1, seed: int = 0):
    """(fn, input sets) of forward + backward of the dense chain on one device, to time with harness.median_ms."""
    return dense_swiglu_grads, [make_inputs(seed + i, rows, d_model, d_ff, None) for i in range(input_sets)]


def dense_swiglu_ms(rows: int, d_model: int, d_ff: int, *, runs: int, calls: int, input_sets: int = 1,
                    seed: int = 0) -> float:
    """Median ms (harness.median_ms) of forward + backward of the dense chain on one device: the roofline proxy
    of a grouped SwiGLU of the same rows."""
    return median_ms(*dense_swiglu_step(rows, d_model, d_ff, input_sets, seed), runs, calls)
