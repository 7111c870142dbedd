"""Property tests of the public ops on the portable `xla` backend against the NumPy oracle (tests/oracle.py).

Every op runs inside `jax.jit(jax.shard_map(...))` over an 8-virtual-device CPU mesh cut to R ranks. Dispatch
outputs and normal combine (float32 accumulation in rank order) are compared bit for bit; low-latency combine
with an error bound that a wrong row cannot meet; FP8 casts by exact scales plus DeepEP's diff metric.
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

import jax_ep  # noqa: E402
from jax_ep import logfmt  # noqa: E402
from conftest import buffer, flat, ll_buffer, mesh_of, ranks, spmd  # noqa: E402
from xla_harness import RANKS, SETTINGS, Case, assert_same, capacity_for, cases  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# Oracle self-check on a worked example (hand-computed, so the oracle is not only checked against itself)
# ----------------------------------------------------------------------------------------------------------------
def test_oracle_worked_example():
    # R=2, E=4 (L=2), T=2, K=2. rank 0: t0 -> {1, 2}, t1 -> {3, 3}; rank 1: t0 -> {-1, 9 (invalid)}, t1 -> {0, 1}
    idx = np.array([[[1, 2], [3, 3]], [[-1, 9], [0, 1]]], dtype=np.int32)
    w = np.array([[[0.5, 0.25], [1.0, 2.0]], [[3.0, 4.0], [5.0, 6.0]]], dtype=np.float32)
    x = np.arange(2 * 2 * 128, dtype=np.float32).reshape(2, 2, 128)
    lay = O.layout(idx, 4)
    np.testing.assert_array_equal(lay.num_tokens_per_rank, [[1, 2], [1, 0]])
    np.testing.assert_array_equal(lay.num_tokens_per_expert, [[0, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(lay.invalid_ids, [0, 1])
    d = O.dispatch(x, idx, w, 4, expert_alignment=2)
    # rank 0 gets (0, t0) and (1, t1); rank 1 gets (0, t0) and (0, t1)
    np.testing.assert_array_equal(d.num_recv_tokens, [2, 2])
    np.testing.assert_array_equal(d.recv_x[0][0, :2], x[[0, 1], [0, 1]])
    np.testing.assert_array_equal(d.recv_x[0][1, :2], x[[0, 0], [0, 1]])
    np.testing.assert_array_equal(d.recv_x[0][:, 2:], 0)
    np.testing.assert_array_equal(d.recv_topk_idx[0, :2], [[1, -1], [0, 1]])
    np.testing.assert_array_equal(d.recv_topk_idx[1, :2], [[-1, 0], [1, 1]])
    np.testing.assert_array_equal(d.recv_topk_weights[1, :2], [[0, 0.25], [1.0, 2.0]])
    np.testing.assert_array_equal(d.num_recv_tokens_per_expert, [[2, 2], [2, 2]])  # [1,1] and [1,1] aligned to 2
    d1 = O.dispatch(x, idx, w, 4, max_recv_tokens=1)
    np.testing.assert_array_equal(d1.num_dropped, [1, 1])
    np.testing.assert_array_equal(d1.recv_x[0][1, 0], x[0, 0])
    out, wout = O.combine(d.recv_x[0], d.routing, d.recv_topk_weights)
    np.testing.assert_array_equal(out[0, 0], 2 * x[0, 0])  # t0 of rank 0 was received by both ranks
    np.testing.assert_array_equal(out[1, 0], 0)  # sent nowhere
    np.testing.assert_array_equal(wout[0], w[0])
    np.testing.assert_array_equal(wout[1], [[0, 0], [5.0, 6.0]])
    ll = O.low_latency_dispatch(x.astype(O.BF16), idx, 4, 2)
    np.testing.assert_array_equal(ll.recv_count, [[1, 2], [1, 1]])  # expert 1 gets (0, t0) and (1, t1)
    np.testing.assert_array_equal(ll.src_token_index[0, 1, :3], [0, 1, -1])
    np.testing.assert_array_equal(ll.layout_range[0, 1], [[0, 1], [1, 1]])
    np.testing.assert_array_equal(ll.layout_range[1, 1], [[0, 1], [1, 0]])
    y = np.ones((2, 2, 4, 128), dtype=O.BF16)
    acc, _ = O.low_latency_combine(y, idx, w, 4, ll)
    np.testing.assert_array_equal(acc[0, 1], 3.0)  # expert 3 twice: 1.0 + 2.0
    np.testing.assert_array_equal(acc[1, 0], 0.0)
    q, s = O.fp8_cast(np.full((1, 128), 3.0, dtype=O.BF16), round_scale=True)
    assert s[0, 0] == np.float32(2.0**-7) and np.all(q.astype(np.float32) == 384.0)
    assert O.ue8m0_pack(np.array([1.0, 2.0, 0.5, 2.0**-7], np.float32))[0] == np.int32(
        127 | (128 << 8) | (126 << 16) | (120 << 24)
    )


# ----------------------------------------------------------------------------------------------------------------
# Normal dispatch
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def dispatch_fn(R: int, E: int, C, alignment: int, fp8: bool, with_weights: bool):
    buf = buffer(R, "xla")

    def body(x, idx, w):
        res = jax_ep.dispatch(buf, x, idx, w if with_weights else None, num_experts=E, max_recv_tokens=C,
                              expert_alignment=alignment)
        return (res.recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens[None],
                res.num_recv_tokens_per_expert, res.num_dropped[None], res.invalid_ids[None])

    return spmd(R, body)


def run_dispatch(c: Case, x, idx, w, C=None, alignment=1):
    fp8 = isinstance(x, tuple)
    out = dispatch_fn(c.R, c.E, C, alignment, fp8, w is not None)(flat(x), flat(idx), flat(w))
    recv_x, ridx, rw, n, per_expert, dropped, invalid = out
    recv_x = tuple(ranks(a, c.R) for a in recv_x) if fp8 else (ranks(recv_x, c.R),)
    return dict(recv_x=recv_x, recv_topk_idx=ranks(ridx, c.R), recv_topk_weights=None if rw is None else ranks(rw, c.R),
                num_recv_tokens=np.asarray(n), num_recv_tokens_per_expert=ranks(per_expert, c.R),
                num_dropped=np.asarray(dropped), invalid_ids=np.asarray(invalid))


def check_dispatch(got: dict, exp: O.Dispatch):
    assert len(got["recv_x"]) == len(exp.recv_x)
    for i, (a, b) in enumerate(zip(got["recv_x"], exp.recv_x)):
        assert_same(a, b, f"recv_x[{i}]")
    assert_same(got["recv_topk_idx"], exp.recv_topk_idx, "recv_topk_idx")
    if exp.recv_topk_weights is None:
        assert got["recv_topk_weights"] is None
    else:
        assert_same(got["recv_topk_weights"], exp.recv_topk_weights, "recv_topk_weights")
    assert_same(got["num_recv_tokens"], exp.num_recv_tokens, "num_recv_tokens")
    assert_same(got["num_recv_tokens_per_expert"], exp.num_recv_tokens_per_expert, "num_recv_tokens_per_expert")
    assert_same(got["num_dropped"], exp.num_dropped, "num_dropped")
    assert_same(got["invalid_ids"], exp.invalid_ids, "invalid_ids")


@settings(max_examples=25, **SETTINGS)
@given(c=cases(), dtype=st.sampled_from(["bfloat16", "float32"]), weights=st.booleans(),
       cap=st.sampled_from(["default", "default", "over", "exact", "half", "minus1"]), alignment=st.sampled_from([1, 1, 4, 128]))
def test_dispatch(c, dtype, weights, cap, alignment):
    idx = c.topk_idx()
    x = O.make_x(c.rng(3), (c.R, c.T, c.H), np.dtype(O.BF16 if dtype == "bfloat16" else np.float32))
    w = c.topk_weights() if weights else None
    C = capacity_for(c, idx, cap)
    exp = O.dispatch(x, idx, w, c.E, max_recv_tokens=C, expert_alignment=alignment)
    check_dispatch(run_dispatch(c, x, idx, w, C, alignment), exp)


@pytest.mark.parametrize("R", RANKS)
def test_dispatch_skewed_empty_and_big(R):
    """Explicit edges: every token to one expert, a rank that receives nothing, a few hundred tokens."""
    E, K, H = 4 * R, 8, 128
    for T, mode in [(300, "skewed"), (257, "one_rank"), (64, "empty"), (1, "uniform")]:
        c = Case(R, T, H, K, E, mode, 0.0, 0.0, seed=R * 1000 + T)
        idx, w = c.topk_idx(), c.topk_weights()
        x = O.make_x(c.rng(3), (R, T, H), O.BF16)
        exp = O.dispatch(x, idx, w, E)
        check_dispatch(run_dispatch(c, x, idx, w), exp)
        if mode == "one_rank" and R > 1:
            assert (exp.num_recv_tokens == 0).sum() == R - 1


@pytest.mark.parametrize("R", [2, 8])
def test_dispatch_drops(R):
    """Capacity below the need: first C rows in (source rank, source token) order kept, num_dropped = need - C."""
    c = Case(R, 40, 128, 4, 2 * R, "uniform", 0.1, 0.0, seed=7)
    idx, w = c.topk_idx(), c.topk_weights()
    x = O.make_x(c.rng(3), (R, c.T, c.H), np.float32)
    _, need = O.routing(idx, c.E)
    for C in (1, 13, int(need.max()) // 2, int(need.max()) - 1):
        exp = O.dispatch(x, idx, w, c.E, max_recv_tokens=C)
        assert exp.num_dropped.sum() > 0
        check_dispatch(run_dispatch(c, x, idx, w, C), exp)


@pytest.mark.parametrize("R", [1, 4])
def test_dispatch_invalid_ids(R):
    c = Case(R, 33, 128, 6, 3 * R, "uniform", 0.2, 0.3, seed=11)
    idx, w = c.topk_idx(), c.topk_weights()
    idx[0, 0] = [c.E, -2, 2**31 - 1, -(2**31), c.E + 5, 0]  # every kind of bad id, and one good one
    x = O.make_x(c.rng(3), (R, c.T, c.H), O.BF16)
    exp = O.dispatch(x, idx, w, c.E)
    assert exp.invalid_ids[0] >= 5
    check_dispatch(run_dispatch(c, x, idx, w), exp)


@settings(max_examples=10, **SETTINGS)
@given(c=cases(max_T=96), cap=st.sampled_from(["default", "half"]))
def test_dispatch_fp8_pair_passthrough(c, cap):
    idx, w = c.topk_idx(), c.topk_weights()
    x = O.make_fp8_pair(c.rng(3), (c.R, c.T, c.H))
    C = capacity_for(c, idx, cap)
    exp = O.dispatch(x, idx, w, c.E, max_recv_tokens=C)
    got = run_dispatch(c, x, idx, w, C)
    assert got["recv_x"][0].dtype == O.E4M3 and got["recv_x"][1].dtype == np.float32
    np.testing.assert_array_equal(got["recv_x"][0].view(np.uint8), exp.recv_x[0].view(np.uint8))
    check_dispatch(got, exp)


def test_dispatch_strict():
    """strict=True: silent when nothing is dropped and every id is valid, an error when tokens are dropped."""
    R, E, T, H, K = 2, 4, 8, 128, 2
    buf = buffer(R, "xla")
    c = Case(R, T, H, K, E, "distinct", 0.0, 0.0, seed=3)
    idx, x = c.topk_idx(), O.make_x(c.rng(3), (R, T, H), np.float32)

    def run(C):
        body = lambda x, idx: jax_ep.dispatch(buf, x, idx, None, num_experts=E, max_recv_tokens=C, strict=True).recv_x
        return jax.block_until_ready(spmd(R, body)(flat(x), flat(idx)))

    assert_same(ranks(run(None), R), O.dispatch(x, idx, None, E).recv_x[0], "strict recv_x")
    with pytest.raises(Exception, match="(?i)drop|fit|capacity|max_recv_tokens"):
        run(1)
    # The failure stays in JAX's runtime token of these devices (re-raised at exit) until a later strict run
    # on them succeeds.
    run(None)
    jax.effects_barrier()


# ----------------------------------------------------------------------------------------------------------------
# Cached dispatch and normal combine
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def combine_fn(R: int, E: int, C, with_wc: bool, with_bias: bool):
    buf = buffer(R, "xla")

    def body(x, idx, x2, y, wc, bias):
        res = jax_ep.dispatch(buf, x, idx, None, num_experts=E, max_recv_tokens=C)
        cached = jax_ep.dispatch(buf, x2, handle=res.handle)
        assert cached.recv_topk_idx is None and cached.num_recv_tokens is None
        out = jax_ep.combine(buf, y, res.handle, topk_weights=wc if with_wc else None, bias=bias if with_bias else None)
        return cached.recv_x, out.x, out.topk_weights

    return spmd(R, body)


@settings(max_examples=20, **SETTINGS)
@given(c=cases(), dtype=st.sampled_from(["bfloat16", "float32"]), with_wc=st.booleans(),
       bias=st.sampled_from(["none", "same", "float32"]), cap=st.sampled_from(["default", "default", "half"]))
def test_cached_dispatch_and_combine(c, dtype, with_wc, bias, cap):
    dt = np.dtype(O.BF16 if dtype == "bfloat16" else np.float32)
    idx = c.topk_idx()
    C = capacity_for(c, idx, cap)
    Cn = c.R * c.T if C is None else C
    rng = c.rng(4)
    x = O.make_x(rng, (c.R, c.T, c.H), dt)
    x2 = O.make_x(rng, (c.R, c.T, c.H), dt)
    y = O.make_x(rng, (c.R, Cn, c.H), dt)  # padding rows hold garbage: combine must ignore them
    wc = rng.standard_normal((c.R, Cn, c.K), dtype=np.float32)
    b = None if bias == "none" else O.make_x(rng, (c.R, c.T, c.H), dt if bias == "same" else np.float32)

    route, _ = O.routing(idx, c.E, C)
    cached, out, wout = combine_fn(c.R, c.E, C, with_wc, b is not None)(
        flat(x), flat(idx), flat(x2), flat(y), flat(wc), flat(b))
    assert_same(ranks(cached, c.R), O.cached_dispatch(x2, route)[0], "cached recv_x")
    exp_out, exp_w = O.combine(y, route, wc if with_wc else None, b)
    assert_same(ranks(out, c.R), exp_out, "combine x")
    if with_wc:
        assert_same(ranks(wout, c.R), exp_w, "combine topk_weights")
    else:
        assert wout is None


@pytest.mark.parametrize("R", [2, 8])
def test_combine_of_dispatch_roundtrip(R):
    """combine(dispatch(x)) = (number of ranks holding t) * x, and the weights come back whole (DeepEP's check)."""
    E, T, H, K = 2 * R, 150, 256, 8
    c = Case(R, T, H, K, E, "uniform", 0.2, 0.0, seed=5)
    idx, w = c.topk_idx(), c.topk_weights()
    x = O.make_x(c.rng(3), (R, T, H), O.BF16)
    buf = buffer(R, "xla")

    def body(x, idx, w):
        res = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
        out = jax_ep.combine(buf, res.recv_x, res.handle, topk_weights=res.recv_topk_weights)
        return out.x, out.topk_weights

    out, wout = spmd(R, body)(flat(x), flat(idx), flat(w))
    lay = O.layout(idx, E)
    n = lay.is_token_in_rank.sum(-1)
    np.testing.assert_array_equal(ranks(out, R).astype(np.float32), (n[..., None] * x.astype(np.float32)).astype(O.BF16).astype(np.float32))
    valid = O.sanitize_ids(idx, E)[0] >= 0
    np.testing.assert_array_equal(ranks(wout, R), np.where(valid, w, 0))


# ----------------------------------------------------------------------------------------------------------------
# Low-latency dispatch and combine
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def ll_fn(R: int, M: int, H: int, E: int, use_fp8: bool, round_scale: bool, ue8m0: bool, with_stats: bool, split: bool,
          compression: str | None = None):
    buf = ll_buffer(R, M, H, E, "xla")
    kw = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0)

    def body(x, idx, stats, y, w):
        stats = stats if with_stats else None
        if split:
            res = jax_ep.low_latency_dispatch_recv(
                buf, jax_ep.low_latency_dispatch_send(buf, x, idx, cumulative_local_expert_recv_stats=stats, **kw))
            out = jax_ep.low_latency_combine_recv(buf, jax_ep.low_latency_combine_send(
                buf, y, idx, w, res.handle, compression=compression))
        else:
            res = jax_ep.low_latency_dispatch(buf, x, idx, cumulative_local_expert_recv_stats=stats, **kw)
            out = jax_ep.low_latency_combine(buf, y, idx, w, res.handle, compression=compression)
        return (res.recv_x, res.recv_count, res.handle.src_token_index, res.handle.layout_range,
                res.cumulative_local_expert_recv_stats, res.invalid_ids[None], out)

    return spmd(R, body)


def run_ll(c: Case, M: int, x, idx, stats, y, w, use_fp8=False, round_scale=False, ue8m0=False, split=False,
           compression=None):
    fn = ll_fn(c.R, M, c.H, c.E, use_fp8, round_scale, ue8m0, stats is not None, split, compression)
    recv_x, count, src, rng_, st_out, invalid, out = fn(flat(x), flat(idx), flat(stats), flat(y), flat(w))
    split_ranks = lambda a: np.asarray(a).reshape((c.R, c.L) + np.asarray(a).shape[1:])
    recv_x = tuple(split_ranks(a) for a in recv_x) if use_fp8 else split_ranks(recv_x)
    return dict(recv_x=recv_x, recv_count=ranks(count, c.R), src_token_index=split_ranks(src),
                layout_range=split_ranks(rng_), stats=None if st_out is None else ranks(st_out, c.R),
                invalid_ids=np.asarray(invalid), out=ranks(out, c.R))


def check_ll_common(got, exp: O.LowLatencyDispatch):
    assert_same(got["recv_count"], exp.recv_count, "recv_count")
    assert_same(got["src_token_index"], exp.src_token_index, "handle.src_token_index")
    assert_same(got["invalid_ids"], exp.invalid_ids, "invalid_ids")
    lr = got["layout_range"]
    assert lr.shape == exp.layout_range.shape and lr.dtype == np.int32, (lr.shape, lr.dtype)
    assert_same(lr[..., 1], exp.layout_range[..., 1], "layout_range counts")
    nonempty = exp.layout_range[..., 1] > 0  # an empty range has no first row to check
    np.testing.assert_array_equal(lr[..., 0][nonempty], exp.layout_range[..., 0][nonempty], "layout_range starts")
    if exp.cumulative_stats is None:
        assert got["stats"] is None
    else:
        assert_same(got["stats"], exp.cumulative_stats, "cumulative_local_expert_recv_stats")


def check_ll_combine(got_out, y, idx, w, c: Case, exp: O.LowLatencyDispatch):
    acc, mag = O.low_latency_combine(y, idx, w, c.E, exp)
    assert got_out.shape == acc.shape and got_out.dtype == O.BF16, (got_out.shape, got_out.dtype)
    got = got_out.astype(np.float32)
    # bf16 rounding of the f32 sum (<= 2^-8 relative) plus any fused multiply-add / reassociation slack,
    # far below the size of one wrong row (|w*y| ~ 1).
    bound = 2.0**-8 * np.abs(acc) * 1.01 + 1e-5 * mag + 1e-30
    err = np.abs(got - acc)
    bad = err > bound
    assert not bad.any(), (f"low_latency_combine: {bad.sum()} of {bad.size} elements off, e.g. at "
                           f"{np.argwhere(bad)[0]} got {got[bad][0]} want {acc[bad][0]}")
    # and in almost every element exactly the bf16 rounding of the float32 k-order sum
    if acc.size:
        assert (got == acc.astype(O.BF16).astype(np.float32)).mean() > 0.95


def ll_inputs(c: Case, M: int, with_stats: bool):
    idx, w = c.topk_idx(), c.topk_weights()
    rng = c.rng(5)
    x = O.make_x(rng, (c.R, c.T, c.H), O.BF16)
    y = O.make_x(rng, (c.R, c.L, c.R * M, c.H), O.BF16)  # rows past recv_count hold garbage
    stats = rng.integers(0, 1000, size=(c.R, c.L)).astype(np.int32) if with_stats else None
    return idx, w, x, y, stats


@st.composite
def ll_cases(draw, Hs=(128, 256)):
    c = draw(cases(max_T=48, Hs=Hs, max_L=3))
    M = c.T + draw(st.sampled_from([0, 0, 1, 7]))
    return c, max(M, 1)


@settings(max_examples=20, **SETTINGS)
@given(cm=ll_cases(), with_stats=st.booleans())
def test_low_latency_bf16(cm, with_stats):
    c, M = cm
    idx, w, x, y, stats = ll_inputs(c, M, with_stats)
    exp = O.low_latency_dispatch(x, idx, c.E, M, cumulative_stats=stats)
    got = run_ll(c, M, x, idx, stats, y, w)
    check_ll_common(got, exp)
    rx = got["recv_x"]
    assert rx.shape == (c.R, c.L, c.R * M, c.H) and rx.dtype == O.BF16, (rx.shape, rx.dtype)
    np.testing.assert_array_equal(rx[exp.valid].astype(np.float32), exp.recv_x[exp.valid].astype(np.float32))
    check_ll_combine(got["out"], y, idx, w, c, exp)


def check_fp8(got, exp: O.LowLatencyDispatch, c: Case, M: int, ue8m0: bool):
    q, sc = got["recv_x"]
    assert q.shape == (c.R, c.L, c.R * M, c.H) and q.dtype == O.E4M3, (q.shape, q.dtype)
    v = exp.valid
    if ue8m0:
        assert sc.shape == (c.R, c.L, c.R * M, c.H // 512) and sc.dtype == np.int32, (sc.shape, sc.dtype)
        assert_same(sc[v], exp.recv_scales_ue8m0[v], "ue8m0 scales")
        scale = O.ue8m0_unpack(sc[v])
        np.testing.assert_array_equal(scale, exp.recv_scales[v])
    else:
        assert sc.shape == (c.R, c.L, c.R * M, c.H // 128) and sc.dtype == np.float32, (sc.shape, sc.dtype)
        assert_same(sc[v], exp.recv_scales[v], "fp8 scales")
        scale = sc[v]
    deq = O.fp8_dequant(q[v], scale)
    ref = exp.recv_x[v].astype(np.float32)
    if ref.size:
        assert O.deepep_diff(deq, ref) < 1e-3
        # elementwise: within one e4m3 step of the input (relative 2^-3, subnormal step 2^-9 * scale)
        step = np.repeat(scale, 128, axis=-1)
        assert np.all(np.abs(deq - ref) <= 2.0**-3 * np.abs(ref) + 2.0**-9 * step), "fp8 values off by more than a step"


@settings(max_examples=15, **SETTINGS)
@given(cm=ll_cases(Hs=(512, 1024)), scale_mode=st.sampled_from(["plain", "round", "ue8m0"]), split=st.booleans(),
       magnitude=st.sampled_from([1.0, 1.0, 3e-2, 1e-4, 50.0]))
def test_low_latency_fp8(cm, scale_mode, split, magnitude):
    c, M = cm
    round_scale, ue8m0 = scale_mode != "plain", scale_mode == "ue8m0"
    idx, w, x, y, stats = ll_inputs(c, M, True)
    x = (x.astype(np.float32) * np.float32(magnitude)).astype(O.BF16)  # small activations: scales far below 1
    exp = O.low_latency_dispatch(x, idx, c.E, M, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0,
                                 cumulative_stats=stats)
    got = run_ll(c, M, x, idx, stats, y, w, use_fp8=True, round_scale=round_scale, ue8m0=ue8m0, split=split)
    check_ll_common(got, exp)
    check_fp8(got, exp, c, M, ue8m0)
    check_ll_combine(got["out"], y, idx, w, c, exp)


@pytest.mark.parametrize("round_scale,ue8m0", [(False, False), (True, False), (True, True)])
def test_low_latency_fp8_extreme_rows(round_scale, ue8m0):
    """Zero rows (amax clamp 1e-4), tiny and huge magnitudes, one outlier per group, amax = 448 * 2^k."""
    R, T, H, K, E, M = 2, 6, 512, 2, 4, 8
    c = Case(R, T, H, K, E, "uniform", 0.0, 0.0, seed=9)
    idx, w, x, y, stats = ll_inputs(c, M, False)
    xf = x.astype(np.float32)
    xf[0, 0] = 0
    xf[0, 1] *= 1e-6
    xf[1, 2] *= 3e4
    xf[1, 3, 5] = 1000.0
    # amax = 448 * 2^k: the scale is exactly a power of two, which round_scale must keep (not double)
    for t, amax in enumerate([3.5, 448.0, 0.4375, 7.0]):
        xf[1, 4, 128 * t] = amax if t % 2 else -amax
        xf[1, 4, 128 * t + 1 : 128 * (t + 1)] = np.clip(xf[1, 4, 128 * t + 1 : 128 * (t + 1)], -0.4, 0.4)
    x = xf.astype(O.BF16)
    exp = O.low_latency_dispatch(x, idx, E, M, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
    got = run_ll(c, M, x, idx, None, y, w, use_fp8=True, round_scale=round_scale, ue8m0=ue8m0)
    check_ll_common(got, exp)
    check_fp8(got, exp, c, M, ue8m0)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_split_equals_fused(use_fp8):
    R, T, H, K, E, M = 4, 20, 512, 4, 8, 24
    c = Case(R, T, H, K, E, "uniform", 0.2, 0.05, seed=13)
    idx, w, x, y, stats = ll_inputs(c, M, True)
    kw = dict(use_fp8=use_fp8, round_scale=use_fp8, ue8m0=use_fp8)
    fused = run_ll(c, M, x, idx, stats, y, w, split=False, **kw)
    split = run_ll(c, M, x, idx, stats, y, w, split=True, **kw)
    exp = O.low_latency_dispatch(x, idx, E, M, use_fp8=use_fp8, round_scale=use_fp8, use_ue8m0=use_fp8,
                                 cumulative_stats=stats)
    for name in ("recv_count", "src_token_index", "layout_range", "stats", "invalid_ids", "out"):
        assert_same(split[name], fused[name], name)
    v = exp.valid
    for a, b in zip(*((r["recv_x"] if use_fp8 else (r["recv_x"],)) for r in (split, fused))):
        assert_same(a[v], b[v], "recv_x (valid rows)")
    check_ll_common(split, exp)
    check_ll_combine(split["out"], y, idx, w, c, exp)


@settings(max_examples=15, **SETTINGS)
@given(cm=ll_cases(Hs=(128, 384)), split=st.booleans(), scale=st.sampled_from([1.0, 1e-30, 1e30]))
def test_low_latency_combine_logfmt(cm, split, scale):
    """compression="logfmt": every summed row within LogFMT's bound of its own (tests/oracle.py), so the output
    within sum_k |w_k| * bound(y_k) of the float32 sum, plus its bfloat16 rounding."""
    c, M = cm
    idx, w, x, y, stats = ll_inputs(c, M, False)
    y = (y.astype(np.float32) * scale).astype(O.BF16)
    exp = O.low_latency_dispatch(x, idx, c.E, M)
    got = run_ll(c, M, x, idx, None, y, w, split=split, compression="logfmt")
    check_ll_common(got, exp)
    acc, bound = O.low_latency_combine_logfmt(y, idx, w, c.E, exp)
    out = got["out"].astype(np.float64)
    bad = np.abs(out - acc) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off, e.g. got {out[bad][0]} want {acc[bad][0]}"


def small_ll_case(seed: int, R: int = 2, T: int = 8, H: int = 256, K: int = 2, E: int = 4):
    """(R, H, an xla Buffer, then idx, w, x, y per rank) of a small uniform low-latency case."""
    idx, w, x, y, _ = ll_inputs(Case(R, T, H, K, E, "uniform", 0.0, 0.0, seed=seed), T, False)
    return R, H, ll_buffer(R, T, H, E, "xla"), idx, w, x, y


def test_low_latency_combine_logfmt_sends_encoded_rows():
    R, H, buf, idx, w, x, y = small_ll_case(seed=1)

    def sent(compression):
        def body(x, idx, y, w):
            handle = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False).handle
            return jax_ep.low_latency_combine_send(buf, y, idx, w, handle, compression=compression).state[0]
        return jax.eval_shape(spmd(R, body), flat(x), flat(idx), flat(y), flat(w))

    plain, encoded = sent(None), sent("logfmt")
    assert plain.dtype == O.BF16 and plain.shape[-1] == H
    assert encoded.dtype == np.uint32 and encoded.shape[:-1] == plain.shape[:-1]
    assert encoded.shape[-1] * 4 == logfmt.bytes_per_row(H, compressed=True) < 2 * H
    with pytest.raises(ValueError, match="compression must be one of"):
        sent("zstd")


def test_low_latency_combine_logfmt_gradients_are_the_uncompressed_ones():
    """The encoding counts as the identity in the VJP: d y and d topk_weights as without compression."""
    R, H, buf, idx, w, x, y = small_ll_case(seed=3)

    def grads(compression):
        def body(x, idx, y, w):
            handle = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False).handle

            def loss(y, w):
                out = jax_ep.low_latency_combine(buf, y, idx, w, handle, compression=compression)
                return jnp.sum(out.astype(jnp.float32) * jnp.arange(H, dtype=jnp.float32))
            return jax.grad(loss, argnums=(0, 1))(y, w)
        return spmd(R, body)(flat(x), flat(idx), flat(y), flat(w))

    plain, compressed = grads(None), grads("logfmt")
    assert np.abs(np.asarray(plain[0], np.float32)).sum() > 0
    for a, b in zip(plain, compressed):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("R", [1, 8])
def test_low_latency_skewed_and_empty(R):
    H, K, E = 128, 8, 2 * R
    for T, mode in [(32, "skewed"), (32, "one_rank"), (16, "empty")]:
        M = T
        c = Case(R, T, H, K, E, mode, 0.0, 0.0, seed=R + T)
        idx, w, x, y, stats = ll_inputs(c, M, True)
        exp = O.low_latency_dispatch(x, idx, E, M, cumulative_stats=stats)
        got = run_ll(c, M, x, idx, stats, y, w)
        check_ll_common(got, exp)
        np.testing.assert_array_equal(got["recv_x"][exp.valid].astype(np.float32),
                                      exp.recv_x[exp.valid].astype(np.float32))
        check_ll_combine(got["out"], y, idx, w, c, exp)
    # T = 0 (no tokens on any rank) is rejected before anything runs.
    c = Case(R, 0, H, K, E, "uniform", 0.0, 0.0, seed=R)
    idx, w, x, y, stats = ll_inputs(c, 1, True)
    with pytest.raises(ValueError, match="low_latency_dispatch needs at least one token per rank, got 0"):
        run_ll(c, 1, x, idx, stats, y, w)


# ----------------------------------------------------------------------------------------------------------------
# Bad input: clear Python errors before anything runs
# ----------------------------------------------------------------------------------------------------------------
def test_bad_input_errors():
    R = 2
    x = np.zeros((R * 4, 128), np.float32)
    idx = np.zeros((R * 4, 2), np.int32)
    with pytest.raises((ValueError, TypeError)):  # E % R != 0
        spmd(R, lambda x, idx: jax_ep.dispatch(buffer(R, "xla"), x, idx, None, num_experts=3).recv_x)(x, idx)
    buf = ll_buffer(R, 4, 128, 4, "xla")
    with pytest.raises(ValueError):  # T > M
        xb = np.zeros((R * 5, 128), O.BF16)
        spmd(R, lambda x, idx: jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False).recv_count)(
            xb, np.zeros((R * 5, 2), np.int32))
    with pytest.raises(ValueError):  # hidden differs from the buffer's
        xb = np.zeros((R * 4, 256), O.BF16)
        spmd(R, lambda x, idx: jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False).recv_count)(xb, idx)
    with pytest.raises(ValueError):  # ue8m0 without round_scale
        xb = np.zeros((R * 4, 128), O.BF16)
        spmd(R, lambda x, idx: jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True, use_ue8m0=True).recv_count)(
            xb, idx)


# ----------------------------------------------------------------------------------------------------------------
# Masked ranks (jax_ep.masks): Buffer.mask_ranks set by hand, honoured by the xla backend's low-latency ops
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def masking_buffer(R: int, M: int, H: int, E: int) -> jax_ep.Buffer:
    return jax_ep.Buffer(mesh_of(R), "ep", backend="xla", config=jax_ep.Config(on_timeout="mask"),
                         num_max_dispatch_tokens_per_rank=M, hidden=H, num_experts=E)


@functools.cache
def masked_ll_fns(R: int, M: int, H: int, E: int):
    """The dispatch and the combine as two programs, so that masks can change between them."""
    buf = masking_buffer(R, M, H, E)

    def dispatch(x, idx):
        res = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return res.recv_x, res.recv_count, res.handle, res.num_masked[None]

    def combine(y, idx, w, handle):
        return jax_ep.low_latency_combine(buf, y, idx, w, handle)

    return spmd(R, dispatch), spmd(R, combine)


def set_masks(buf: jax_ep.Buffer, masked: np.ndarray) -> None:
    buf.unmask_ranks()
    for r in range(buf.num_ranks):
        buf.mask_ranks(np.flatnonzero(masked[r]).tolist(), on=r)


@settings(max_examples=25, **SETTINGS)
@given(cm=ll_cases(), mask_seed=st.integers(0, 2**16))
def test_low_latency_masked_ranks_match_the_oracle(cm, mask_seed):
    """Each rank's mask set by hand (any, asymmetric ones too): entries naming a masked rank's experts are not sent
    and are counted; a rank receives nothing from the ranks it masks, returns them nothing and sums nothing of
    theirs: a row travels only between ranks that mask neither one another. Ranks masked between the dispatch and
    the combine (as after a wait that timed out in between) are left out of the combine too."""
    c, M = cm
    idx, w, x, y, _ = ll_inputs(c, M, False)
    rng = np.random.default_rng(mask_seed)
    masked = rng.random((c.R, c.R)) < 0.3
    np.fill_diagonal(masked, False)
    masked_later = masked | (rng.random((c.R, c.R)) < 0.5)
    np.fill_diagonal(masked_later, False)
    buf = masking_buffer(c.R, M, c.H, c.E)
    dispatch, combine = masked_ll_fns(c.R, M, c.H, c.E)
    set_masks(buf, masked)
    # Masks change between programs, not while one runs: block before changing them (the calls are asynchronous).
    recv_x, count, handle, num_masked = jax.block_until_ready(dispatch(flat(x), flat(idx)))
    set_masks(buf, masked_later)
    out = combine(flat(y), flat(idx), flat(w), handle)
    exp = O.low_latency_dispatch(x, idx, c.E, M, masked=masked)
    split_ranks = lambda a: np.asarray(a).reshape((c.R, c.L) + np.asarray(a).shape[1:])
    assert_same(ranks(count, c.R), exp.recv_count, "recv_count")
    assert_same(split_ranks(handle.src_token_index), exp.src_token_index, "src_token_index")
    assert_same(np.asarray(num_masked), exp.num_masked, "num_masked")
    rx = split_ranks(recv_x)
    np.testing.assert_array_equal(rx[exp.valid].astype(np.float32), exp.recv_x[exp.valid].astype(np.float32))
    acc, mag = O.low_latency_combine(y, idx, w, c.E, exp, masked=masked_later)
    got = ranks(out, c.R).astype(np.float32)
    assert np.all(np.abs(got - acc) <= 2.0**-8 * np.abs(acc) * 1.01 + 1e-5 * mag + 1e-30), "masked combine"
    buf.unmask_ranks()


def test_masked_ranks_read_back_and_clear():
    """masked_ranks gives each rank's masked peers with the call they took effect at (the dispatches it had run);
    unmasking restores full results; reset_low_latency clears the masks and the calls; the ops of a Buffer without
    Config(on_timeout='mask') read no mask."""
    R, M, H, E = 4, 8, 128, 8
    c = Case(R=R, T=M, H=H, K=2, E=E, mode=O.ROUTING_MODES[0], p_neg=0.0, p_invalid=0.0, seed=5)
    idx, w, x, y, _ = ll_inputs(c, M, False)
    buf = masking_buffer(R, M, H, E)
    buf.unmask_ranks()
    dispatch, combine = masked_ll_fns(R, M, H, E)
    calls = {r: buf.backend_impl.masks.calls[r] for r in range(R)}
    jax.block_until_ready(dispatch(flat(x), flat(idx)))  # one more call on every rank
    buf.mask_ranks(2)  # every rank masks rank 2 (rank 2 itself excepted)
    buf.mask_ranks([0, 1, 3], on=2)  # rank 2 masks every other: it runs alone
    assert buf.masked_ranks() == {r: ({p: calls[r] + 1 for p in (0, 1, 3)} if r == 2 else {2: calls[r] + 1})
                                  for r in range(R)}
    masked = np.zeros((R, R), bool)
    masked[:, 2] = masked[2, :] = True
    np.fill_diagonal(masked, False)
    for masks in (masked, np.zeros((R, R), bool)):  # rank 2 out, then back in
        recv_x, count, handle, num_masked = dispatch(flat(x), flat(idx))
        out = jax.block_until_ready(combine(flat(y), flat(idx), flat(w), handle))
        exp = O.low_latency_dispatch(x, idx, E, M, masked=masks)
        assert_same(ranks(count, R), exp.recv_count, "recv_count")
        assert_same(np.asarray(num_masked), exp.num_masked, "num_masked")
        acc, mag = O.low_latency_combine(y, idx, w, E, exp, masked=masks)
        assert np.all(np.abs(ranks(out, R).astype(np.float32) - acc) <= 2.0**-8 * np.abs(acc) * 1.01 + 1e-5 * mag)
        buf.unmask_ranks()
    assert buf.masked_ranks() == {r: {} for r in range(R)}
    buf.mask_ranks(1)
    buf.reset_low_latency()  # no masks, and calls counted from 0 again
    assert buf.masked_ranks() == {r: {} for r in range(R)}
    buf.mask_ranks(1)
    assert buf.masked_ranks() == {r: ({1: 0} if r != 1 else {}) for r in range(R)}
    buf.unmask_ranks()
    plain = ll_buffer(R, M, H, E, "xla")
    with pytest.raises(ValueError, match="Config\\(on_timeout='mask'\\)"):
        plain.mask_ranks(1)
    with pytest.raises(ValueError, match="on must be EP ranks"):
        buf.mask_ranks(1, on=[R])


def test_masked_entries_get_no_gradient():
    """d topk_weights through a masked dispatch -> combine (rank 0 masks rank 1): 0 for the entries whose row
    cannot cross the mask, and the sum of the token's row (y = the dispatched rows, out = sum_k w_k * x) for the
    others."""
    R, M, H, E = 4, 8, 128, 8
    buf = masking_buffer(R, M, H, E)
    buf.unmask_ranks()
    buf.mask_ranks(1, on=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R * M, H)).astype(np.float32).astype(O.BF16)
    idx = rng.integers(0, E, (R * M, 2)).astype(np.int32)
    w = rng.random((R * M, 2)).astype(np.float32)

    def body(x, w, idx):
        def loss(w):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            return jnp.sum(jax_ep.low_latency_combine(buf, d.recv_x, idx, w, d.handle).astype(jnp.float32))
        return jax.grad(loss)(w)

    d_w = np.asarray(jax.block_until_ready(spmd(R, body)(x, w, idx)))
    buf.unmask_ranks()
    # Rank 0's entries naming rank 1's experts, and rank 1's naming rank 0's: a row crosses between ranks only
    # where neither masks the other.
    masked = np.zeros_like(idx, bool)
    masked[:M] = idx[:M] // (E // R) == 1
    masked[M:2 * M] = idx[M:2 * M] // (E // R) == 0
    assert masked[:M].any() and masked[M:2 * M].any()
    assert (d_w[masked] == 0).all()
    row_sums = np.broadcast_to(x.astype(np.float32).sum(axis=1, keepdims=True), idx.shape)
    np.testing.assert_allclose(d_w[~masked], row_sums[~masked], rtol=2e-2, atol=2e-1)
