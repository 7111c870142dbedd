"""Rematerialisation: dispatch / combine (rank-major and expert-major layouts) and the low-latency ops under
`jax.checkpoint`.

With the `xla` backend (CPU): the gradients of a small MoE layer are the same bits with no checkpoint, with
`nothing_saveable` and with `dots_saveable`. With the cuda backend (lowered on CPU, as in the other lowering
tests): under `nothing_saveable` the backward pass calls the forward's custom calls again, i.e. the forward is
recomputed rather than its results kept alive (the ops carry no side effect that would pin them); under
`dots_saveable` too, since the communication results are not dots. The GPU memory figure is printed by
`python -m jax_ep.bench moe --remat` (XLA's temporary memory of the block's step with and without
jax.checkpoint)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of, with_standin_backend
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _native
from jax_ep.backends.cuda import intranode, low_latency

T, H, K, E, M = 8, 256, 2, 8, 8
POLICIES = {
    "none": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def normal_layer(buf, x, idx, weights, w):
    d = jax_ep.dispatch(buf, x, idx, weights, num_experts=E)
    hidden = jnp.tanh(d.recv_x @ w)  # a dot, so that dots_saveable has something to keep
    return jax_ep.combine(buf, hidden.astype(x.dtype), d.handle).x


def expert_major_layer(buf, x, idx, weights, w):
    """The expert-major layout: rows are (token, expert) pairs, combined with their pair weights."""
    d = jax_ep.dispatch(buf, x, idx, weights, num_experts=E, layout="expert_major")
    hidden = jnp.tanh(d.recv_x @ w)
    return jax_ep.combine(buf, hidden.astype(x.dtype), d.handle, weights=d.recv_weights).x


def low_latency_layer(buf, x, idx, weights, w):
    d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
    valid = jnp.arange(d.recv_x.shape[1])[None, :] < d.recv_count[:, None]
    hidden = jnp.where(valid[..., None], jnp.tanh(d.recv_x @ w), 0).astype(jnp.bfloat16)
    return jax_ep.low_latency_combine(buf, hidden, idx, weights, d.handle)


LAYERS = {"normal": normal_layer, "expert_major": expert_major_layer, "low_latency": low_latency_layer}


def grad_program(buf, layer, policy):
    """jit(shard_map(grad of sum(layer(...)**2) in x and w)), the layer under jax.checkpoint with `policy`
    (None: no checkpoint)."""

    def body(x, idx, weights, w):
        fn = functools.partial(layer, buf)
        if policy is not None:
            fn = jax.checkpoint(fn, policy=policy)

        def loss(x, w):
            return jnp.sum(fn(x, idx, weights, w).astype(jnp.float32) ** 2)

        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        return dx, jax.lax.psum(dw, buf.axis_name)[None]

    return jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P(buf.axis_name), out_specs=P(buf.axis_name)))


def inputs(num_ranks: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(num_ranks * T)]).astype(np.int32)
    idx[0, 1] = -1  # one entry routed nowhere
    weights = jnp.asarray(rng.random((num_ranks * T, K)), jnp.float32)
    w = jnp.asarray(np.tile(rng.standard_normal((1, H, H)) / 16, (num_ranks, 1, 1)), jnp.bfloat16)
    return x, jnp.asarray(idx), weights, w


def xla_buffer(kind: str, num_ranks: int):
    if kind != "low_latency":
        return jax_ep.Buffer(mesh_of(num_ranks), "ep", backend="xla")
    return jax_ep.Buffer(mesh_of(num_ranks), "ep", backend="xla", num_max_dispatch_tokens_per_rank=M, hidden=H,
                         num_experts=E)


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_gradients_are_the_same_bits_under_checkpoint(kind, num_ranks):
    buf = xla_buffer(kind, num_ranks)
    x, idx, weights, w = inputs(num_ranks)
    # The layer's weight is per rank in the program ([1, H, H] per rank): index it inside.
    layer = lambda b, x, idx, weights, w: LAYERS[kind](b, x, idx, weights, w[0])  # noqa: E731
    results = {name: grad_program(buf, layer, policy)(x, idx, weights, w) for name, policy in POLICIES.items()}
    reference = results["none"]
    assert float(jnp.max(jnp.abs(reference[0].astype(jnp.float32)))) > 0, "the gradient must not be trivially zero"
    for name, (dx, dw) in results.items():
        np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(reference[0], np.float32), err_msg=name)
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(reference[1], np.float32), err_msg=name)


def cuda_standin(kind: str, num_ranks: int = 4):
    """A Buffer holding a cuda intranode backend that allocated nothing: enough to lower (nothing runs)."""
    if not (_native.has_target(intranode.COMBINE_TARGET, "cuda") and low_latency.available()):
        pytest.skip("this build has no CUDA kernels")
    buf = xla_buffer(kind, num_ranks)
    extra = {} if kind != "low_latency" else dict(low_latency_transport="peer_stores", low_latency_offset=0)
    return with_standin_backend(buf, intranode.IntranodeBackend, **extra)


FORWARD_TARGETS = {"normal": intranode.DISPATCH_TARGET, "expert_major": intranode.EXPERT_MAJOR_DISPATCH_TARGET,
                   "low_latency": low_latency.DISPATCH_SEND_TARGET}


def custom_calls(text: str, target: str) -> int:
    return text.count(f"custom_call @{target}(")


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_the_forward_custom_calls_are_recomputed_not_kept(kind):
    buf = cuda_standin(kind)
    x, idx, weights, w = inputs(4)
    layer = lambda b, x, idx, weights, w: LAYERS[kind](b, x, idx, weights, w[0])  # noqa: E731
    counts = {name: custom_calls(grad_program(buf, layer, policy).lower(x, idx, weights, w).as_text(),
                                 FORWARD_TARGETS[kind])
              for name, policy in POLICIES.items()}
    assert counts["none"] == 1, counts
    assert counts["nothing_saveable"] == 2, counts  # once forward, once again in the backward pass
    assert counts["dots_saveable"] == 2, counts
