"""What the GPU suites share (test_intranode, test_internode, test_low_latency, test_multiprocess_gpu, and the
bounded waits of tests/worker.py): the rank counts of the process model this process runs in, byte-exact
comparison, the inputs of the normal and the low-latency tests, and the per-rank bodies and checks that the
intranode and internode suites both run against the NumPy oracle (normal and expert-major layout). The mesh,
jit(shard_map) and the Buffers are every suite's: tests/conftest.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import flat, ranks, spmd
from process_harness import run_in_fresh_process

import jax_ep
from jax_ep import _native

MULTI_PROCESS = jax.process_count() > 1
RANKS = [jax.process_count()] if MULTI_PROCESS else [2, 4]
# Tests of one process driving the GPUs only: they start a fresh one-process worker of their own, or store through
# one process's peer pointers (the store probe); test_multiprocess_gpu.py runs the multi-process counterparts.
needs_one_process = pytest.mark.skipif(MULTI_PROCESS, reason="one process driving the GPUs only (a fresh one-process "
                                       "worker of its own, or one process's peer pointers)")
needs_instrumentation = pytest.mark.skipif(not _native.with_instrumentation(), reason="built with the benchmarks' "
                                           "instrumentation only (JAX_EP_INSTRUMENT=ON)")


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
    """The per-rank body of the dispatch tests (test_intranode.py and test_internode.py): every result of dispatch,
    the scalars as [1] arrays so that they gather over ranks. dispatch_results reads what it returns."""

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


def assert_dispatch_matches_oracle(got: dict, ref):
    """Every dispatch output the oracle defines (rows, top-k, counts, drops, invalid ids), bit for bit."""
    for i, (comp, exp) in enumerate(zip(got["recv_x"], ref.recv_x)):
        assert_bits(comp, exp, f"recv_x[{i}] vs oracle")
    for name in ("recv_topk_idx", "recv_topk_weights", "num_recv_tokens", "num_recv_tokens_per_expert",
                 "num_dropped", "invalid_ids"):
        if getattr(ref, name) is not None:
            assert_bits(got[name], getattr(ref, name), f"{name} vs oracle")


def check_dispatch_drops(R: int, C: int, check):
    """check(x, idx, w, E, C=): a dispatch against the oracle, returning (result, oracle). With capacity C below
    what the ranks need, tokens are dropped and num_dropped = need - C."""
    T, H, K, E = 64, 128, 4, 16
    x, idx, w = make_case(R, T, H, K, E, seed=C)
    got, _ = check(x, idx, w, E, C=C)
    assert got["num_dropped"].sum() > 0, "the case should drop tokens"
    need = O.routing(idx, E)[1]
    assert_bits(got["num_dropped"], np.maximum(need - C, 0).astype(np.int32), "num_dropped = need - C")


def check_strict_raises_on_drops(R: int, buf: jax_ep.Buffer):
    """dispatch(strict=True) on `buf` raises where tokens are dropped; then a strict dispatch that drops none runs."""
    T, H, K, E = 32, 128, 4, 16
    x, idx, _ = make_case(R, T, H, K, E, seed=1, p_neg=0.0)
    body = lambda x, idx: jax_ep.dispatch(buf, x, idx, num_experts=E, max_recv_tokens=1, strict=True).recv_x
    with pytest.raises(Exception, match="(?i)drop|fit|max_recv_tokens"):
        jax.block_until_ready(spmd(R, body)(flat(x), flat(idx)))
    # The failure stays in JAX's runtime token of these devices (re-raised at exit) until a later strict run
    # on them succeeds.
    ok = lambda x, idx: jax_ep.dispatch(buf, x, idx, num_experts=E, strict=True).recv_x
    jax.block_until_ready(spmd(R, ok)(flat(x), flat(idx)))
    jax.effects_barrier()


def check_handles_swap(R: int, cuda: jax_ep.Buffer, xla: jax_ep.Buffer, what: str):
    """The xla backend combines along a handle of the cuda Buffer `cuda` (`what` names it in the messages), and the
    cuda backend's cached dispatch follows an xla handle: both against the oracle."""
    T, H, K, E = 40, 256, 4, 16
    x, idx, _ = make_case(R, T, H, K, E, seed=11, dtype=np.float32)
    y = O.make_x(np.random.default_rng(2), (R, R * T, H), np.float32)

    def body(x, idx, y):
        cuda_handle = jax_ep.dispatch(cuda, x, idx, num_experts=E).handle
        xla_handle = jax_ep.dispatch(xla, x, idx, num_experts=E).handle
        return jax_ep.combine(xla, y, cuda_handle).x, jax_ep.dispatch(cuda, x, handle=xla_handle).recv_x

    out, cached = (ranks(a, R) for a in jax.device_get(spmd(R, body)(flat(x), flat(idx), flat(y))))
    ref = O.dispatch(x, idx, None, E)
    assert_bits(out, O.combine(y, ref.routing)[0], f"xla combine along the {what} handle")
    assert_bits(cached, ref.recv_x[0], f"{what} cached dispatch along the xla handle")


def combine_body(buf, E: int, C, with_bias: bool):
    """The per-rank body of the combine tests (test_intranode.py and test_internode.py): dispatch, a cached
    dispatch of x2 by its handle, and combine of y (with the combined weights)."""

    def body(x, idx, w, x2, y, bias):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, max_recv_tokens=C)
        cached = jax_ep.dispatch(buf, x2, handle=d.handle).recv_x
        c = jax_ep.combine(buf, y, d.handle, topk_weights=d.recv_topk_weights, bias=bias if with_bias else None)
        return cached, c.x, c.topk_weights

    return body


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
    """The per-rank body of the expert-major dispatch tests (test_intranode.py and test_internode.py): every result
    but the handle, the scalars as [1] arrays so that they gather over ranks. em_dispatch_results reads what it
    returns."""

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


def blank_past_groups(rows, sizes, offsets, written: int = 0):
    """rows [R, C, ...] with each rank's rows past its last group (offset + size of its last expert), after the first
    `written` of them, zeroed: the cuda kernels leave them unwritten (docs/design.md, "Expert-major layout"), the
    oracle and the xla backend zero them."""
    rows = np.array(rows)
    for r, end in enumerate(np.asarray(offsets)[:, -1].astype(np.int64) + np.asarray(sizes)[:, -1]):
        rows[r, end + written:] = 0
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
    """The per-rank body of the expert-major combine tests (test_intranode.py and test_internode.py): dispatch, a cached
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


def em_grad_body(buf, E: int):
    """The per-rank body of the expert-major gradient tests (test_intranode.py and test_internode.py): d x,
    d topk_weights of sum(combine(recv_x, weights=recv_weights).x * g_out)."""

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


# Every op captured into CUDA graphs, loops included: XLA_FLAGS of the jitted-loop tests in a fresh process
# (test_intranode.py, test_low_latency.py) and as R processes (test_multiprocess_gpu.py).
FORCED_COMMAND_BUFFER_FLAGS = ("--xla_gpu_graph_min_graph_size=1 "
                               "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL")


def make_ll_inputs(R, T, H, K, E, M, seed=0, mode="distinct", p_neg=0.1, p_invalid=0.0):
    """The low-latency tests' x, topk_idx, topk_weights, expert outputs y and cumulative expert statistics."""
    rng = np.random.default_rng(seed)
    idx = O.make_topk_idx(rng, R, T, K, E, mode, p_neg=p_neg, p_invalid=p_invalid)
    x = O.make_x(rng, (R, T, H), O.BF16)
    w = rng.uniform(-1, 1, size=(R, T, K)).astype(np.float32)
    y = O.make_x(rng, (R, E // R, R * M, H), O.BF16)  # rows past recv_count are garbage the combine ignores
    stats = rng.integers(0, 1000, size=(R, E // R)).astype(np.int32)
    return x, idx, w, y, stats


def check_with_forced_command_buffers(test_file: str, test_name: str, R: int, env_extra: dict | None = None):
    """test_file's test `test_name` (on R devices) with every op captured into CUDA graphs, in a fresh process (the
    flags apply at backend start), with `env_extra` in its environment: it runs and passes."""
    proc = run_in_fresh_process("pytest", R, [f"{test_file}::{test_name}"],
                                {"XLA_FLAGS": FORCED_COMMAND_BUFFER_FLAGS, **(env_extra or {})})
    assert proc.returncode == 0 and "1 passed" in proc.stdout, (env_extra, proc.stdout[-3000:] + proc.stderr[-3000:])


def check_jitted_loop_with_forced_command_buffers(test_file: str, R: int, env_extra: dict | None = None):
    """test_file's test_jitted_loop_default_flags[R] with forced command buffers (check_with_forced_command_buffers)."""
    check_with_forced_command_buffers(test_file, f"test_jitted_loop_default_flags[{R}]", R, env_extra)


def check_em_combine_gradient_rows(R, buf):
    """The VJP of an expert-major combine alone, in y and the weights, on `buf` (a cuda Buffer) against the oracle:
    d y on each pair's row the float32 product weight * g_out[token] rounded to y's type, zero on the alignment
    padding and on the first expert_major_grad_zero_rows rows past the last group, unspecified after them; d weights
    the float32 dot of g_out[token] and y[row] on each pair's row (within the sum's tolerance), zero elsewhere."""
    alignment, E = 8, EM_E
    x, idx, w = em_case(R, O.BF16, seed=21)
    capacity = O.expert_major_capacity(R, EM_T, EM_K, E // R, alignment)
    rng = np.random.default_rng(22)
    y, g_out = O.make_x(rng, (R, capacity, EM_H), O.BF16), O.make_x(rng, (R, EM_T, EM_H), O.BF16)

    def body(x, idx, w, y, g_out):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, expert_alignment=alignment, layout="expert_major")
        _, vjp = jax.vjp(lambda y, weights: jax_ep.combine(buf, y, d.handle, weights=weights).x, y, d.recv_weights)
        return (*vjp(g_out), d.num_recv_tokens_per_expert, d.expert_offsets)

    got = spmd(R, body)(flat(x), flat(idx), flat(w), flat(y), flat(g_out))
    d_y, d_weights, sizes, offsets = (ranks(a, R) for a in jax.device_get(got))
    ref = O.expert_major_dispatch(x, idx, w, E, capacity, alignment)
    exp_dy, exp_dw = O.expert_major_combine_vjp(ref.routing, g_out, y, ref.recv_weights, O.BF16)[:2]
    written = _native.limit("expert_major_grad_zero_rows")
    assert_bits(blank_past_groups(d_y, sizes, offsets, written), exp_dy, "d y vs oracle")
    dot_magnitude = O.expert_major_combine_vjp(ref.routing, np.abs(g_out.astype(np.float32)),
                                               np.abs(y.astype(np.float32)), np.ones_like(ref.recv_weights),
                                               np.float32)[1]  # sum of |g_out * y| per row
    assert_within(d_weights, exp_dw, sum_tolerance(dot_magnitude, EM_H), "d weights vs oracle")
    assert buf.errors() == []
