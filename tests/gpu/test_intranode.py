"""The CUDA intranode normal mode (Buffer(backend="cuda")) against the NumPy oracle and the `xla` backend: bit
for bit for dispatch (every output, the FP8 pair, the handle), cached dispatch and combine (float32 rank-order
sums), gradients, determinism, capacity drops, T=0, DeepEP hidden sizes, the expert-major layout (dispatch,
cached dispatch and unweighted combine bit for bit, the weighted combine and gradients within a bound of the
fused multiply-adds), a jitted loop with command buffers (default flags, and forced in a fresh process), and the
bounded wait of a rank whose peers never join. Combine runs the process model's default method (pull in one
process, push across processes, or $JAX_EP_COMBINE), and both methods explicitly (Config.combine) in the tests
that name one.

Both process models run this file: one process driving every GPU (plain pytest), and one process per GPU
(test_multiprocess_gpu.py starts R processes that each run it; ranks = the process count, inputs become
global arrays and outputs are gathered to every process, so every process checks every rank).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import buffer, flat, mesh_of, ranks, spmd
from process_harness import run_in_fresh_process

import jax_ep
from gpu.conftest import RANKS_SHARE_GPUS, needs_nccl
from gpu.gpu_harness import (EM_E, EM_H, EM_K, EM_T, MULTI_PROCESS, RANKS, assert_bits, assert_dispatch_matches_oracle,
                             assert_em_dispatch_equal, check_dispatch_drops, check_em_combine,
                             check_em_combine_gradient_rows, check_em_drops, check_em_grads, check_em_repeated_runs,
                             check_handles_swap, check_jitted_loop_with_forced_command_buffers,
                             check_strict_raises_on_drops, combine_body, dispatch_body, dispatch_results, em_case,
                             em_combine_body, em_combine_inputs, em_dispatch_body, em_dispatch_results, em_grad_body,
                             make_case, needs_instrumentation, needs_one_process, repeats_an_expert,
                             FORCED_COMMAND_BUFFER_FLAGS)
from jax_ep import environment
from jax_ep.backends.cuda import normal


# ----------------------------------------------------------------------------------------------------------------
# Harness (this suite's programs and checks; gpu_harness.py holds what test_internode.py shares)
# ----------------------------------------------------------------------------------------------------------------
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
    check_dispatch_drops(R, C, functools.partial(check_dispatch, R))


@pytest.mark.parametrize("R", RANKS)
def test_strict_raises_on_drops(R):
    check_strict_raises_on_drops(R, buffer(R, "cuda"))


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
    with jax_ep.Buffer(mesh_of(R), "ep", backend="cuda", config=jax_ep.Config(combine="push"),
                       num_nvl_bytes=nbytes) as buf:
        def body(x, idx, y):
            return jax_ep.combine(buf, y, jax_ep.dispatch(buf, x, idx, num_experts=E).handle).x

        out = ranks(jax.device_get(spmd(R, body)(flat(x), flat(idx), flat(y))), R)
    assert_bits(out, O.combine(y, O.dispatch(x, idx, None, E).routing)[0], "push combine vs oracle")


@needs_nccl
@pytest.mark.parametrize("R", RANKS)
def test_handles_swap_between_backends(R):
    """The xla backend combines along a cuda handle; the cuda backend's cached dispatch follows an xla handle."""
    check_handles_swap(R, buffer(R, "cuda"), buffer(R, "xla"), "cuda")


# ----------------------------------------------------------------------------------------------------------------
# Expert-major layout (dispatch(..., layout="expert_major"): rows are received (token, local expert) pairs)
# ----------------------------------------------------------------------------------------------------------------

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
def test_expert_major_combine_gradient_rows(R):
    """The VJP of combine alone, in y and the weights: d y = the float32 product weight * g_out[token] rounded to y's
    type on each pair's row, zero on the alignment padding and on the first expert_major_grad_zero_rows rows past
    the last group (grouped_matmul's dw reads some of them: they must be finite), unspecified after them; d weights
    = the float32 dot of g_out[token] and y[row] on each pair's row, zero on every other row."""
    check_em_combine_gradient_rows(R, buffer(R, "cuda"))


def pair_rows_made_by_hand(pair_row, capacity: int):
    """pair_row rewritten as a handle made by hand may have it, naming the same pairs: an item whose kept pairs
    start its row and leave a column free gets a dropped entry (the capacity) in front of them; an item this rank
    holds nothing of ([-1, -1, ...], which the combine skips) gets a kept row in its second column."""
    kept = (pair_row >= 0) & (pair_row < capacity)
    dropped_first = jnp.concatenate([jnp.full_like(pair_row[:, :1], capacity), pair_row[:, :-1]], axis=1)
    shift = kept[:, 0] & (kept.sum(axis=1) < pair_row.shape[1])
    lure = pair_row.at[:, 1].set(0)
    skipped = (pair_row == -1).all(axis=1)
    return jnp.where(shift[:, None], dropped_first, jnp.where(skipped[:, None], lure, pair_row))


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("H", [EM_H, 100], ids=["whole-vectors", "elements"])  # 200-byte rows: the element path
def test_expert_major_combine_finds_kept_pairs_in_any_column(R, H):
    """A pair_row whose kept pairs do not come first (a dropped entry ahead of them), and a skipped item ([-1, ...])
    with a kept row in a later column: the combine sums the same pairs as along the dispatch's own pair_row, bit
    for bit, reading no other row (before, it read row `capacity`, past y, and the skipped item's copies shifted
    every later row of its warp)."""
    x, idx, w = em_case(R, O.BF16, seed=41, H=H)
    backend = buffer(R, "cuda").backend_impl
    capacity = O.expert_major_capacity(R, EM_T, EM_K, EM_E // R, 1)

    def body(x, idx, w):
        recv, weights, *_, handle, _ = backend.expert_major_dispatch(
            (x,), idx, w, num_experts=EM_E, capacity=capacity, expert_alignment=1)
        hand_made = pair_rows_made_by_hand(handle.pair_row, capacity)
        changed = jnp.sum(jnp.any(hand_made != handle.pair_row, axis=1))
        def combine(pair_row):
            return backend._expert_major_combine_call(recv[0], weights, pair_row, handle, None, x.dtype)

        return combine(handle.pair_row), combine(hand_made), changed[None]

    own, hand_made, changed = (ranks(a, R) for a in jax.device_get(spmd(R, body)(flat(x), flat(idx), flat(w))))
    assert (changed > 0).all(), "every rank should have rewritten items"
    assert_bits(hand_made, own, "combine along the hand-made pair_row vs the dispatch's")
    assert buffer(R, "cuda").errors() == []


@pytest.mark.parametrize("R", RANKS)
def test_expert_major_repeated_runs_identical(R):
    """The same jitted expert-major dispatch, cached dispatch and combines, run again: the same bits (the
    weighted combine too: one compiled program always fuses the same way)."""
    check_em_repeated_runs(R, lambda E, alignment: em_combine_fn(R, E, None, alignment))
    assert buffer(R, "cuda").errors() == []



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
@needs_instrumentation
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


@needs_one_process
@pytest.mark.parametrize("R", RANKS)
def test_jitted_loop_forced_command_buffers(R):
    """Every op captured into CUDA graphs (min graph size 1, loops included; the flags apply at backend start, so
    test_jitted_loop_default_flags runs in a fresh process): the call sequence lives on the device, so replay stays
    correct; with either combine method (the push combine's flags and token tickets live on the device too)."""
    for method in ("pull", "push"):
        check_jitted_loop_with_forced_command_buffers(__file__, R, {environment.COMBINE: method})


# ---- side streams (docs/design.md, "Side streams") ---------------------------------------------------------------

@pytest.mark.parametrize("R", RANKS)
def test_side_stream_overlap_equals_xla_stream(R):
    """normal.overlap: an expert-major dispatch and weighted combine on a side stream beside a matmul give the bits
    of the same calls on XLA's stream, and the matmul its own; three runs of the jitted program, the same again."""
    x, idx, w = em_case(R, O.BF16, seed=31)
    buf = buffer(R, "cuda")
    backend = buf.backend_impl
    capacity = O.expert_major_capacity(R, EM_T, EM_K, EM_E // R, 1)
    m = np.random.default_rng(32).standard_normal((R, 512, 512)).astype(np.float32)

    def communicate(x, idx, w):
        recv, weights, *_, handle, _ = backend.expert_major_dispatch(
            (x,), idx, w, num_experts=EM_E, capacity=capacity, expert_alignment=1)
        combined = backend._expert_major_combine_call(recv[0], weights, handle.pair_row, handle, None, x.dtype)
        return combined, weights

    def compute(m):
        return m @ m @ m

    def plain(x, idx, w, m):
        return communicate(x, idx, w), compute(m)

    def overlapped(x, idx, w, m):
        return normal.overlap(communicate, (x, idx, w), compute, (m,))

    args = tuple(flat(a) for a in (x, idx, w, m))
    expected = jax.tree.leaves(jax.device_get(spmd(R, plain)(*args)))
    fn = spmd(R, overlapped)
    for run in range(3):
        for name, a, b in zip(("combined", "recv_weights", "matmul"), jax.tree.leaves(jax.device_get(fn(*args))),
                              expected):
            assert_bits(a, b, f"run {run}: {name}")
    assert buf.errors() == []


@needs_one_process
@pytest.mark.parametrize("R", RANKS)
def test_side_stream_overlap_with_forced_command_buffers(R):
    """The same program with every capturable op in CUDA graphs: the side-stream twins and the join are not
    command-buffer compatible, so XLA runs them between its graphs, and the results stay the same."""
    proc = run_in_fresh_process("pytest", R, [f"{__file__}::test_side_stream_overlap_equals_xla_stream[{R}]"],
                                {"XLA_FLAGS": FORCED_COMMAND_BUFFER_FLAGS})
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@needs_one_process
@pytest.mark.bounded_wait
@pytest.mark.parametrize("R", RANKS)
def test_rank_that_never_joins_times_out(R):
    """Only rank 0 calls dispatch (tests/worker.py, mode timeout): it waits its timeout for the others, records which
    op and peer, and traps; the error reaches Python and the record names the op and the ranks."""
    proc = run_in_fresh_process("timeout", R)
    assert "RAISED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = [line for line in proc.stdout.splitlines() if line.startswith("RECORD")]
    assert record and "dispatch timed out on rank 0" in record[0] and "waiting for rank" in record[0], proc.stdout
