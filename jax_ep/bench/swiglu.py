"""The expert SwiGLU as the grouped_matmul and moe modes time it: the MoE shapes both take by name (SHAPES), its
FLOP count, its inputs, its forward + backward step, the dense matmul chain of the same FLOPs (the dense proxy),
and the roofline that both print beside their figures.

    gate, up = split(x @ W_gate_up); h = silu(gate) * up; y = h @ W_down
    forward + backward: y, and the pullback of a cotangent of y to x, W_gate_up [D, 2F] and W_down [F, D]

A step returns y beside the gradients, as a layer in a model computes it for the next layer. The gradients alone
do not read y, so without it jit would drop the forward's last matmul (h @ W_down, a ninth of the FLOPs) and a
step would do less than swiglu_flops counts. The cotangent is an input (random), not ones: the gradient of a plain
sum would let XLA turn a matmul with a broadcast of ones into a reduction, flattering the proxy.

The roofline of G experts' SwiGLU, forward + backward, on one GPU: the larger of
- its FLOPs (swiglu_flops) at the dense proxy's rate (FLOP/s), measured in the same run, and
- the expert weights' bytes it moves at the HBM bandwidth measured in the same run (hbm_gbps: a jitted copy,
  bytes read + written). The forward reads W_gate_up [G, D, 2F] and W_down [G, F, D] once, dx reads them once
  again, dW writes them once: 3 × (G·D·2F + G·F·D) × 2 bytes (bf16) (expert_weight_bytes). The rows (x, the
  activations, their gradients) are left out: they are what the dense proxy moves too.
With many experts and few rows each the second term binds: the weights cannot be read faster than HBM gives them,
however the matmuls are tiled."""
from __future__ import annotations

import functools
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
# The shapes whose sizes are GPU benchmark figures: naming one does not make a run small enough for a CPU
# (harness.refuse_gpu_sizes_without_gpu).
GPU_SHAPES = ("moe-a", "v3")


def shapes_help() -> str:
    return "; ".join(f"{name}: D={shape.d_model} F={shape.d_ff} E={shape.experts} K={shape.topk}"
                     for name, shape in SHAPES.items())


def swiglu_flops(rows: int, d_model: int, d_ff: int) -> int:
    """Useful FLOPs of forward + backward on `rows` rows: the forward is 3 matmuls (gate, up, down) of
    2·rows·D·F each; the backward twice the forward (dx and dW of each matmul)."""
    forward = 3 * 2 * rows * d_model * d_ff
    return 3 * forward


def swiglu_forward_backward(x, w_gate_up, w_down, cotangent, matmul):
    """(y, (dx, dW_gate_up, dW_down)): the SwiGLU's output and the pullback of `cotangent` (see the module's
    docstring for why y is returned)."""
    def forward(x, w_gate_up, w_down):
        gate, up = jnp.split(matmul(x, w_gate_up), 2, axis=-1)
        return matmul(jax.nn.silu(gate) * up, w_down)

    y, pullback = jax.vjp(forward, x, w_gate_up, w_down)
    return y, pullback(cotangent)


@jax.jit
def dense_swiglu_forward_backward(x, w_gate_up, w_down, cotangent):
    return swiglu_forward_backward(x, w_gate_up, w_down, cotangent, jnp.dot)


def normal(key, shape, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(DTYPE)


@functools.partial(jax.jit, static_argnums=(1, 2))
def expert_normal(key, shape, scale=1.0):
    """normal() values of shape [G, ...], made one expert at a time: made at once, an array takes temporaries of
    several times its size (float32 values, random bits); v3's 256 experts' W_gate_up, 15 GB, is 30 GB in float32
    alone."""
    return jax.lax.map(lambda k: normal(k, shape[1:], scale), jax.random.split(key, shape[0]))


def make_inputs(seed: int, rows: int, d_model: int, d_ff: int, groups: int | None):
    """x [rows, D], W_gate_up [D, 2F], W_down [F, D] (with a leading group axis unless groups is None),
    cotangent [rows, D]."""
    keys = jax.random.split(jax.random.key(seed), 4)

    def weight(key, shape, scale):
        return normal(key, shape, scale) if groups is None else expert_normal(key, (groups, *shape), scale)

    # Weights scaled by 1/sqrt(fan-in) keep the activations O(1).
    return (normal(keys[0], (rows, d_model)), weight(keys[1], (d_model, 2 * d_ff), d_model ** -0.5),
            weight(keys[2], (d_ff, d_model), d_ff ** -0.5), normal(keys[3], (rows, d_model)))


def dense_swiglu_step(rows: int, d_model: int, d_ff: int, input_sets: int = 1, seed: int = 0):
    """(fn, input sets) of forward + backward of the dense chain on one device, to time with harness.median_ms."""
    return dense_swiglu_forward_backward, [make_inputs(seed + i, rows, d_model, d_ff, None) for i in range(input_sets)]


def dense_swiglu_ms(rows: int, d_model: int, d_ff: int, *, runs: int, calls: int, input_sets: int = 1,
                    seed: int = 0) -> float:
    """Median ms (harness.median_ms) of forward + backward of the dense chain on one device: the roofline proxy
    of a grouped SwiGLU of the same rows."""
    return median_ms(*dense_swiglu_step(rows, d_model, d_ff, input_sets, seed), runs, calls)


# ---- the roofline ------------------------------------------------------------------------------------------------

def expert_weight_bytes(groups: int, d_model: int, d_ff: int) -> int:
    """Bytes of expert weights that forward + backward moves: W_gate_up [G, D, 2F] and W_down [G, F, D] read by the
    forward, read again by dx, written by dW: 3 × (G·D·2F + G·F·D) × 2 bytes."""
    return 3 * groups * (d_model * 2 * d_ff + d_ff * d_model) * jnp.dtype(DTYPE).itemsize


# The array hbm_gbps copies: 1 GiB on a GPU, far past its L2 cache; elsewhere a small one (the figure means nothing
# there).
HBM_COPY_BYTES_ON_GPU = 2 ** 30
HBM_COPY_BYTES_ELSEWHERE = 2 ** 24
HBM_COPY_CALLS = 20  # back-to-back copies per timed run, at least


@jax.jit
def _negated(x):
    # A copy by a kernel, reading and writing every element as the matmuls' kernels stream the weights: XLA
    # turns an identity (x + 0) into its copy instruction, on a GPU a memcpy rather than a kernel.
    return -x


def hbm_gbps(runs: int, calls: int) -> tuple[float, int]:
    """(GB/s, bytes copied) of a jitted device-to-device copy of a float32 array on this process's first device,
    timed as the figures are (median_ms) but with at least HBM_COPY_CALLS calls per run: a copy takes well under a
    millisecond, and the host's launch of a run's first call would otherwise count. Bytes read + written over the
    time. float32, not the weights' bf16: XLA's bf16 elementwise kernels reach ~3.3 TB/s on an H200 where 4-byte
    ones reach 4.1-4.2 TB/s (measured 2026-11-27), and the matmuls' TMA loads stream at the latter rate."""
    on_gpu = jax.local_devices()[0].platform == "gpu"
    nbytes = HBM_COPY_BYTES_ON_GPU if on_gpu else HBM_COPY_BYTES_ELSEWHERE
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    ms = median_ms(_negated, [(x,)], runs, max(calls, HBM_COPY_CALLS))
    return 2 * nbytes / ms / 1e6, nbytes


def hbm_text(gbps: float, nbytes: int) -> str:
    return f"HBM bandwidth {gbps:.0f} GB/s (a copy of {nbytes / 2**20:.0f} MiB, bytes read + written)"


class Roofline(NamedTuple):
    compute_ms: float  # the FLOPs at the dense proxy's rate
    memory_ms: float  # the expert weights' bytes at the HBM bandwidth

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"


def roofline(flops: float, dense_tflops: float, weight_bytes: int, gbps: float) -> Roofline:
    return Roofline(flops / dense_tflops / 1e9, weight_bytes / gbps / 1e6)


def roofline_fields(ms: float, bound: Roofline, weight_bytes: int, gbps: float) -> dict:
    """A figure's roofline fields for its JSON record: `ms` the figure."""
    return dict(roofline_ms=bound.ms, roofline_bound=bound.bound, roofline_compute_ms=bound.compute_ms,
                roofline_memory_ms=bound.memory_ms, weight_bytes=weight_bytes, hbm_gbps=gbps,
                ratio_to_roofline=ms / bound.ms)


def roofline_text(bound: Roofline) -> str:
    return (f"roofline {bound.ms:.3f} ms ({bound.bound}-bound; compute {bound.compute_ms:.3f}, "
            f"weights {bound.memory_ms:.3f} ms)")
