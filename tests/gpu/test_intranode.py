"""The CUDA intranode normal mode (Buffer(backend="cuda")) against the NumPy oracle and the `xla` backend: bit
for bit for dispatch (every output, the FP8 pair, the handle), cached dispatch and combine (float32 rank-order
sums), gradients, determinism, capacity drops, T=0, DeepEP hidden sizes, the expert-major layout (dispatch,
cached dispatch and unweighted combine bit for bit, the weighted combine and gradients within a bound of the
fused multiply-adds), a jitted loop with command buffers (default flags, and forced in a subprocess), and the
bounded wait of a rank whose peers never join. Combine runs
the process model's default method (pull in one process, push across processes, or $JAX_EP_COMBINE), and both
methods explicitly (Config.combine) in the tests that name one.

Both process models run this file: one process driving every GPU (plain pytest), and one process per GPU
(test_multiprocess_gpu.py starts R processes that each run it; ranks = the process count, inputs become
global arrays and outputs are gathered to every process, so every process checks every rank).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from gpu.conftest import (RANKS_SHARE_GPUS, bounded_wait_timeout_s, gather_to_every_process, leave_together, needs_nccl,
                          one_process_gpus)
from jax_ep import _native, environment

MULTI_PROCESS = jax.process_count() > 1
RANKS = [jax.process_count()] if MULTI_PROCESS else [2, 4]
# Tests of one process driving the GPUs only: they start a single-process worker of their own, or store through
# one process's peer pointers (the store probe); test_multiprocess_gpu.py runs the multi-process counterparts.
needs_one_process = pytest.mark.skipif(MULTI_PROCESS, reason="one process driving the GPUs only (a single-process "
                                       "worker of its own, or one process's peer pointers)")


# ----------------------------------------------------------------------------------------------------------------
# Harness
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def mesh(R: int) -> Mesh:
    return Mesh(np.array(one_process_gpus(R)), ("ep",))


@functools.cache
def buffer(R: int, backend: str, combine: str | None = None) -> jax_ep.Buffer:
    """The Buffer of R ranks; `combine` ("push" or "pull") its Config.combine (None: the process model's method,
    or $JAX_EP_COMBINE)."""
    return jax_ep.Buffer(mesh(R), "ep", backend=backend, config=jax_ep.Config(combine=combine))


def spmd(R: int, body, gather: bool = True):
    """jit(shard_map(body)): every argument and result split along its leading axis over the R ranks. With one
    process per GPU, host inputs become global arrays and the results are gathered to every process (unless
    `gather` is False: a program expected to fail runs nothing after it)."""
    fn = jax.jit(jax.shard_map(body, mesh=mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    if not MULTI_PROCESS:
        return fn
    sharding = NamedSharding(mesh(R), P("ep"))

    def run(*args):
        args = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i], dtype=a.dtype),
                            args)
        out = fn(*args)
        return gather_to_every_process(out) if gather else out

    return run


def flat(a):
    """Global [R*N, ...] input from a per-rank [R, N, ...] array (None and tuples pass through)."""
    if a is None or isinstance(a, tuple):
        return a if a is None else tuple(flat(c) for c in a)
    a = np.asarray(a)
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def ranks(a, R: int):
    """Per-rank [R, N, ...] numpy view of a global [R*N, ...] output."""
    a = np.asarray(a)
    return a.reshape((R, a.shape[0] // R) + a.shape[1:])


def assert_bits(actual, expected, what: str):
    """Same shape, dtype and bytes (so -0.0 and NaN payloads count too)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    same = actual.view(np.uint8) == expected.view(np.uint8)
    if not same.all():
        bad = np.argwhere(actual != expected)[:5].tolist()
        pytest.fail(f"{what}: {np.count_nonzero(~same)} bytes differ, first elements {bad}")


def make_case(R, T, H, K, E, seed=0, mode="distinct", dtype=O.BF16, p_neg=0.1, p_invalid=0.0):
    rng = np.random.default_rng(seed)
    idx = O.make_topk_idx(rng, R, T, K, E, mode, p_neg=p_neg, p_invalid=p_invalid)
    x = O.make_fp8_pair(rng, (R, T, H)) if dtype == "fp8" else O.make_x(rng, (R, T, H), dtype)
    w = rng.standard_normal((R, T, K), dtype=np.float32)
    return x, idx, w


def dispatch_body(buf, E: int, C, alignment: int):
    """The per-rank body of the dispatch tests (here and in test_internode.py): every result of dispatch, the
    scalars as [1] arrays so that they gather over ranks. dispatch_results reads what it returns."""

    def body(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C, expert_alignment=alignment)
        scalars = (d.num_recv_tokens[None], d.num_dropped[None], d.invalid_ids[None])
        return d.recv_x, d.recv_topk_idx, d.recv_topk_weights, d.num_recv_tokens_per_expert[None], scalars, d.handle

    return body


def dispatch_results(out, R: int) -> dict:
    """dispatch_body's gathered results as NumPy, split per rank, in the oracle's field names."""
    recv_x, recv_idx, recv_w, per_expert, scalars, handle = jax.device_get(out)
    recv_x = [ranks(c, R) for c in (recv_x if isinstance(recv_x, tuple) else (recv_x,))]
    num_recv, dropped, invalid = (np.asarray(s) for s in scalars)
    return dict(recv_x=recv_x, recv_topk_idx=ranks(recv_idx, R),
                recv_topk_weights=None if recv_w is None else ranks(recv_w, R),
                num_recv_tokens=num_recv, num_recv_tokens_per_expert=np.asarray(per_expert), num_dropped=dropped,
                invalid_ids=invalid, handle=type(handle)(*(ranks(f, R) for f in handle)))


@functools.cache
def dispatch_fn(R: int, backend: str, E: int, C, alignment: int):
    return spmd(R, dispatch_body(buffer(R, backend), E, C, alignment))


def run_dispatch(R, backend, x, idx, w, E, C=None, alignment=1):
    return dispatch_results(dispatch_fn(R, backend, E, C, alignment)(flat(x), flat(idx), flat(w)), R)


def check_send_row(handle, R: int, T: int):
    """send_row[s][t, r] is the row of (s, t) on rank r (as recv_src_index says), or -1."""
    expected = np.full((R, T, R), -1, np.int32)
    for r in range(R):
        for row, src in enumerate(handle.recv_src_index[r]):
            if src < R * T:
                expected[src // T, src % T, r] = row
    assert_bits(handle.send_row, expected, "handle.send_row")


def assert_dispatch_matches_oracle(got: dict, ref):
    """Every dispatch output the oracle defines (rows, top-k, counts, drops, invalid ids), bit for bit."""
    for i, (comp, exp) in enumerate(zip(got["recv_x"], ref.recv_x)):
        assert_bits(comp, exp, f"recv_x[{i}] vs oracle")
    for name in ("recv_topk_idx", "recv_topk_weights", "num_recv_tokens", "num_recv_tokens_per_expert",
                 "num_dropped", "invalid_ids"):
        if getattr(ref, name) is not None:
            assert_bits(got[name], getattr(ref, name), f"{name} vs oracle")


def check_dispatch(R, x, idx, w, E, C=None, alignment=1):
    """CUDA dispatch == oracle == xla backend (where it can run, see needs_nccl), every output bit for bit; returns
    the CUDA result."""
    got = run_dispatch(R, "cuda", x, idx, w, E, C, alignment)
    ref = O.dispatch(x, idx, w, E, C, alignment)
    assert_dispatch_matches_oracle(got, ref)
    if not RANKS_SHARE_GPUS:
        xla = run_dispatch(R, "xla", x, idx, w, E, C, alignment)
        for i, (comp, exp) in enumerate(zip(got["recv_x"], xla["recv_x"])):
            assert_bits(comp, exp, f"recv_x[{i}] vs xla")
        assert_bits(got["handle"].recv_src_index, xla["handle"].recv_src_index, "handle.recv_src_index vs xla")
        assert_bits(got["handle"].is_token_in_rank, xla["handle"].is_token_in_rank, "handle.is_token_in_rank vs xla")
    assert_bits(got["handle"].is_token_in_rank, O.layout(idx, E).is_token_in_rank, "is_token_in_rank vs oracle")
    check_send_row(got["handle"], R, idx.shape[1])
    return got, ref


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------
# Every routing mode in BF16, every payload type with DeepEP-style routing (each case compiles two programs).
DISPATCH_CASES = [(O.BF16, mode) for mode in O.ROUTING_MODES] + [(d, "distinct") for d in (np.float32, np.float16, "fp8")]


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("dtype,mode", DISPATCH_CASES, ids=lambda v: v if isinstance(v, str) else np.dtype(v).name)
def test_dispatch_matches_oracle_and_xla(R, dtype, mode):
    T, H, K, E = 96, 256, 8, 32
    x, idx, w = make_case(R, T, H, K, E, seed=len(mode), mode=mode, dtype=dtype, p_invalid=0.02)
    check_dispatch(R, x, idx, w, E, alignment=4)


@pytest.mark.parametrize("R", RANKS)
def test_dispatch_without_weights_and_odd_shapes(R):
    """No weights; K not a power of two; T not a multiple of the warp size; E/R = 3."""
    T, H, K, E = 37, 384, 5, 3 * R
    x, idx, _ = make_case(R, T, H, K, E, seed=5, dtype=np.float32)
    check_dispatch(R, x, idx, None, E)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("C", [1, 7, 50])
def test_capacity_below_need_drops(R, C):
    T, H, K, E = 64, 128, 4, 16
    x, idx, w = make_case(R, T, H, K, E, seed=C)
    got, ref = check_dispatch(R, x, idx, w, E, C=C)
    assert got["num_dropped"].sum() > 0, "the case should drop tokens"
    need = O.routing(idx, E)[1]
    assert_bits(got["num_dropped"], np.maximum(need - C, 0).astype(np.int32), "num_dropped = need - C")


@pytest.mark.parametrize("R", RANKS)
def test_strict_raises_on_drops(R):
    T, H, K, E = 32, 128, 4, 16
    x, idx, _ = make_case(R, T, H, K, E, seed=1, p_neg=0.0)
    buf = buffer(R, "cuda")
    body = lambda x, idx: jax_ep.dispatch(buf, x, idx, num_experts=E, max_recv_tokens=1, strict=True).recv_x
    with pytest.raises(Exception, match="(?i)drop|fit|max_recv_tokens"):
        jax.block_until_ready(spmd(R, body)(flat(x), flat(idx)))
    # The failure stays in JAX's runtime token of these devices (re-raised at exit) until a later strict run
    # on them succeeds.
    ok = lambda x, idx: jax_ep.dispatch(buf, x, idx, num_experts=E, strict=True).recv_x
    jax.block_until_ready(spmd(R, ok)(flat(x), flat(idx)))
    jax.effects_barrier()


@pytest.mark.parametrize("backend", ["cuda", "xla"])
def test_zero_tokens_rejected(backend):
    x, idx, w = make_case(2, 0, 256, 8, 32)
    with pytest.raises(ValueError, match="dispatch needs at least one token per rank, got 0"):
        run_dispatch(2, backend, x, idx, w, 32)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("H", [1536, 2048, 2560, 4096, 5120, 7168, 8192])
def test_deepep_hidden_sizes(R, H):
    T, K, E = 24, 8, 64
    for dtype in (O.BF16, "fp8"):
        x, idx, w = make_case(R, T, H, K, E, seed=H, dtype=dtype)
        check_dispatch(R, x, idx, w, E)
    check_combine(R, T, H, K, E, O.BF16, with_bias=False)


# ----------------------------------------------------------------------------------------------------------------
# Cached dispatch and combine
# ----------------------------------------------------------------------------------------------------------------
def combine_body(buf, E: int, C, with_bias: bool):
    """The per-rank body of the combine tests (here and in test_internode.py): dispatch, a cached dispatch of x2
    by its handle, and combine of y (with the combined weights)."""

    def body(x, idx, w, x2, y, bias):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C)
        cached = jax_ep.dispatch(buf, x2, handle=d.handle).recv_x
        c = jax_ep.combine(buf, y, d.handle, topk_weights=d.recv_topk_weights, bias=bias if with_bias else None)
        return cached, c.x, c.topk_weights

    return body


@functools.cache
def combine_fn(R: int, backend: str, E: int, with_bias: bool, C=None, method=None):
    return spmd(R, combine_body(buffer(R, backend, method if backend == "cuda" else None), E, C, with_bias))


def run_combine(R, backend, E, x, idx, w, x2, y, bias, C=None, method=None):
    out = combine_fn(R, backend, E, bias is not None, C, method)(flat(x), flat(idx), flat(w), flat(x2), flat(y),
                                                                 flat(bias))
    return [ranks(a, R) for a in jax.device_get(out)]


def check_combine(R, T, H, K, E, dtype, with_bias, seed=0, C=None, method=None):
    """Cached dispatch and combine (with the combined weights) of the cuda backend == oracle == xla backend, bit
    for bit; capacity C (default R*T); the cuda combine by `method` (default: the process model's)."""
    x, idx, w = make_case(R, T, H, K, E, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    x2 = O.make_x(rng, (R, T, 2 * H), np.float32)  # cached dispatch of another width and dtype
    y = O.make_x(rng, (R, R * T if C is None else C, H), dtype)
    bias = O.make_x(rng, (R, T, H), np.float32) if with_bias else None
    cached, out, weights = run_combine(R, "cuda", E, x, idx, w, x2, y, bias, C, method)
    ref = O.dispatch(x, idx, w, E, C)
    assert_bits(cached, O.cached_dispatch(x2, ref.routing)[0], "cached dispatch vs oracle")
    exp_out, exp_w = O.combine(y, ref.routing, ref.recv_topk_weights, bias)
    assert_bits(out, exp_out, "combine vs oracle")
    assert_bits(weights, exp_w, "combined topk_weights vs oracle")
    if not RANKS_SHARE_GPUS:
        xla = run_combine(R, "xla", E, x, idx, w, x2, y, bias, C)
        for name, a, b in zip(("cached dispatch", "combine", "combined weights"), (cached, out, weights), xla):
            assert_bits(a, b, f"{name} vs xla")


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("dtype", [O.BF16, np.float32, np.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_cached_dispatch_and_combine(R, dtype, with_bias):
    check_combine(R, 80, 512, 6, 8 * R, dtype, with_bias, seed=R)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("method", ["push", "pull"])
@pytest.mark.parametrize("dtype,with_bias,C", [(O.BF16, True, None), (np.float32, False, 50)],
                         ids=["bf16-bias", "f32-drops"])
def test_combine_push_and_pull(R, method, dtype, with_bias, C):
    """Both combine methods in either process model. T and K odd; 1-2 KiB rows, so that a push unit spans
    dozens of rows and some units hold rows of two home ranks; the float32 weights rows (20 bytes) move one
    element per lane; C=50 drops tokens (the handle's rows of dropped tokens are -1 on both sides)."""
    check_combine(R, 77, 512, 5, 8 * R, dtype, with_bias, seed=7, C=C, method=method)


@pytest.mark.skipif(not MULTI_PROCESS, reason="a group spanning processes stages what its peers read (one process "
                    "pulls from XLA's buffers in place)")
def test_push_combine_runs_in_a_buffer_sized_for_pushing():
    """A Buffer of num_nvl_bytes = normal_buffer_bytes(..., combine="push") and Config(combine="push") combines: the
    combine's push reaches the kernel (one that pulled would stage all R*T float32 rows of y, more than it holds)."""
    R = jax.process_count()
    T, H, K, E = 64, 512, 4, 8 * R
    nbytes = jax_ep.normal_buffer_bytes(T, H, R, K, combine="push")
    assert nbytes < jax_ep.normal_buffer_bytes(T, H, R, K, combine="pull"), "these sizes must tell push from pull"
    x, idx, _ = make_case(R, T, H, K, E, seed=5, dtype=O.BF16)
    y = O.make_x(np.random.default_rng(6), (R, R * T, H), np.float32)
    with jax_ep.Buffer(mesh(R), "ep", backend="cuda", config=jax_ep.Config(combine="push"),
                       num_nvl_bytes=nbytes) as buf:
        def body(x, idx, y):
            return jax_ep.combine(buf, y, jax_ep.dispatch(buf, x, idx, num_experts=E).handle).x

        out = ranks(jax.device_get(spmd(R, body)(flat(x), flat(idx), flat(y))), R)
    assert_bits(out, O.combine(y, O.dispatch(x, idx, None, E).routing)[0], "push combine vs oracle")


@needs_nccl
@pytest.mark.parametrize("R", RANKS)
def test_handles_swap_between_backends(R):
    """The xla backend combines along a cuda handle; the cuda backend's cached dispatch follows an xla handle."""
    T, H, K, E = 40, 256, 4, 16
    x, idx, w = make_case(R, T, H, K, E, seed=11, dtype=np.float32)
    y = O.make_x(np.random.default_rng(2), (R, R * T, H), np.float32)
    cuda, xla = buffer(R, "cuda"), buffer(R, "xla")

    def body(x, idx, y):
        cuda_handle = jax_ep.dispatch(cuda, x, idx, num_experts=E).handle
        xla_handle = jax_ep.dispatch(xla, x, idx, num_experts=E).handle
        return jax_ep.combine(xla, y, cuda_handle).x, jax_ep.dispatch(cuda, x, handle=xla_handle).recv_x

    out, cached = (ranks(a, R) for a in jax.device_get(spmd(R, body)(flat(x), flat(idx), flat(y))))
    ref = O.dispatch(x, idx, None, E)
    assert_bits(out, O.combine(y, ref.routing)[0], "xla combine along the cuda handle")
    assert_bits(cached, ref.recv_x[0], "cuda cached dispatch along the xla handle")


# ----------------------------------------------------------------------------------------------------------------
# Expert-major layout (dispatch(..., layout="expert_major"): rows are received (token, local expert) pairs)
# ----------------------------------------------------------------------------------------------------------------
# The routing of these tests: uniform ids, so that many tokens name an expert twice or more (one pair, whose weight
# is the sum of those entries'), with -1 entries and a few invalid ids. E = 32: 16 local experts on 2 ranks, 8 on 4.
EM_T, EM_H, EM_K, EM_E = 48, 256, 8, 32


def sum_tolerance(magnitude, roundings: int):
    """How far apart two float32 evaluations of one sum of terms may be, whatever their order of additions and
    whether a product is rounded on its own or fused into the addition that takes it (a fused multiply-add, which
    XLA on GPUs may emit; docs/design.md "Expert-major layout"): each is within gamma_n * magnitude of the exact
    sum, gamma_n = n u / (1 - n u), u = 2**-24, where magnitude is the sum of the terms' |values| and n the most
    roundings on any term's way into the result (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1 and
    4.2). The tests use it where the oracle rounds each product first and the GPU may fuse it: a last-bit
    difference in a partial sum that the later additions carry, often 2 ulps of the result. Simulated in NumPy
    (the weighted combine of these tests' cases, products fused, 1.5 million elements), the largest difference
    was 0.96 of 2**-22 * magnitude (two ulps of a result near the magnitude: too tight a bound) and 0.15 of this
    one (K=8, R=2 and 4). A wrong row, weight or pair would be off by about the magnitude itself."""
    u, n = 2.0**-24, roundings
    return 2 * n * u / (1 - n * u) * np.asarray(magnitude, np.float64)


def weighted_roundings(R: int, K: int) -> int:
    """n of sum_tolerance for an expert-major weighted sum: the product, one addition per pair of the token on its
    rank (at most K), then at most R + 1 additions over the ranks (intranode: R; internode: P per node and then N
    nodes)."""
    return 1 + K + R + 1


def em_case(R, dtype, seed, T=EM_T, H=EM_H, K=EM_K, E=EM_E):
    """x, topk_idx, topk_weights of the expert-major tests (the routing above)."""
    return make_case(R, T, H, K, E, seed=seed, mode="uniform", dtype=dtype, p_neg=0.15, p_invalid=0.02)


def repeats_an_expert(idx, E) -> bool:
    """Whether some token names a valid expert twice."""
    ids = np.sort(np.where((idx >= 0) & (idx < E), idx, -1), axis=-1)
    return bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any())


def assert_within(actual, expected, bound, what: str):
    """Same shape and dtype, |actual - expected| <= bound per element (NaN fails; a bound of 0 asks for equality)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    err = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    bad = ~(err <= np.broadcast_to(np.asarray(bound, np.float64), err.shape))
    if bad.any():
        first = np.argwhere(bad)[:5].tolist()
        pytest.fail(f"{what}: {np.count_nonzero(bad)} elements beyond the bound, first {first}: "
                    f"{[(float(actual[tuple(i)]), float(expected[tuple(i)])) for i in first]}")


def em_dispatch_body(buf, E: int, C, alignment: int):
    """The per-rank body of the expert-major dispatch tests (here and in test_internode.py): every result but the
    handle, the scalars as [1] arrays so that they gather over ranks. em_dispatch_results reads what it returns."""

    def body(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C, expert_alignment=alignment,
                            layout="expert_major")
        assert isinstance(d, jax_ep.ExpertMajorDispatchResult), type(d)
        scalars = (d.num_recv_tokens[None], d.num_dropped[None], d.invalid_ids[None])
        return d.recv_x, d.recv_weights, d.num_recv_tokens_per_expert, d.expert_offsets, scalars

    return body


def em_dispatch_results(out, R: int) -> dict:
    """em_dispatch_body's gathered results as NumPy, split per rank, in the oracle's field names."""
    recv_x, recv_w, sizes, offsets, scalars = jax.device_get(out)
    recv_x = [ranks(c, R) for c in (recv_x if isinstance(recv_x, tuple) else (recv_x,))]
    num_recv, dropped, invalid = (np.asarray(s) for s in scalars)
    return dict(recv_x=recv_x, recv_weights=None if recv_w is None else ranks(recv_w, R), num_recv_tokens=num_recv,
                num_recv_tokens_per_expert=ranks(sizes, R), expert_offsets=ranks(offsets, R), num_dropped=dropped,
                invalid_ids=invalid)


EM_DISPATCH_FIELDS = ("recv_weights", "num_recv_tokens", "num_recv_tokens_per_expert", "expert_offsets",
                      "num_dropped", "invalid_ids")


def blank_past_groups(rows, sizes, offsets):
    """rows [R, C, ...] with each rank's rows past its last group (offset + size of its last expert) zeroed: the cuda
    kernels leave them unwritten (docs/design.md, "Expert-major layout"), the oracle and the xla backend zero them."""
    rows = np.array(rows)
    for r, end in enumerate(np.asarray(offsets)[:, -1].astype(np.int64) + np.asarray(sizes)[:, -1]):
        rows[r, end:] = 0
    return rows


def assert_em_dispatch_equal(got: dict, ref, what: str):
    """Every expert-major dispatch output (ref: the oracle's ExpertMajorDispatch, or another backend's dict), bit
    for bit."""
    field = (lambda name: ref[name]) if isinstance(ref, dict) else (lambda name: getattr(ref, name))
    assert len(got["recv_x"]) == len(field("recv_x")), what
    groups = (field("num_recv_tokens_per_expert"), field("expert_offsets"))
    for i, (comp, exp) in enumerate(zip(got["recv_x"], field("recv_x"))):
        assert_bits(blank_past_groups(comp, *groups), exp, f"expert-major recv_x[{i}] vs {what}")
    for name in EM_DISPATCH_FIELDS:
        if field(name) is None:
            assert got[name] is None, f"expert-major {name}: expected None"
        else:
            assert_bits(got[name], field(name), f"expert-major {name} vs {what}")


@functools.cache
def em_dispatch_fn(R: int, backend: str, E: int, C, alignment: int):
    return spmd(R, em_dispatch_body(buffer(R, backend), E, C, alignment))


def check_em_dispatch(R, x, idx, w, E, C=None, alignment=1):
    """Expert-major dispatch of the cuda backend == oracle == xla backend (where it can run), every output bit for
    bit; returns (the cuda result, the oracle's)."""
    got = em_dispatch_results(em_dispatch_fn(R, "cuda", E, C, alignment)(flat(x), flat(idx), flat(w)), R)
    ref = O.expert_major_dispatch(x, idx, w, E, C, alignment)
    assert_em_dispatch_equal(got, ref, "oracle")
    if not RANKS_SHARE_GPUS:
        xla = em_dispatch_results(em_dispatch_fn(R, "xla", E, C, alignment)(flat(x), flat(idx), flat(w)), R)
        assert_em_dispatch_equal(got, xla, "xla")
    assert buffer(R, "cuda").errors() == []
    return got, ref


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("dtype,alignment", [(O.BF16, 1), (O.BF16, 8), ("fp8", 1), ("fp8", 8)],
                         ids=["bf16-align1", "bf16-align8", "fp8-align1", "fp8-align8"])
def test_expert_major_dispatch_matches_oracle(R, dtype, alignment):
    """Rows grouped by local expert, a pair per (token, expert) however often the token names it (its weights
    summed), padding rows between the groups with alignment 8, both arrays of the FP8 pair; never drops."""
    x, idx, w = em_case(R, dtype, seed=alignment)
    assert repeats_an_expert(idx, EM_E) and (idx == -1).any(), "the case should repeat experts and have -1 entries"
    got, _ = check_em_dispatch(R, x, idx, w, EM_E, alignment=alignment)
    assert not got["num_dropped"].any(), "the default capacity never drops"


@pytest.mark.parametrize("R", RANKS)
def test_expert_major_dispatch_drops(R):
    check_em_drops(R, functools.partial(check_em_dispatch, R))


def check_em_drops(R, check):
    """check(x, idx, w, E, C=, alignment=): the expert-major dispatch against the oracle. max_recv_tokens=100 below
    the pairs (about 300 per rank): rows past C are dropped, a group straddles C and the later ones are dropped
    whole; group sizes and offsets are not clipped to C."""
    C = 100
    x, idx, w = em_case(R, O.BF16, seed=13)
    got, _ = check(x, idx, w, EM_E, C=C, alignment=8)
    assert got["num_dropped"].sum() > 0, "the case should drop pairs"
    assert (got["expert_offsets"][:, -1] + got["num_recv_tokens_per_expert"][:, -1] > C).any()


def em_combine_body(buf, E: int, C, alignment: int):
    """The per-rank body of the expert-major combine tests (here and in test_internode.py): dispatch, a cached
    dispatch of x2 along its handle, the unweighted combine of y with a bias, the combine of y32 weighted by
    recv_weights."""

    def body(x, idx, w, x2, y, bias, y32):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C, expert_alignment=alignment,
                            layout="expert_major")
        cached = jax_ep.dispatch(buf, x2, handle=d.handle).recv_x
        plain = jax_ep.combine(buf, y, d.handle, bias=bias)
        weighted = jax_ep.combine(buf, y32, d.handle, weights=d.recv_weights)
        assert plain.topk_weights is None and weighted.topk_weights is None
        return d.recv_x, d.recv_weights, cached, plain.x, weighted.x

    return body


def em_combine_inputs(R, dtype, seed, C=None, alignment=1, T=EM_T, H=EM_H, K=EM_K, E=EM_E):
    """x, idx, w (BF16 rows, the routing above), x2 (float32 [T, 2H]: a cached dispatch of another width and
    dtype), y ([C, H] in `dtype`), bias (float32 [T, H]), y32 (float32 [C, H]), per rank."""
    x, idx, w = em_case(R, O.BF16, seed, T, H, K, E)
    rng = np.random.default_rng(seed + 1)
    capacity = O.expert_major_capacity(R, T, K, E // R, alignment) if C is None else C
    x2 = O.make_x(rng, (R, T, 2 * H), np.float32)
    y = O.make_x(rng, (R, capacity, H), dtype)
    bias = O.make_x(rng, (R, T, H), np.float32)
    y32 = O.make_x(rng, (R, capacity, H), np.float32)
    return x, idx, w, x2, y, bias, y32


def check_em_combine(got, inputs, E, C, alignment, ranks_per_node=None):
    """em_combine_body's results (per rank) against the oracle: dispatch, cached dispatch and the unweighted
    combine bit for bit, the weighted combine within sum_tolerance (in the internode order with ranks_per_node)."""
    recv_x, recv_w, cached, plain, weighted = got
    x, idx, w, x2, y, bias, y32 = inputs
    ref = O.expert_major_dispatch(x, idx, w, E, C, alignment)
    groups = (ref.num_recv_tokens_per_expert, ref.expert_offsets)
    assert_bits(blank_past_groups(recv_x, *groups), ref.recv_x[0], "expert-major recv_x vs oracle")
    assert_bits(recv_w, ref.recv_weights, "expert-major recv_weights vs oracle")
    assert_bits(blank_past_groups(cached, *groups), O.expert_major_cached_dispatch(x2, ref.routing)[0],
                "expert-major cached dispatch vs oracle")
    assert_bits(plain, O.expert_major_combine(y, ref.routing, bias=bias, ranks_per_node=ranks_per_node),
                "unweighted expert-major combine (+ bias) vs oracle")
    expected = O.expert_major_combine(y32, ref.routing, weights=ref.recv_weights, ranks_per_node=ranks_per_node)
    magnitude = O.expert_major_combine(np.abs(y32), ref.routing, weights=np.abs(ref.recv_weights),
                                       ranks_per_node=ranks_per_node)  # sum of |w * y| per element
    R, _, K = idx.shape
    assert_within(weighted, expected, sum_tolerance(magnitude, weighted_roundings(R, K)),
                  "weighted expert-major combine vs oracle")


@functools.cache
def em_combine_fn(R: int, E: int, C, alignment: int):
    return spmd(R, em_combine_body(buffer(R, "cuda"), E, C, alignment))


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("dtype,C,alignment", [(O.BF16, None, 1), (np.float32, 100, 8)],
                         ids=["bf16", "f32-drops-align8"])
def test_expert_major_cached_dispatch_and_combine(R, dtype, C, alignment):
    """Cached dispatch along an expert-major handle; combine, unweighted (with a bias) and weighted by
    recv_weights; with drops, dropped pairs add nothing (a token may have no kept pair at all)."""
    inputs = em_combine_inputs(R, dtype, seed=R + alignment, C=C, alignment=alignment)
    got = em_combine_fn(R, EM_E, C, alignment)(*(flat(a) for a in inputs))
    check_em_combine([ranks(a, R) for a in jax.device_get(got)], inputs, EM_E, C, alignment)
    assert buffer(R, "cuda").errors() == []


def em_grad_body(buf, E: int):
    """The per-rank body of the expert-major gradient tests (here and in test_internode.py): d x, d topk_weights of
    sum(combine(recv_x, weights=recv_weights).x * g_out)."""

    def loss(x, w, idx, g_out):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, layout="expert_major")
        return jnp.sum(jax_ep.combine(buf, d.recv_x, d.handle, weights=d.recv_weights).x * g_out)

    def body(x, w, idx, g_out):
        return jax.grad(loss, argnums=(0, 1))(x, w, idx, g_out)

    return body


def check_em_grads(d_x, d_w, x, w, idx, g_out, E, ranks_per_node=None):
    """em_grad_body's gradients (float32, per rank) against the oracle's VJPs.

    d x[t] = the unweighted combine of the rows' cotangents recv_weights[row] * g_out[t], products that XLA may
    fuse into the sum as in the weighted combine: within sum_tolerance of sum |w * g_out|; in the internode order
    with ranks_per_node (the oracle's unweighted combine of those rows). d topk_weights[t, k] = the float32 dot
    of g_out[t] with the pair's row (x[t]) over H, added in an order XLA chooses (the oracle rounds the exact
    dot once): within sum_tolerance of sum_h |g_out * x| with n = H; entries of no pair (-1, invalid ids) are
    exactly 0."""
    ref = O.expert_major_dispatch(x, idx, w, E)
    g_y, g_weights = O.expert_major_combine_vjp(ref.routing, g_out, ref.recv_x[0], ref.recv_weights, np.float32)[:2]
    exp_dx, exp_dw = O.expert_major_dispatch_vjp(ref.routing, idx, E, g_y, g_weights, np.float32)
    if ranks_per_node is not None:
        exp_dx = O.expert_major_combine(g_y, ref.routing, ranks_per_node=ranks_per_node)
    R, _, K = idx.shape
    magnitude = O.expert_major_combine(np.abs(g_y), ref.routing)  # sum of |w * g_out| per element
    assert_within(d_x, exp_dx, sum_tolerance(magnitude, weighted_roundings(R, K)), "d x vs oracle")
    dot_magnitude = np.sum(np.abs(g_out.astype(np.float64)) * np.abs(x.astype(np.float64)), axis=-1)  # [R, T]
    valid = (idx >= 0) & (idx < E)
    bound = np.where(valid, sum_tolerance(dot_magnitude, x.shape[-1])[..., None], 0.0)
    assert_within(d_w, exp_dw, bound, "d topk_weights vs oracle")


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("K", [EM_K, 6])
def test_expert_major_gradients_match_oracle(R, K):
    """d x: the combine of the rows' cotangents (weight * g_out); d topk_weights: each pair's cotangent on every
    entry naming its expert (duplicates included), 0 on -1 and invalid entries. With K = 6 the top-k cotangents
    come home through the combine kernel as rows of 24 bytes (no whole 16-byte vectors: its element path)."""
    x, idx, w = em_case(R, np.float32, seed=3, K=K)
    g_out = O.make_x(np.random.default_rng(4), (R, EM_T, EM_H), np.float32)
    got = spmd(R, em_grad_body(buffer(R, "cuda"), EM_E))(flat(x), flat(w), flat(idx), flat(g_out))
    d_x, d_w = (ranks(a, R) for a in jax.device_get(got))
    check_em_grads(d_x, d_w, x, w, idx, g_out, EM_E)
    assert buffer(R, "cuda").errors() == []


@pytest.mark.parametrize("R", RANKS)
def test_expert_major_repeated_runs_identical(R):
    """The same jitted expert-major dispatch, cached dispatch and combines, run again: the same bits (the
    weighted combine too: one compiled program always fuses the same way)."""
    check_em_repeated_runs(R, lambda E, alignment: em_combine_fn(R, E, None, alignment))
    assert buffer(R, "cuda").errors() == []


def check_em_repeated_runs(R, make_fn):
    """make_fn(E, alignment): the jitted expert-major dispatch, cached dispatch and combines (em_combine_body), run
    four times on the same inputs: the same bits each time."""
    T, H, K, E, alignment = 64, 512, 8, 32, 8
    inputs = em_combine_inputs(R, O.BF16, seed=9, alignment=alignment, T=T, H=H, K=K, E=E)
    ref = O.expert_major_dispatch(*inputs[:3], E, None, alignment)
    groups = (ref.num_recv_tokens_per_expert, ref.expert_offsets)
    fn = make_fn(E, alignment)
    args = tuple(flat(a) for a in inputs)

    def run():  # the rows past the groups are unspecified on cuda, not part of the result
        recv_x, recv_w, cached, plain, weighted = (ranks(a, R) for a in jax.device_get(fn(*args)))
        return blank_past_groups(recv_x, *groups), recv_w, blank_past_groups(cached, *groups), plain, weighted

    first = run()
    for i in range(3):
        names = ("recv_x", "recv_weights", "cached dispatch", "combine", "weighted combine")
        for name, a, b in zip(names, run(), first):
            assert_bits(a, b, f"run {i}: {name}")


# ----------------------------------------------------------------------------------------------------------------
# Gradients, determinism, loops
# ----------------------------------------------------------------------------------------------------------------
# The gradient tests' loss: sum(combine(3 recv_x, weights 2 recv_topk_weights, bias).x * g_out + its weights * g_w).
RECV_X_SCALE, RECV_WEIGHTS_SCALE = 3, 2


@functools.cache
def grad_fn(R: int, backend: str, E: int):
    buf = buffer(R, backend)

    def loss(x, w, bias, idx, g_out, g_w):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
        c = jax_ep.combine(buf, d.recv_x * RECV_X_SCALE, d.handle, topk_weights=d.recv_topk_weights * RECV_WEIGHTS_SCALE,
                           bias=bias)
        return jnp.sum(c.x.astype(jnp.float32) * g_out) + jnp.sum(c.topk_weights * g_w)

    def body(x, w, bias, idx, g_out, g_w):
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, bias, idx, g_out, g_w)

    return spmd(R, body)


def oracle_grads(x, w, idx, g_out, g_w, E, bias_dtype):
    """grad_fn's gradients from the oracle's VJPs: the output cotangent in the output's dtype, combine's VJP (a
    cached dispatch), the scales, dispatch's VJP (a combine)."""
    ref = O.dispatch(x, idx, w, E)
    g_c = g_out.astype(x.dtype)
    g_y, g_recv_w, g_bias = O.combine_vjp(ref.routing, g_c, g_w, x.dtype, bias_dtype)
    g_recv_x = (g_y.astype(np.float32) * RECV_X_SCALE).astype(x.dtype)
    dx, dw = O.dispatch_vjp(ref.routing, ref.recv_topk_idx, g_recv_x, g_recv_w * np.float32(RECV_WEIGHTS_SCALE),
                            x.dtype)
    return dx, dw, g_bias


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("dtype", [O.BF16, np.float32], ids=["bf16", "f32"])
def test_gradients_match_oracle_and_xla(R, dtype):
    T, H, K, E = 48, 256, 8, 32
    x, idx, w = make_case(R, T, H, K, E, seed=3, dtype=dtype)
    rng = np.random.default_rng(4)
    bias = O.make_x(rng, (R, T, H), dtype)
    g_out, g_w = O.make_x(rng, (R, T, H), np.float32), O.make_x(rng, (R, T, K), np.float32)
    args = tuple(flat(a) for a in (x, w, bias, idx, g_out, g_w))
    got = [ranks(a, R) for a in jax.device_get(grad_fn(R, "cuda", E)(*args))]
    for name, a, b in zip(("d x", "d topk_weights", "d bias"), got, oracle_grads(x, w, idx, g_out, g_w, E, dtype)):
        assert_bits(a, b, f"{name} vs oracle")
    if not RANKS_SHARE_GPUS:
        ref = [ranks(a, R) for a in jax.device_get(grad_fn(R, "xla", E)(*args))]
        for name, a, b in zip(("d x", "d topk_weights", "d bias"), got, ref):
            assert_bits(a, b, f"{name} vs xla")


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("method", ["pull", "push"])
def test_repeated_runs_identical(R, method):
    T, H, K, E = 128, 1024, 8, 64
    x, idx, w = make_case(R, T, H, K, E, seed=9)
    y = O.make_x(np.random.default_rng(1), (R, R * T, H), O.BF16)
    fn = combine_fn(R, "cuda", E, False, None, method)
    args = tuple(flat(a) for a in (x, idx, w, x, y, None))
    first = jax.device_get(fn(*args))
    for i in range(10):
        for name, a, b in zip(("cached", "combine", "weights"), jax.device_get(fn(*args)), first):
            assert_bits(a, b, f"run {i}: {name}")
    assert buffer(R, "cuda", method).errors() == []


@needs_one_process
@pytest.mark.skipif(not _native.with_instrumentation(),
                    reason="the store probe is built with the benchmarks' instrumentation only (JAX_EP_INSTRUMENT=ON)")
@pytest.mark.parametrize("R", RANKS)
def test_store_probe_writes_every_peer(R):
    """The benchmark's store-ceiling probe: region s of rank r's output holds what rank s stored, 16-byte
    unit i = (i, s, 0, 0), for every peer s != r."""
    units = 4096
    kernels = buffer(R, "cuda").backend_impl
    body = lambda token: kernels.store_probe(token, bytes_per_peer=units * 16)
    out = ranks(jax.device_get(spmd(R, body)(np.zeros((R,), np.int32))), R).view(np.uint32).reshape(R, R, units, 4)
    for r in range(R):
        for s in range(R):
            if s != r:
                expected = np.stack([np.arange(units), np.full(units, s), np.zeros(units), np.zeros(units)], axis=1)
                assert_bits(out[r, s], expected.astype(np.uint32), f"rank {r}, region of peer {s}")


def loop_fn(R: int, backend: str, E: int, steps: int):
    """`steps` dispatch + combine rounds inside one jitted lax.fori_loop (combine(recv_x / 2) feeds the next)."""
    buf = buffer(R, backend)

    def body(x, idx, w):
        def step(_, x):
            d = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
            return jax_ep.combine(buf, d.recv_x * 0.5, d.handle).x

        return jax.lax.fori_loop(0, steps, step, x)

    return spmd(R, body)


def check_loop(R: int, steps: int = 20):
    T, H, K, E = 64, 256, 4, 16
    x, idx, w = make_case(R, T, H, K, E, seed=21, dtype=np.float32, p_neg=0.3)
    got = jax.device_get(loop_fn(R, "cuda", E, steps)(flat(x), flat(idx), flat(w)))
    expected = x
    for _ in range(steps):
        ref = O.dispatch(expected, idx, w, E)
        expected = O.combine(ref.recv_x[0] * np.float32(0.5), ref.routing)[0]
    assert_bits(ranks(got, R), expected, f"{steps} jitted dispatch+combine steps vs oracle")
    assert buffer(R, "cuda").errors() == []


@pytest.mark.parametrize("R", RANKS)
def test_jitted_loop_default_flags(R):
    check_loop(R)


def run_worker(mode: str, R: int, xla_flags: str | None = None, script: str = __file__,
               env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """A test file as a script in a fresh process (XLA_FLAGS apply at backend start; a trap kills the CUDA
    context), with `env_extra` added to its environment."""
    mesh(R)  # skips without R GPUs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env_extra or {}))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run([sys.executable, script, mode, str(R)], env=env, capture_output=True, text=True,
                          timeout=300)


# Every op captured into CUDA graphs, loops included (test_multiprocess_gpu.py runs the loops so as R processes).
FORCED_COMMAND_BUFFER_FLAGS = ("--xla_gpu_graph_min_graph_size=1 "
                               "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL")


@needs_one_process
@pytest.mark.parametrize("R", RANKS)
def test_jitted_loop_forced_command_buffers(R):
    """Every op captured into CUDA graphs (min graph size 1, loops included): the call sequence lives on the
    device, so replay stays correct; with either combine method (the push combine's flags and token tickets
    live on the device too)."""
    for method in ("pull", "push"):
        proc = run_worker("loop", R, FORCED_COMMAND_BUFFER_FLAGS, env_extra={environment.COMBINE: method})
        assert proc.returncode == 0 and "LOOP OK" in proc.stdout, (method, proc.stdout[-3000:] + proc.stderr[-3000:])


@needs_one_process
@pytest.mark.parametrize("R", RANKS)
def test_rank_that_never_joins_times_out(R):
    """Only rank 0 calls dispatch: it waits its timeout for the others, records which op and peer, and traps;
    the error reaches Python and the record names the op and the ranks."""
    proc = run_worker("timeout", R)
    assert "RAISED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = [line for line in proc.stdout.splitlines() if line.startswith("RECORD")]
    assert record and "dispatch timed out on rank 0" in record[0] and "waiting for rank" in record[0], proc.stdout


def timeout_worker(R: int):
    """Rank 0 alone runs a dispatch (see report_timeout)."""
    buf = jax_ep.Buffer(mesh(R), "ep", backend="cuda", config=jax_ep.Config(timeout_s=bounded_wait_timeout_s()))
    x, idx, _ = make_case(R, 16, 128, 2, 2 * R)

    def body(x, idx):
        # A while loop with a rank-dependent trip count (1 on rank 0, else 0): unlike a cond, XLA cannot turn it
        # into a select that runs the op everywhere; the op's input depends on the carry so it is not hoisted.
        def step(_, total):
            dependent_idx = idx + (total.astype(jnp.float32) * 0).astype(jnp.int32)
            return total + jax_ep.dispatch(buf, x, dependent_idx, num_experts=2 * R).num_recv_tokens

        trips = (jax.lax.axis_index("ep") == 0).astype(jnp.int32)
        return jax.lax.fori_loop(0, trips, step, idx[0, 0] * 0)[None]

    report_timeout(lambda: spmd(R, body)(flat(x), flat(idx)), buf)


def report_timeout(run, buf):
    """Runs `run()`, which should fail: prints RAISED and the time it took, then the Buffer's timeout records;
    exits without teardown (the trapped GPU's context is dead), with one process per rank once every process
    is done."""
    start = time.perf_counter()
    try:
        jax.block_until_ready(run())
        print("NO ERROR", flush=True)
    except Exception as err:  # noqa: BLE001 - any XLA runtime error is the expected outcome
        print(f"RAISED after {time.perf_counter() - start:.1f} s: {str(err)[:300]}", flush=True)
    for line in buf.errors():
        print("RECORD", line, flush=True)
    if MULTI_PROCESS:
        leave_together(0)
    os._exit(0)


if __name__ == "__main__":  # run_worker's subprocess
    mode, num_ranks = sys.argv[1], int(sys.argv[2])
    if mode == "loop":
        check_loop(num_ranks)
        print("LOOP OK")
    else:
        timeout_worker(num_ranks)
