"""The expert-major layout of the normal dispatch (docs/design.md, "Expert-major layout") on the portable `xla`
backend against the NumPy oracle (tests/oracle.py, `expert_major_*`).

Every op runs inside `jax.jit(jax.shard_map(...))` over an 8-virtual-device CPU mesh cut to R ranks. Dispatch
outputs, cached dispatch and the unweighted combine (float32 sums in a fixed order, or copies) are compared bit for
bit; the weighted combine and the gradients within bounds explained where they are checked.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import oracle as O  # noqa: E402
import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

from conftest import buffer, flat, mesh_of, ranks, spmd  # noqa: E402
from xla_harness import SETTINGS, Case, as_f32, assert_same  # noqa: E402
from xla_harness import cases as ops_cases  # noqa: E402

F32 = np.dtype(np.float32)


def assert_within(actual, expected, bound, what: str):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    err = np.abs(as_f32(actual).astype(np.float64) - as_f32(expected).astype(np.float64))
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off, e.g. at {np.argwhere(bad)[0]}: got "
                           f"{as_f32(actual)[bad][0]}, want {as_f32(expected)[bad][0]}, bound {np.broadcast_to(bound, err.shape)[bad][0]}")


def additions(route: O.ExpertMajorRouting) -> np.ndarray:
    """float64 [R, T, 1]: the float32 additions of a token's combine that can round (one per kept pair into its
    rank's partial, one per rank's partial into the total)."""
    n = np.zeros((route.num_ranks, route.num_tokens), np.float64)
    for pr in route.pairs:
        if len(pr):
            np.add.at(n, (pr[:, 0], pr[:, 1]), 1.0)  # the pairs
            held = np.unique(pr[:, :2], axis=0)
            n[held[:, 0], held[:, 1]] += 1.0  # this rank's partial
    return n[..., None]


def partial_ulps(route: O.ExpertMajorRouting, y, weights) -> np.ndarray:
    """float64 [R, T, H]: per token and element, the sum over the ranks holding it of one bfloat16 ulp of a bound on
    that rank's partial (the sum of |w * y| over its pairs there): how far rounding each partial to bfloat16 can
    move a result whose partial came out a float32 ulp apart."""
    y, weights = np.abs(as_f32(y)).astype(np.float64), np.abs(np.asarray(weights, np.float64))
    total = np.zeros((route.num_ranks, route.num_tokens, y.shape[-1]), np.float64)
    for r, (pr, rows) in enumerate(zip(route.pairs, route.rows)):
        bound = np.zeros_like(total)
        if len(pr):
            np.add.at(bound, (pr[:, 0], pr[:, 1]), weights[r, rows, None] * y[r, rows])
        total += np.where(bound > 0, bf16_ulp(bound), 0.0)
    return total


def bf16_ulp(v) -> np.ndarray:
    """One bfloat16 ulp at |v| (float32 spacing scaled by the 16 mantissa bits bfloat16 lacks)."""
    return np.spacing(np.abs(np.asarray(v, np.float32))).astype(np.float64) * 2.0**16


def cases(max_T: int = 40, Ks=(1, 6), **options):
    """test_ops_xla's routings, smaller by default: every case here runs the dispatch, combine and their VJPs."""
    return ops_cases(max_T=max_T, Ks=Ks, **options)


def default_capacity(c: Case, alignment: int) -> int:
    return O.expert_major_capacity(c.R, c.T, c.K, c.L, alignment)


def capacity_for(c: Case, idx, alignment: int, choice: str):
    """A static capacity: default (None), above the default, exactly the rows needed, or below them (drops)."""
    if choice == "default":
        return None
    if choice == "over":
        return default_capacity(c, alignment) + 3
    full = O.expert_major_dispatch(np.zeros((c.R, c.T, 1), np.float32), idx, None, c.E, expert_alignment=alignment)
    need = max((int(rw.max()) + 1 for rw in full.routing.rows if len(rw)), default=1)
    return {"exact": need, "half": max(need // 2, 1), "minus1": max(need - 1, 1), "tiny": 1}[choice]


def payload(rng, shape, kind: str):
    if kind == "fp8":
        return O.make_fp8_pair(rng, shape)
    return O.make_x(rng, shape, np.dtype(O.BF16 if kind == "bfloat16" else np.float32))


# ----------------------------------------------------------------------------------------------------------------
# Oracle self-check on a worked example (hand-computed from docs/design.md)
# ----------------------------------------------------------------------------------------------------------------
def test_oracle_worked_example():
    # R=2, E=4 (L=2), T=2, K=3. rank 0: t0 -> {1, 2, 1} (expert 1 twice), t1 -> {3, -1, 0};
    # rank 1: t0 -> {9 (invalid), 0, -1}, t1 -> {2, 3, 2} (expert 2 twice).
    idx = np.array([[[1, 2, 1], [3, -1, 0]], [[9, 0, -1], [2, 3, 2]]], dtype=np.int32)
    w = np.array([[[0.5, 0.25, 1.0], [2.0, 3.0, 4.0]], [[5.0, 6.0, 7.0], [0.125, 8.0, 0.375]]], dtype=np.float32)
    x = np.arange(2 * 2 * 128, dtype=np.float32).reshape(2, 2, 128)
    d = O.expert_major_dispatch(x, idx, w, 4)
    # rank 0: expert 0 <- (0, t1), (1, t0); expert 1 <- (0, t0).  rank 1: expert 2 <- (0, t0), (1, t1);
    # expert 3 <- (0, t1), (1, t1).
    assert d.routing.capacity == 2 * 2 * 2
    np.testing.assert_array_equal(d.num_recv_tokens_per_expert, [[2, 1], [2, 2]])
    np.testing.assert_array_equal(d.expert_offsets, [[0, 2], [0, 2]])
    np.testing.assert_array_equal(d.num_recv_tokens, [3, 4])
    np.testing.assert_array_equal(d.num_dropped, [0, 0])
    np.testing.assert_array_equal(d.invalid_ids, [0, 1])
    np.testing.assert_array_equal(d.routing.pairs[0], [[0, 1, 0], [1, 0, 0], [0, 0, 1]])
    np.testing.assert_array_equal(d.routing.rows[1], [0, 1, 2, 3])
    np.testing.assert_array_equal(d.recv_weights, [[4.0, 6.0, 1.5, 0, 0, 0, 0, 0], [0.25, 0.5, 2.0, 8.0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(d.recv_x[0][0, :3], x[[0, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(d.recv_x[0][1, :4], x[[0, 1, 0, 1], [0, 1, 1, 1]])
    np.testing.assert_array_equal(d.recv_x[0][0, 3:], 0)
    # alignment 3: groups padded to 3 rows, default C = 8 + L * 2 = 12
    d3 = O.expert_major_dispatch(x, idx, w, 4, expert_alignment=3)
    np.testing.assert_array_equal(d3.num_recv_tokens_per_expert, [[3, 3], [3, 3]])
    np.testing.assert_array_equal(d3.expert_offsets, [[0, 3], [0, 3]])
    np.testing.assert_array_equal(d3.routing.rows[0], [0, 1, 3])
    np.testing.assert_array_equal(d3.routing.rows[1], [0, 1, 3, 4])
    assert d3.routing.capacity == 12
    # capacity 2 with alignment 3: rows 0 and 1 kept; sizes and offsets are not clipped
    d2 = O.expert_major_dispatch(x, idx, w, 4, max_recv_tokens=2, expert_alignment=3)
    np.testing.assert_array_equal(d2.num_recv_tokens, [2, 2])
    np.testing.assert_array_equal(d2.num_dropped, [1, 2])
    np.testing.assert_array_equal(d2.expert_offsets, [[0, 3], [0, 3]])
    np.testing.assert_array_equal(d2.recv_weights, [[4.0, 6.0], [0.25, 0.5]])
    # combine: y[r, row] = 10 r + row + 1 on every channel
    y = (10 * np.arange(2)[:, None, None] + np.arange(8)[None, :, None] + 1 + np.zeros((1, 1, 128))).astype(np.float32)
    out = O.expert_major_combine(y, d.routing)
    np.testing.assert_array_equal(out[..., 0], [[3 + 11, 1 + 13], [2, 12 + 14]])
    out = O.expert_major_combine(y, d.routing, d.recv_weights, bias=np.ones((2, 2, 128), np.float32))
    np.testing.assert_array_equal(out[..., 0], [[1.5 * 3 + 0.25 * 11 + 1, 4 * 1 + 2 * 13 + 1], [6 * 2 + 1, 0.5 * 12 + 8 * 14 + 1]])
    np.testing.assert_array_equal(O.expert_major_combine(y, d.routing, ranks_per_node=1)[..., 0],
                                  [[3 + 11, 1 + 13], [2, 12 + 14]])
    # d topk_weights: entry k gets its pair's cotangent (g[r, row] = 100 r + row + 1 here)
    g_w = (100 * np.arange(2)[:, None] + np.arange(8)[None, :] + 1).astype(np.float32)
    dx, dw = O.expert_major_dispatch_vjp(d.routing, idx, 4, y, g_w, np.float32)
    np.testing.assert_array_equal(dw, [[[3, 101, 3], [103, 0, 1]], [[0, 2, 0], [102, 104, 102]]])
    np.testing.assert_array_equal(dx, O.expert_major_combine(y, d.routing))
    # d combine: dy[row] = w[row] g[token], d w[row] = <g[token], y[row]>
    g_out = np.ones((2, 2, 128), np.float32)
    dy, dwc, db = O.expert_major_combine_vjp(d.routing, g_out, y, d.recv_weights, np.float32, np.float32)
    np.testing.assert_array_equal(dy[..., 0], d.recv_weights)
    np.testing.assert_array_equal(dwc, [[128.0 * (i + 1) if i < 3 else 0 for i in range(8)],
                                        [128.0 * (11 + i) if i < 4 else 0 for i in range(8)]])
    np.testing.assert_array_equal(db, g_out)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch, cached dispatch and combine: one program per case
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def forward_fn(R: int, E: int, C, alignment: int, with_weights: bool, with_bias: bool):
    buf = buffer(R, "xla")

    def body(x, idx, w, x2, y, wc, bias):
        res = jax_ep.dispatch(buf, x, idx, w if with_weights else None, num_experts=E, max_recv_tokens=C,
                              expert_alignment=alignment, layout="expert_major")
        assert isinstance(res, jax_ep.ExpertMajorDispatchResult)
        assert (res.recv_weights is None) == (not with_weights)
        cached = jax_ep.dispatch(buf, x2, handle=res.handle)
        assert isinstance(cached, jax_ep.ExpertMajorDispatchResult)
        assert all(getattr(cached, f) is None for f in ("recv_weights", "num_recv_tokens", "num_recv_tokens_per_expert",
                                                         "expert_offsets", "num_dropped", "invalid_ids"))
        plain = jax_ep.combine(buf, y, res.handle, bias=bias if with_bias else None)
        weighted = jax_ep.combine(buf, y, res.handle, weights=res.recv_weights if with_weights else wc)
        assert plain.topk_weights is None and weighted.topk_weights is None
        return (res.recv_x, res.recv_weights, res.num_recv_tokens[None], res.num_recv_tokens_per_expert,
                res.expert_offsets, res.num_dropped[None], res.invalid_ids[None], cached.recv_x, plain.x, weighted.x)

    return spmd(R, body)


def check_forward(c: Case, idx, x, w, x2, y, wc, bias, C, alignment):
    """Runs forward_fn and compares everything with the oracle."""
    fp8 = isinstance(x, tuple)
    out = forward_fn(c.R, c.E, C, alignment, w is not None, bias is not None)(
        flat(x), flat(idx), flat(w), flat(x2), flat(y), flat(wc), flat(bias))
    recv_x, recv_w, n, sizes, offsets, dropped, invalid, cached, plain, weighted = out
    comps = (lambda a: tuple(ranks(v, c.R) for v in a)) if fp8 else (lambda a: (ranks(a, c.R),))

    exp = O.expert_major_dispatch(x, idx, w, c.E, max_recv_tokens=C, expert_alignment=alignment)
    got_x = comps(recv_x)
    assert len(got_x) == len(exp.recv_x)
    for i, (a, b) in enumerate(zip(got_x, exp.recv_x)):
        assert_same(a, b, f"recv_x[{i}]")
    if w is None:
        assert recv_w is None
    else:
        assert_same(ranks(recv_w, c.R), exp.recv_weights, "recv_weights")
    assert_same(np.asarray(n), exp.num_recv_tokens, "num_recv_tokens")
    assert_same(ranks(sizes, c.R), exp.num_recv_tokens_per_expert, "num_recv_tokens_per_expert")
    assert_same(ranks(offsets, c.R), exp.expert_offsets, "expert_offsets")
    assert_same(np.asarray(dropped), exp.num_dropped, "num_dropped")
    assert_same(np.asarray(invalid), exp.invalid_ids, "invalid_ids")
    for i, (a, b) in enumerate(zip(comps(cached), O.expert_major_cached_dispatch(x2, exp.routing))):
        assert_same(a, b, f"cached recv_x[{i}]")

    # Unweighted: float32 sums in a fixed order, no products: bit for bit.
    assert_same(ranks(plain, c.R), O.expert_major_combine(y, exp.routing, None, bias), "combine (unweighted, bias)")

    # Weighted: the contract allows XLA to fuse w*y into the float32 sum (a fused multiply-add, whose product is not
    # rounded; on this CPU about a fifth of the elements differ), so a partial can differ from the oracle's
    # separately rounded products in the last bits. Each product differs by at most 2**-24 |w*y|, and each of the n
    # float32 additions after it can round the two differently by at most one ulp of a value <= sum|w*y| (2**-23
    # of it): |diff| <= 2**-24 * (1 + 2n) * sum|w*y|. (Measured on 1.8M elements: at most 3.99 * 2**-24 * sum|w*y|,
    # within 2**-22; the bound above is what holds for every routing.) A wrong or missing pair is ~|w*y| ~
    # sum|w*y| / n off, orders of magnitude more. A bfloat16 result may in addition round to the neighbouring
    # bfloat16 value: one bfloat16 ulp more, and so may each rank's partial, which is rounded to bfloat16 before the
    # partials are added (hypothesis found a result two ulps apart at R=4).
    weights = exp.recv_weights if w is not None else wc
    exp_w = O.expert_major_combine(y, exp.routing, weights)
    mag = O.expert_major_combine(np.abs(as_f32(y)), exp.routing, np.abs(weights)).astype(np.float64)
    bound = 2.0**-24 * (1 + 2 * additions(exp.routing)) * mag * 1.01
    if np.asarray(y).dtype == O.BF16:
        bound = bound + bf16_ulp(as_f32(exp_w)) + partial_ulps(exp.routing, y, weights)
    assert_within(ranks(weighted, c.R), exp_w, bound, "combine (weights=)")
    return exp


@settings(max_examples=14, **SETTINGS)
@given(c=cases(), kind=st.sampled_from(["float32", "bfloat16", "fp8"]), y_dtype=st.sampled_from(["float32", "bfloat16"]),
       weights=st.booleans(), bias=st.sampled_from(["none", "same", "float32"]),
       cap=st.sampled_from(["default", "default", "over", "exact", "half", "minus1", "tiny"]),
       alignment=st.sampled_from([1, 1, 3, 8]))
# A bfloat16 result two ulps from the oracle's: both partials' and the total's roundings moved (see check_forward).
@example(c=Case(R=4, T=12, H=256, K=5, E=12, mode="uniform", p_neg=0.0, p_invalid=0.05, seed=54866), kind="float32",
         y_dtype="bfloat16", weights=False, bias="none", cap="default", alignment=3)
def test_dispatch_combine(c, kind, y_dtype, weights, bias, cap, alignment):
    idx = c.topk_idx()
    C = capacity_for(c, idx, alignment, cap)
    Cn = default_capacity(c, alignment) if C is None else C
    rng = c.rng(3)
    x, x2 = payload(rng, (c.R, c.T, c.H), kind), payload(rng, (c.R, c.T, c.H), kind)
    ydt = np.dtype(O.BF16 if y_dtype == "bfloat16" else np.float32)
    y = O.make_x(rng, (c.R, Cn, c.H), ydt)  # padding rows hold garbage: combine must ignore them
    wc = rng.standard_normal((c.R, Cn), dtype=np.float32)  # weights of every row, padding included
    b = None if bias == "none" else O.make_x(rng, (c.R, c.T, c.H), ydt if bias == "same" else np.float32)
    check_forward(c, idx, x, c.topk_weights() if weights else None, x2, y, wc, b, C, alignment)


@pytest.mark.parametrize("R", [2, 8])
def test_edges(R):
    """Every entry -1; every token to one expert (all K entries: duplicates); few experts with many duplicates
    and every kind of invalid id; a rank that receives nothing; four pairs of a token on one rank (their order of
    addition shows in the bits); with alignment 4 (bfloat16 payload), then with drops (the FP8 pair)."""
    T, H, K, E = 12, 128, 4, 4 * R
    for C, alignment in [(None, 4), (5, 1)]:
        for mode, p_invalid in [("empty", 0.0), ("skewed", 0.0), ("dense_dups", 0.3), ("one_rank", 0.0),
                                ("distinct", 0.0)]:  # distinct: up to 4 pairs of a token on one rank
            c = Case(R, T, H, K, E, mode, 0.1, p_invalid, seed=R * 100 + len(mode))
            idx, w = c.topk_idx(), c.topk_weights()
            if p_invalid:
                idx[0, 0] = [E, -2, 2**31 - 1, 0]
            rng = c.rng(3)
            Cn = default_capacity(c, alignment) if C is None else C
            kind = "bfloat16" if C is None else "fp8"
            x, x2 = payload(rng, (R, T, H), kind), payload(rng, (R, T, H), kind)
            y = O.make_x(rng, (R, Cn, H), np.float32)
            b = O.make_x(rng, (R, T, H), np.float32)
            exp = check_forward(c, idx, x, w, x2, y, np.zeros((R, Cn), np.float32), b, C, alignment)
            if mode == "empty":
                assert (exp.num_recv_tokens == 0).all() and (exp.num_recv_tokens_per_expert == 0).all()
            if mode == "skewed":  # one expert holds every token once, its weight the sum of all K entries
                assert exp.num_recv_tokens.sum() + exp.num_dropped.sum() == R * T
            if p_invalid:
                assert exp.invalid_ids[0] >= 2
            if C == 5 and mode in ("skewed", "dense_dups"):
                assert exp.num_dropped.sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# Gradients: jax.grad of a scalar loss through dispatch -> y = recv_x**2 -> combine(weights=recv_weights)
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def moe_fn(R: int, E: int, C, alignment: int):
    buf = buffer(R, "xla")

    def body(x, idx, w):
        res = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C, expert_alignment=alignment,
                              layout="expert_major")
        y = res.recv_x * res.recv_x  # an "expert": elementwise square
        return jax_ep.combine(buf, y, res.handle, weights=res.recv_weights).x

    return jax.shard_map(body, mesh=mesh_of(R), in_specs=P("ep"), out_specs=P("ep"))


@settings(max_examples=6, **SETTINGS)
@given(c=cases(max_T=24, Ks=(1, 4), max_L=3, p_invalid=(0.0, 0.05)), cap=st.sampled_from(["default", "half"]),
       alignment=st.sampled_from([1, 4]))
def test_grad(c, cap, alignment):
    idx, w = c.topk_idx(), c.topk_weights()
    C = capacity_for(c, idx, alignment, cap)
    rng = c.rng(8)
    x = O.make_x(rng, (c.R, c.T, c.H), np.float32)
    cx = rng.standard_normal((c.R, c.T, c.H), dtype=np.float32)
    fn = moe_fn(c.R, c.E, C, alignment)

    def loss(x, w):
        return jnp.sum(fn(x, flat(idx), w) * flat(cx))

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(flat(x), flat(w))

    # The oracle's chain rule: d out = cx; d combine gives d y (w * cx on each pair's row) and d recv_weights
    # (<cx, y> per row); d y = v**2 gives d recv_x = 2 v * d y; d dispatch gives dx and d topk_weights.
    d = O.expert_major_dispatch(x, idx, w, c.E, max_recv_tokens=C, expert_alignment=alignment)
    v = d.recv_x[0]
    y = (v * v).astype(np.float32)
    dy, d_rw, _ = O.expert_major_combine_vjp(d.routing, cx, y, d.recv_weights, np.float32)
    g_v = (2.0 * (dy * v)).astype(np.float32)
    exp_dx, exp_dw = O.expert_major_dispatch_vjp(d.routing, idx, c.E, g_v, d_rw, np.float32)

    # dx: a float32 sum of the pair rows' 2 v w cx. XLA may form each term with one more or one fewer rounding
    # (v*g + g*v, possibly fused) than the oracle's 2 * (v * g): 2 * 2**-24 of |term|; each of the n additions
    # of the sum can then round differently by one ulp (2**-23 of the sum of magnitudes). Far below one wrong or
    # missing pair.
    mag_dx = O.expert_major_dispatch_vjp(d.routing, idx, c.E, np.abs(g_v), None, np.float32)[0].astype(np.float64)
    bound = 2.0**-24 * (2 + 2 * additions(d.routing)) * mag_dx * 1.01 + 1e-30
    assert_within(ranks(gx, c.R), exp_dx, bound, "d x")
    # d topk_weights[k]: the float32 dot of cx[t] and y[row] over H channels in XLA's order of additions (the
    # oracle rounds the exact dot once): at most ~H ulps of sum |cx * y|; entries of dropped pairs, -1 and invalid
    # ids are exactly 0 (their bound is 1e-30).
    _, mag_rw, _ = O.expert_major_combine_vjp(d.routing, np.abs(cx), np.abs(y), d.recv_weights, np.float32)
    mag_w = O.expert_major_dispatch_vjp(d.routing, idx, c.E, g_v, mag_rw, np.float32)[1].astype(np.float64)
    assert_within(ranks(gw, c.R), exp_dw, (c.H + 4) * 2.0**-24 * mag_w + 1e-30, "d topk_weights")


# ----------------------------------------------------------------------------------------------------------------
# The VJPs one by one (jax.vjp inside shard_map), random cotangents on every row, padding included
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def vjp_fn(R: int, E: int, C, with_bias: bool):
    buf = buffer(R, "xla")

    def body(x, idx, w, x2, y, wc, bias, g_x, g_w, g_x2, g_out):
        def fwd(x, w, x2):
            res = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C, layout="expert_major")
            return res.recv_x, res.recv_weights, jax_ep.dispatch(buf, x2, handle=res.handle).recv_x

        _, vjp = jax.vjp(fwd, x, w, x2)
        dx, dw, dx2 = vjp((g_x, g_w, g_x2))
        handle = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C, layout="expert_major").handle
        _, vjp = jax.vjp(lambda y, wc, b: jax_ep.combine(buf, y, handle, weights=wc, bias=b if with_bias else None).x,
                         y, wc, bias)
        dy, dwc, db = vjp(g_out)
        return dx, dw, dx2, dy, dwc, db if with_bias else None

    return spmd(R, body)


@settings(max_examples=6, **SETTINGS)
@given(c=cases(max_T=24, Ks=(1, 4), max_L=3), dtype=st.sampled_from(["float32", "bfloat16"]),
       bias=st.sampled_from(["none", "same", "float32"]), cap=st.sampled_from(["default", "half"]))
def test_vjps(c, dtype, bias, cap):
    dt = np.dtype(O.BF16 if dtype == "bfloat16" else np.float32)
    idx, w = c.topk_idx(), c.topk_weights()
    C = capacity_for(c, idx, 1, cap)
    Cn = default_capacity(c, 1) if C is None else C
    rng = c.rng(6)
    x, x2 = O.make_x(rng, (c.R, c.T, c.H), dt), O.make_x(rng, (c.R, c.T, c.H), dt)
    y = O.make_x(rng, (c.R, Cn, c.H), dt)
    wc = rng.standard_normal((c.R, Cn), dtype=np.float32)
    b_dt = None if bias == "none" else (dt if bias == "same" else F32)
    b = np.zeros((c.R, c.T, c.H), dtype=b_dt or dt)
    g_x, g_x2 = O.make_x(rng, (c.R, Cn, c.H), dt), O.make_x(rng, (c.R, Cn, c.H), dt)
    g_w = rng.standard_normal((c.R, Cn), dtype=np.float32)
    g_out = O.make_x(rng, (c.R, c.T, c.H), dt)

    dx, dw, dx2, dy, dwc, db = vjp_fn(c.R, c.E, C, b_dt is not None)(
        *map(flat, (x, idx, w, x2, y, wc, b, g_x, g_w, g_x2, g_out)))
    route = O.expert_major_dispatch(x, idx, w, c.E, max_recv_tokens=C).routing
    # d dispatch: float32 sums of copied cotangent rows in a fixed order, and copies: bit for bit.
    exp_dx, exp_dw = O.expert_major_dispatch_vjp(route, idx, c.E, g_x, g_w, dt)
    assert_same(ranks(dx, c.R), exp_dx, "d dispatch / d x")
    assert_same(ranks(dw, c.R), exp_dw, "d dispatch / d topk_weights")
    assert_same(ranks(dx2, c.R), O.expert_major_dispatch_vjp(route, idx, c.E, g_x2, None, dt)[0],
                "d cached dispatch / d x")
    # d combine: d y = w * g_out row (one rounded product, then the cast): bit for bit; d weights = a float32 dot
    # over H channels in XLA's order: within ~H ulps of the sum of |g_out * y| (the oracle rounds once).
    exp_dy, exp_dwc, exp_db = O.expert_major_combine_vjp(route, g_out, y, wc, dt, b_dt)
    assert_same(ranks(dy, c.R), exp_dy, "d combine / d y")
    _, mag, _ = O.expert_major_combine_vjp(route, np.abs(as_f32(g_out)), np.abs(as_f32(y)), wc, F32)
    assert_within(ranks(dwc, c.R), exp_dwc, (c.H + 4) * 2.0**-24 * mag.astype(np.float64) + 1e-30,
                  "d combine / d weights")
    if b_dt is not None:
        assert_same(ranks(db, c.R), exp_db, "d combine / d bias")


# ----------------------------------------------------------------------------------------------------------------
# strict and bad input
# ----------------------------------------------------------------------------------------------------------------
def test_strict():
    """strict=True: silent when every pair fits and every id is valid; a RuntimeError naming the dropped pairs
    (and the capacity needed) otherwise, on every rank."""
    R, E, T, H, K = 2, 4, 8, 128, 2
    buf = buffer(R, "xla")
    c = Case(R, T, H, K, E, "distinct", 0.0, 0.0, seed=3)
    idx, x = c.topk_idx(), O.make_x(c.rng(3), (R, T, H), np.float32)

    def run(C, idx=idx):
        body = lambda x, idx: jax_ep.dispatch(buf, x, idx, None, num_experts=E, max_recv_tokens=C, strict=True,  # noqa: E731
                                              layout="expert_major").recv_x
        return jax.block_until_ready(spmd(R, body)(flat(x), flat(idx)))

    try:
        assert_same(ranks(run(None), R), O.expert_major_dispatch(x, idx, None, E).recv_x[0], "strict recv_x")
        exp = O.expert_major_dispatch(x, idx, None, E, max_recv_tokens=3)
        with pytest.raises(RuntimeError) as info:
            run(3)
        message = str(info.value)
        assert "jax_ep.dispatch(strict=True)" in message and "pairs" in message, message
        for rank in range(R):
            n = int(exp.num_dropped[rank])
            assert re.search(rf"{n} received \(token, expert\) pairs did not fit max_recv_tokens=3 on rank {rank}",
                             message), message
        bad = idx.copy()
        bad[1, 2, 0] = E + 1
        with pytest.raises(RuntimeError, match=re.escape("1 top-k ids were outside [-1, 4) (treated as -1) on rank 1")):
            run(None, bad)
    finally:
        # The failure stays in JAX's runtime token of these devices (re-raised at exit) until a later strict run
        # on them succeeds.
        run(None)
        jax.effects_barrier()


def lower(R: int, body, *args):
    """Traces and lowers jit(shard_map(body)); nothing runs."""
    return spmd(R, body).lower(*args)


def test_bad_input():
    R, E, T, H, K = 2, 4, 4, 128, 2
    buf = buffer(R, "xla")
    x = np.zeros((R * T, H), np.float32)
    idx = np.tile(np.array([[0, 3]], np.int32), (R * T, 1))
    w = np.ones((R * T, K), np.float32)
    C = O.expert_major_capacity(R, T, K, E // R)

    with pytest.raises(ValueError, match="layout"):
        lower(R, lambda x, i: jax_ep.dispatch(buf, x, i, num_experts=E, layout="foo").recv_x, x, idx)

    def rank_major_with_weights(x, i):
        res = jax_ep.dispatch(buf, x, i, num_experts=E)
        return jax_ep.combine(buf, res.recv_x, res.handle, weights=jnp.ones((res.recv_x.shape[0],), jnp.float32)).x

    with pytest.raises(ValueError, match="weights"):
        lower(R, rank_major_with_weights, x, idx)

    def expert_major_with_topk_weights(x, i, w):
        res = jax_ep.dispatch(buf, x, i, w, num_experts=E, layout="expert_major")
        return jax_ep.combine(buf, res.recv_x, res.handle, topk_weights=jnp.ones((C, K), jnp.float32)).x

    with pytest.raises(ValueError, match="topk_weights"):
        lower(R, expert_major_with_topk_weights, x, idx, w)

    for bad in (jnp.ones((C + 1,), jnp.float32), jnp.ones((C, 1), jnp.float32), jnp.ones((C,), jnp.bfloat16)):
        def wrong_weights(x, i, w, bad=bad):
            res = jax_ep.dispatch(buf, x, i, w, num_experts=E, layout="expert_major")
            return jax_ep.combine(buf, res.recv_x, res.handle, weights=bad).x

        with pytest.raises(TypeError, match="weights"):
            lower(R, wrong_weights, x, idx, w)

    def wrong_y(x, i):  # y of the rank-major capacity with an expert-major handle
        res = jax_ep.dispatch(buf, x, i, num_experts=E, layout="expert_major")
        return jax_ep.combine(buf, res.recv_x[: R * T], res.handle).x

    with pytest.raises(TypeError, match=rf"\[{C}, hidden\]"):
        lower(R, wrong_y, x, idx)
