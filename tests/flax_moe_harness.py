"""What the Flax MoE block's tests share (test_flax_moe on CPU, gpu/test_flax_moe_gpu): the block on a mesh of up
to 4 ranks, its dense `none` reference, the comparisons, and the check of capacity drops against a count written
from the routing."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import mesh_of
from flax import nnx

from jax_ep.flax import MoE
from jax_ep.flax.routing import route

# Ranks: 4 of the 8 virtual CPU devices; on GPUs (tests/gpu/test_flax_moe_gpu.py) as many of this process's GPUs,
# up to 4, as there are (one on a one-GPU machine).
RANKS = min(4, len(jax.devices()))
TOKENS, D_MODEL, D_FF, EXPERTS, TOPK, SHARED_D_FF = 8, 128, 32, 8, 2, 16
# Router variants: DeepSeek-V3 (sigmoid, selection bias, grouped top-k, scaled weights) and a grouped softmax
# router without renormalisation (DeepSeek-V2 / Qwen-MoE style).
ROUTERS = {
    "softmax": dict(),
    "sigmoid_bias_grouped": dict(score_function="sigmoid", expert_bias=True, n_groups=4, topk_groups=2,
                                 routed_scaling_factor=2.5),
    "softmax_grouped_unnormalised": dict(n_groups=2, topk_groups=1, norm_topk_prob=False),
}


def make_moe(dispatcher: str, router: str = "softmax", **options) -> MoE:
    """The same weights for every dispatcher (seeded init; a nonzero expert bias where there is one)."""
    moe = MoE(D_MODEL, D_FF, EXPERTS, TOPK, mesh=mesh_of(RANKS), dispatcher=dispatcher, shared_d_ff=SHARED_D_FF,
              max_tokens_per_rank=TOKENS, **ROUTERS[router], **options, rngs=nnx.Rngs(0))
    if moe.expert_bias is not None:
        moe.expert_bias[...] = jnp.linspace(-0.05, 0.05, EXPERTS)
    return moe


def inputs(seed: int = 1):
    """Tokens of every rank [R*T, D] and a random output cotangent."""
    x_key, cotangent_key = jax.random.split(jax.random.key(seed))
    shape = (RANKS * TOKENS, D_MODEL)
    return jax.random.normal(x_key, shape), jax.random.normal(cotangent_key, shape)


def objective(moe, x, cotangent, axis_name=None):
    """A scalar that reaches every output: y against a random cotangent plus both router losses (which cover
    every rank's tokens already); with axis_name, inside a shard_map, y's part is summed over the ranks."""
    y, aux = moe(x)
    fit = jnp.sum(y * cotangent)
    if axis_name is not None:
        fit = jax.lax.psum(fit, axis_name)
    return fit + 0.3 * aux.load_balancing_loss + 0.1 * aux.router_z_loss, (y, aux)


@nnx.jit
def forward_and_grads(moe, x, cotangent):
    """(y, aux, d params, d x)."""
    (_, (y, aux)), (d_params, d_x) = nnx.value_and_grad(objective, argnums=(0, 1), has_aux=True)(moe, x, cotangent)
    return y, aux, d_params, d_x


def run(moe):
    """forward_and_grads in float32 matmul precision everywhere (GPUs otherwise use TF32), as numpy."""
    with jax.default_matmul_precision("highest"):
        y, aux, d_params, d_x = forward_and_grads(moe, *inputs())
    return jax.tree.map(np.asarray, (y, aux, nnx.to_pure_dict(d_params), d_x))


@functools.cache
def reference(router: str):
    return run(make_moe("none", router))


def assert_close(actual, expected, rtol: float, what: str):
    """Relative L2 error of every leaf of two pytrees below rtol."""
    flat_actual, flat_expected = jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)
    assert len(flat_actual) == len(flat_expected), what
    for (path, a), b in zip(flat_actual, flat_expected):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert error <= rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {error:.2e} > {rtol:.0e}"


def assert_matches_reference(result, expected, rtol: float):
    y, aux, d_params, d_x = result
    ref_y, ref_aux, ref_d_params, ref_d_x = expected
    assert_close(y, ref_y, rtol, "y")
    assert_close((aux.load_balancing_loss, aux.router_z_loss), (ref_aux.load_balancing_loss, ref_aux.router_z_loss),
                 1e-5, "losses")
    np.testing.assert_array_equal(aux.tokens_per_expert, ref_aux.tokens_per_expert)
    assert int(aux.num_dropped) == 0
    assert_close(d_params, ref_d_params, rtol, "d params")
    assert_close(d_x, ref_d_x, rtol, "d x")


# "normal" takes the Buffer's auto backend: xla on CPU, the CUDA kernels on GPUs. low_latency moves BF16.


def check_capacity_drops(dispatcher: str, expert_alignment: int, num_chunks: int = 1, **options):
    """capacity_factor below the need: num_dropped counts the (token, expert) pairs that did not fit (each rank's
    rows hold its experts' pairs expert by expert, each expert's in (source rank, token) order and its group
    padded to a multiple of expert_alignment; the rows are ceil(c T K) plus (E/R) (expert_alignment - 1), rounded
    up to a multiple of 8, and the pairs in the first that many rows are kept; with num_chunks, per chunk of
    T / num_chunks tokens of every rank), and tokens whose pairs were all kept still get the reference output."""
    capacity_factor = 0.75  # drops on some rank, and tokens left whole, on 1 to 4 ranks
    moe = make_moe(dispatcher, capacity_factor=capacity_factor, expert_alignment=expert_alignment,
                   num_chunks=num_chunks, **options)
    x, _ = inputs()
    with jax.default_matmul_precision("highest"):
        y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    topk_idx = np.asarray(route(x, moe.router_kernel[...], None, moe.router_config).topk_idx)
    local, chunk = EXPERTS // RANKS, TOKENS // num_chunks
    capacity = int(np.ceil(capacity_factor * chunk * TOPK)) + local * (expert_alignment - 1)
    capacity = -(-capacity // 8) * 8
    pairs = np.zeros((len(topk_idx), EXPERTS), bool)  # [RT, E]: token t chose expert e (once however often)
    pairs[np.arange(len(topk_idx))[:, None], topk_idx] = True
    chunk_of = np.arange(len(topk_idx)) % TOKENS // chunk  # each token's chunk (rows are rank-major: r * T + t)
    kept = np.zeros_like(pairs)
    for c in range(num_chunks):
        for r in range(RANKS):
            used = 0
            for e in range(r * local, (r + 1) * local):
                tokens = np.flatnonzero(pairs[:, e] & (chunk_of == c))
                kept[tokens[:max(0, capacity - used)], e] = True
                used += -(-len(tokens) // expert_alignment) * expert_alignment
    assert int(aux.num_dropped) == int((pairs & ~kept).sum()) > 0
    whole = (kept == pairs).all(axis=1)
    assert whole.any()
    assert_close(np.asarray(y)[whole], reference("softmax")[0][whole], 1e-5, "tokens that were not dropped")
