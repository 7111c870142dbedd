"""Gradients (custom_vjp) of dispatch, cached dispatch and combine on the `xla` backend against the oracle VJPs.

d dispatch = combine of the cotangent of recv_x (and of recv_topk_weights, only where the expert was kept);
d combine = cached dispatch of the output cotangent (y and topk_weights), the bias gets the cotangent itself.
Both are sums in float32 in rank order or copies, so they are compared bit for bit.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import oracle as O  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from conftest import buffer, flat, mesh_of, ranks, spmd  # noqa: E402
from xla_harness import SETTINGS, Case, assert_same, capacity_for, cases  # noqa: E402

import jax_ep  # noqa: E402


def _dtype(name: str) -> np.dtype:
    return np.dtype(O.BF16 if name == "bfloat16" else np.float32)


# ----------------------------------------------------------------------------------------------------------------
# d dispatch (and d cached dispatch) inside shard_map
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def dispatch_vjp_fn(R: int, E: int, C):
    buf = buffer(R, "xla")

    def body(x, idx, w, x2, g_x, g_w, g_x2):
        def f(x, w, x2):
            res = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C)
            cached = jax_ep.dispatch(buf, x2, handle=res.handle)
            return res.recv_x, res.recv_topk_weights, cached.recv_x

        _, vjp = jax.vjp(f, x, w, x2)
        return vjp((g_x, g_w, g_x2))

    return spmd(R, body)


@settings(max_examples=15, **SETTINGS)
@given(c=cases(max_T=128), dtype=st.sampled_from(["bfloat16", "float32"]), cap=st.sampled_from(["default", "half"]))
def test_dispatch_vjp(c, dtype, cap):
    dt = _dtype(dtype)
    idx, w = c.topk_idx(), c.topk_weights()
    C = capacity_for(c, idx, cap)
    Cn = c.R * c.T if C is None else C
    rng = c.rng(6)
    x, x2 = O.make_x(rng, (c.R, c.T, c.H), dt), O.make_x(rng, (c.R, c.T, c.H), dt)
    # cotangents are random on every row, padding included: padding must not leak into the gradient
    g_x, g_x2 = O.make_x(rng, (c.R, Cn, c.H), dt), O.make_x(rng, (c.R, Cn, c.H), dt)
    g_w = rng.standard_normal((c.R, Cn, c.K), dtype=np.float32)

    exp = O.dispatch(x, idx, w, c.E, max_recv_tokens=C)
    dx, dw, dx2 = dispatch_vjp_fn(c.R, c.E, C)(*map(flat, (x, idx, w, x2, g_x, g_w, g_x2)))
    exp_dx, exp_dw = O.dispatch_vjp(exp.routing, exp.recv_topk_idx, g_x, g_w, dt)
    exp_dx2, _ = O.dispatch_vjp(exp.routing, exp.recv_topk_idx, g_x2, None, dt)
    assert_same(ranks(dx, c.R), exp_dx, "d dispatch / d x")
    assert_same(ranks(dw, c.R), exp_dw, "d dispatch / d topk_weights")
    assert_same(ranks(dx2, c.R), exp_dx2, "d cached dispatch / d x")


# ----------------------------------------------------------------------------------------------------------------
# d combine inside shard_map
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def combine_vjp_fn(R: int, E: int, C, with_w: bool, with_bias: bool):
    buf = buffer(R, "xla")

    def body(x, idx, y, wc, bias, g_out, g_w):
        handle = jax_ep.dispatch(buf, x, idx, None, num_experts=E, max_recv_tokens=C).handle

        def f(y, wc, bias):
            r = jax_ep.combine(buf, y, handle, topk_weights=wc if with_w else None, bias=bias if with_bias else None)
            return r.x, r.topk_weights

        _, vjp = jax.vjp(f, y, wc, bias)
        dy, dwc, db = vjp((g_out, g_w if with_w else None))
        return dy, dwc if with_w else None, db if with_bias else None

    return spmd(R, body)


@settings(max_examples=15, **SETTINGS)
@given(c=cases(max_T=128), dtype=st.sampled_from(["bfloat16", "float32"]), with_w=st.booleans(),
       bias=st.sampled_from(["none", "same", "float32"]), cap=st.sampled_from(["default", "half"]))
def test_combine_vjp(c, dtype, with_w, bias, cap):
    dt = _dtype(dtype)
    idx = c.topk_idx()
    C = capacity_for(c, idx, cap)
    Cn = c.R * c.T if C is None else C
    rng = c.rng(7)
    x = O.make_x(rng, (c.R, c.T, c.H), dt)
    y = O.make_x(rng, (c.R, Cn, c.H), dt)
    wc = rng.standard_normal((c.R, Cn, c.K), dtype=np.float32)
    b_dt = None if bias == "none" else (dt if bias == "same" else np.dtype(np.float32))
    b = np.zeros((c.R, c.T, c.H), dtype=b_dt or dt)
    g_out = O.make_x(rng, (c.R, c.T, c.H), dt)
    g_w = rng.standard_normal((c.R, c.T, c.K), dtype=np.float32)

    route, _ = O.routing(idx, c.E, C)
    dy, dwc, db = combine_vjp_fn(c.R, c.E, C, with_w, b_dt is not None)(*map(flat, (x, idx, y, wc, b, g_out, g_w)))
    exp_dy, exp_dw, exp_db = O.combine_vjp(route, g_out, g_w if with_w else None, dt, b_dt)
    assert_same(ranks(dy, c.R), exp_dy, "d combine / d y")
    if with_w:
        assert_same(ranks(dwc, c.R), exp_dw, "d combine / d topk_weights")
    if b_dt is not None:
        assert_same(ranks(db, c.R), exp_db, "d combine / d bias")


# ----------------------------------------------------------------------------------------------------------------
# jax.grad from outside shard_map through a composed dispatch -> elementwise -> combine
# ----------------------------------------------------------------------------------------------------------------
def _moe_fn(R: int, E: int):
    buf = buffer(R, "xla")

    def body(x, idx, w):
        res = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
        h = res.recv_x * res.recv_x  # an "expert": elementwise square
        out = jax_ep.combine(buf, h, res.handle, topk_weights=3.0 * res.recv_topk_weights)
        return out.x, out.topk_weights

    return jax.shard_map(body, mesh=mesh_of(R), in_specs=P("ep"), out_specs=P("ep"))


@pytest.mark.parametrize("R", [1, 4, 8])
def test_grad_composed(R):
    T, H, K, E = 24, 128, 4, 2 * R
    c = Case(R, T, H, K, E, "uniform", 0.25, 0.05, seed=17 + R)
    idx, w = c.topk_idx(), c.topk_weights()
    rng = c.rng(8)
    x = O.make_x(rng, (R, T, H), np.float32)
    cx = rng.standard_normal((R, T, H), dtype=np.float32)
    cw = rng.standard_normal((R, T, K), dtype=np.float32)
    fn = _moe_fn(R, E)

    def loss(x, w):
        out, wout = fn(x, flat(idx), w)
        return jnp.sum(out * flat(cx)) + jnp.sum(wout * flat(cw))

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(flat(x), flat(w))
    # out[t] = n_t * x_t^2 with n_t the number of ranks holding t; wout[t, k] = 3 w[t, k] where e_k is valid
    n = O.layout(idx, E).is_token_in_rank.sum(-1).astype(np.float32)[..., None]
    valid = O.sanitize_ids(idx, E)[0] >= 0
    np.testing.assert_allclose(ranks(gx, R), 2.0 * n * x * cx, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ranks(gw, R), np.where(valid, 3.0 * cw, 0.0).astype(np.float32))


def test_check_grads_numeric():
    """Finite differences agree with the custom VJPs on a tiny float32 case (reverse mode)."""
    from jax.test_util import check_grads

    R, T, H, K, E = 2, 3, 128, 2, 4
    c = Case(R, T, H, K, E, "uniform", 0.2, 0.0, seed=23)
    idx, w = c.topk_idx(), c.topk_weights()
    x = O.make_x(c.rng(9), (R, T, H), np.float32)
    fn = _moe_fn(R, E)

    @jax.jit
    def f(x, w):
        out, wout = fn(x, flat(idx), w)
        return jnp.tanh(out), wout

    check_grads(f, (flat(x), flat(w)), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------------------------------------------
# Inputs replicated over the EP axis
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_replicated_inputs_get_the_sum_of_the_ranks_cotangents(layout):
    """x, topk_weights and bias the same on every rank (in_specs P()): each gets the sum over the ranks of the
    cotangent it would get as each rank's own copy (JAX's transpose of a replicated input), from dispatch, cached
    dispatch and combine alike."""
    R, T, H, K, E = 4, 8, 128, 2, 8
    buf = buffer(R, "xla")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    bias = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(R)]).astype(np.int32)

    def body(x, w, bias, idx):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, layout=layout)
        again = jax_ep.dispatch(buf, x * 3, handle=d.handle).recv_x
        if layout == "expert_major":
            out = jax_ep.combine(buf, d.recv_x * 2 + again, d.handle, weights=d.recv_weights, bias=bias)
            return out.x
        out = jax_ep.combine(buf, d.recv_x * 2 + again, d.handle, topk_weights=d.recv_topk_weights, bias=bias)
        return out.x + jnp.sum(out.topk_weights)

    mesh = mesh_of(R)
    weights_out = rng.standard_normal((R * T, H)).astype(np.float32)

    def loss(in_spec):
        def f(x, w, bias):
            out = jax.shard_map(body, mesh=mesh, in_specs=(in_spec, in_spec, in_spec, P("ep")),
                                out_specs=P("ep"))(x, w, bias, idx.reshape(R * T, K))
            return jnp.sum(out * weights_out)
        return f

    replicated = jax.jit(jax.grad(loss(P()), argnums=(0, 1, 2)))(x, w, bias)
    per_rank = jax.jit(jax.grad(loss(P("ep")), argnums=(0, 1, 2)))(*(np.tile(a, (R, 1)) for a in (x, w, bias)))
    for name, got, copies in zip(("x", "topk_weights", "bias"), replicated, per_rank):
        expected = np.asarray(copies).reshape(R, *got.shape).sum(0)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=name)
