"""The internode normal mode (Buffer(backend="cuda", ranks_per_node=P): NVSHMEM between nodes, NVLink inside
them) against the NumPy oracle: dispatch bit for bit (every output, the FP8 pair, the handle, its relay part),
cached dispatch, combine in the internode order (per node in float32, then over nodes in float32) bit for bit,
capacity drops, strict mode, gradients, determinism over repeated runs, a jitted loop, two node layouts,
DeepEP's hidden sizes, and the expert-major layout (test_intranode.py's checks, combine in the internode order).

Internode mode needs one process per GPU: test_multiprocess_gpu.py starts R processes on one host that each
run this file (ranks = the process count; R=4 runs as 2 nodes x 2 GPUs, and as 4 nodes x 1 GPU, with NVSHMEM
carrying the traffic between the "nodes"); in a single process it is skipped. Inputs become global arrays and
outputs are gathered to every process, so every process checks every rank.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import flat, mesh_of, ranks, spmd

import jax_ep
from gpu.conftest import needs_nccl
from gpu.gpu_harness import (EM_E, EM_H, EM_T, assert_bits, assert_dispatch_matches_oracle, assert_em_dispatch_equal,
                             check_dispatch_drops, check_em_combine, check_em_combine_gradient_rows, check_em_drops,
                             check_em_grads, check_em_repeated_runs, check_handles_swap, check_strict_raises_on_drops,
                             combine_body, dispatch_body, dispatch_results, em_case, em_combine_body, em_combine_inputs,
                             em_dispatch_body, em_dispatch_results, em_grad_body, make_case, repeats_an_expert)
from jax_ep.backends.cuda import internode

R = jax.process_count()
pytestmark = pytest.mark.skipif(R == 1, reason="internode mode needs one process per GPU: test_multiprocess_gpu.py "
                                               "runs this file as 4 processes (2 nodes x 2 GPUs)")
# Node layouts: ranks per node below R (the first one is the main one: 2 on 4 GPUs).
LAYOUTS = [p for p in (2, 1) if p < R and R % p == 0]
MAIN = LAYOUTS[0] if LAYOUTS else 1
NUM_RDMA_BYTES = 256 << 20
# NVSHMEM's symmetric heap (read at the first internode Buffer): room for one Buffer per layout.
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str((len(LAYOUTS) + 1) * NUM_RDMA_BYTES))


# ----------------------------------------------------------------------------------------------------------------
# Harness
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def internode_buffer(per_node: int | None) -> jax_ep.Buffer:
    """The internode cuda Buffer for `per_node` ranks per node; None: the xla backend."""
    if per_node is None:
        return jax_ep.Buffer(mesh_of(R), "ep", backend="xla")
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="cuda", ranks_per_node=per_node, num_rdma_bytes=NUM_RDMA_BYTES)
    assert buf.internode and buf.ranks_per_node == per_node, buf
    return buf


def no_timeouts(per_node: int):
    assert internode_buffer(per_node).errors() == []


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def dispatch_fn(per_node, E: int, C, alignment: int):
    return spmd(R, dispatch_body(internode_buffer(per_node), E, C, alignment))


def run_dispatch(per_node, x, idx, w, E, C=None, alignment=1):
    return dispatch_results(dispatch_fn(per_node, E, C, alignment)(flat(x), flat(idx), flat(w)), R)


def expected_relay(idx, E, C, per_node):
    """The handle's relay part from the oracle's routing: on relay rank X = (m, l), entry s*T + t is token t of
    rank (s, l): its row on rank (m, j) for every j (-1 where not kept there), and whether it has an expert on
    node m."""
    route, _ = O.routing(idx, E, C)
    in_rank = O.layout(idx, E).is_token_in_rank  # [R, T, R]
    T = idx.shape[1]
    row_of = np.full((R, T, R), -1, np.int32)  # [source rank, token, receiving rank]
    for r, rows in enumerate(route.rows):
        for i, (s, t) in enumerate(rows):
            row_of[s, t, r] = i
    num_nodes = R // per_node
    relay_row = np.full((R, num_nodes * T, per_node), -1, np.int32)
    relay_token = np.zeros((R, num_nodes * T), bool)
    for relay in range(R):
        node, local = divmod(relay, per_node)
        receivers = slice(node * per_node, (node + 1) * per_node)
        for s in range(num_nodes):
            src = s * per_node + local
            relay_row[relay, s * T:(s + 1) * T] = row_of[src, :, receivers]
            relay_token[relay, s * T:(s + 1) * T] = in_rank[src, :, receivers].any(axis=1)
    return relay_row, relay_token


def check_dispatch(per_node, x, idx, w, E, C=None, alignment=1):
    """Internode dispatch == oracle, every output bit for bit, the handle as the oracle's routing says (and
    recv_src_index as the xla backend's); returns (result, oracle)."""
    got = run_dispatch(per_node, x, idx, w, E, C, alignment)
    ref = O.dispatch(x, idx, w, E, C, alignment)
    assert_dispatch_matches_oracle(got, ref)
    handle = got["handle"]
    assert isinstance(handle, internode.InternodeHandle), type(handle)
    T = idx.shape[1]
    capacity = R * T if C is None else C
    expected_src = np.full((R, capacity), R * T, np.int32)
    for r, rows in enumerate(ref.routing.rows):
        expected_src[r, :len(rows)] = rows[:, 0] * T + rows[:, 1]
    assert_bits(handle.recv_src_index, expected_src, "handle.recv_src_index vs oracle")
    assert_bits(handle.is_token_in_rank, O.layout(idx, E).is_token_in_rank, "is_token_in_rank vs oracle")
    relay_row, relay_token = expected_relay(idx, E, C, per_node)
    assert_bits(handle.relay_row, relay_row, "handle.relay_row vs oracle routing")
    assert_bits(handle.relay_token, relay_token, "handle.relay_token vs oracle routing")
    return got, ref


DISPATCH_CASES = [(O.BF16, mode) for mode in O.ROUTING_MODES] + [(d, "distinct") for d in (np.float32, np.float16, "fp8")]


@pytest.mark.parametrize("dtype,mode", DISPATCH_CASES, ids=lambda v: v if isinstance(v, str) else np.dtype(v).name)
def test_dispatch_matches_oracle(dtype, mode):
    T, H, K, E = 96, 256, 8, 32
    x, idx, w = make_case(R, T, H, K, E, seed=len(mode), mode=mode, dtype=dtype, p_invalid=0.02)
    check_dispatch(MAIN, x, idx, w, E, alignment=4)
    no_timeouts(MAIN)


def test_dispatch_without_weights_and_odd_shapes():
    """No weights; K not a power of two; T not a multiple of the warp size; E/R = 3."""
    T, H, K, E = 37, 384, 5, 3 * R
    x, idx, _ = make_case(R, T, H, K, E, seed=5, dtype=np.float32)
    check_dispatch(MAIN, x, idx, None, E)


@needs_nccl
def test_results_equal_the_xla_backend():
    """Every dispatch output and the handle's first two fields equal the xla backend's bit for bit."""
    T, H, K, E = 64, 256, 6, 16
    x, idx, w = make_case(R, T, H, K, E, seed=17, p_invalid=0.02)
    got, xla = run_dispatch(MAIN, x, idx, w, E, alignment=2), run_dispatch(None, x, idx, w, E, alignment=2)
    for name in ("recv_topk_idx", "recv_topk_weights", "num_recv_tokens", "num_recv_tokens_per_expert",
                 "num_dropped", "invalid_ids"):
        assert_bits(got[name], xla[name], f"{name} vs xla")
    assert_bits(got["recv_x"][0], xla["recv_x"][0], "recv_x vs xla")
    assert_bits(got["handle"].recv_src_index, xla["handle"].recv_src_index, "recv_src_index vs xla")
    assert_bits(got["handle"].is_token_in_rank, xla["handle"].is_token_in_rank, "is_token_in_rank vs xla")


@pytest.mark.parametrize("C", [1, 7, 50])
def test_capacity_below_need_drops(C):
    check_dispatch_drops(R, C, functools.partial(check_dispatch, MAIN))


def test_strict_raises_on_drops():
    check_strict_raises_on_drops(R, internode_buffer(MAIN))


# ----------------------------------------------------------------------------------------------------------------
# Cached dispatch and combine
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def combine_fn(per_node, E: int, C, with_bias: bool):
    return spmd(R, combine_body(internode_buffer(per_node), E, C, with_bias))


def check_combine(per_node, T, H, K, E, dtype, with_bias, seed=0, C=None):
    x, idx, w = make_case(R, T, H, K, E, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    x2 = O.make_x(rng, (R, T, 2 * H), np.float32)  # cached dispatch of another width and dtype
    capacity = R * T if C is None else C
    y = O.make_x(rng, (R, capacity, H), dtype)
    bias = O.make_x(rng, (R, T, H), np.float32) if with_bias else None
    out = combine_fn(per_node, E, C, with_bias)(flat(x), flat(idx), flat(w), flat(x2), flat(y), flat(bias))
    cached, combined, weights = (ranks(a, R) for a in jax.device_get(out))
    ref = O.dispatch(x, idx, w, E, C)
    assert_bits(cached, O.cached_dispatch(x2, ref.routing)[0], "cached dispatch vs oracle")
    exp_out, exp_w = O.combine_internode(y, ref.routing, per_node, ref.recv_topk_weights, bias)
    assert_bits(combined, exp_out, "combine vs oracle (internode order)")
    assert_bits(weights, exp_w, "combined topk_weights vs oracle (internode order)")
    no_timeouts(per_node)


@pytest.mark.parametrize("dtype", [O.BF16, np.float32, np.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_cached_dispatch_and_combine(dtype, with_bias):
    check_combine(MAIN, 80, 512, 6, 8 * R, dtype, with_bias, seed=R)


@pytest.mark.parametrize("C", [5, 60])
def test_combine_after_drops(C):
    """Rows dropped at the receiver add nothing; a node that kept none of a token's rows adds a zero partial."""
    check_combine(MAIN, 48, 256, 4, 16, O.BF16, True, seed=C, C=C)


@pytest.mark.parametrize("per_node", LAYOUTS)
def test_node_layouts(per_node):
    """Every layout of the ranks into nodes (on 4 GPUs: 2 x 2 and 4 x 1, the latter with no NVLink stage)."""
    T, H, K, E = 40, 256, 8, 32
    x, idx, w = make_case(R, T, H, K, E, seed=per_node, p_invalid=0.01)
    check_dispatch(per_node, x, idx, w, E, alignment=3)
    check_combine(per_node, T, H, K, E, O.BF16, True, seed=per_node)


@pytest.mark.parametrize("H", [2048, 4096, 7168])
def test_deepep_hidden_sizes(H):
    T, K, E = 24, 8, 64
    for dtype in (O.BF16, "fp8"):
        x, idx, w = make_case(R, T, H, K, E, seed=H, dtype=dtype)
        check_dispatch(MAIN, x, idx, w, E)
    check_combine(MAIN, T, H, K, E, O.BF16, with_bias=False)


@needs_nccl
def test_handles_swap_with_the_xla_backend():
    """Cached dispatch here follows an xla handle; the xla combine (flat rank order) follows an internode handle."""
    check_handles_swap(R, internode_buffer(MAIN), internode_buffer(None), "internode")


# ----------------------------------------------------------------------------------------------------------------
# Expert-major layout (test_intranode.py's cases and checks, with the internode order of the sums)
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def em_dispatch_fn(per_node, E: int, C, alignment: int):
    return spmd(R, em_dispatch_body(internode_buffer(per_node), E, C, alignment))


def check_em_dispatch(per_node, x, idx, w, E, C=None, alignment=1):
    """Internode expert-major dispatch == oracle, every output bit for bit; returns (result, oracle)."""
    got = em_dispatch_results(em_dispatch_fn(per_node, E, C, alignment)(flat(x), flat(idx), flat(w)), R)
    ref = O.expert_major_dispatch(x, idx, w, E, C, alignment)
    assert_em_dispatch_equal(got, ref, "oracle")
    no_timeouts(per_node)
    return got, ref


@pytest.mark.parametrize("dtype,alignment", [(O.BF16, 1), (O.BF16, 8), ("fp8", 1), ("fp8", 8)],
                         ids=["bf16-align1", "bf16-align8", "fp8-align1", "fp8-align8"])
def test_expert_major_dispatch_matches_oracle(dtype, alignment):
    """Rows grouped by local expert, a pair per (token, expert) however often the token names it (its weights
    summed), padding rows between the groups with alignment 8, both arrays of the FP8 pair; never drops."""
    x, idx, w = em_case(R, dtype, seed=alignment)
    assert repeats_an_expert(idx, EM_E) and (idx == -1).any(), "the case should repeat experts and have -1 entries"
    got, _ = check_em_dispatch(MAIN, x, idx, w, EM_E, alignment=alignment)
    assert not got["num_dropped"].any(), "the default capacity never drops"


def test_expert_major_dispatch_drops():
    check_em_drops(R, functools.partial(check_em_dispatch, MAIN))


@functools.cache
def em_combine_fn(per_node, E: int, C, alignment: int):
    return spmd(R, em_combine_body(internode_buffer(per_node), E, C, alignment))


@pytest.mark.parametrize("dtype,C,alignment", [(O.BF16, None, 1), (np.float32, 100, 8)],
                         ids=["bf16", "f32-drops-align8"])
def test_expert_major_cached_dispatch_and_combine(dtype, C, alignment):
    """Cached dispatch along an expert-major handle; combine, unweighted (with a bias, bit for bit in the internode
    order: each rank's partials, summed per node, then over nodes) and weighted by recv_weights; with drops,
    dropped pairs add nothing (a token may have no kept pair at all)."""
    inputs = em_combine_inputs(R, dtype, seed=R + alignment, C=C, alignment=alignment)
    got = em_combine_fn(MAIN, EM_E, C, alignment)(*(flat(a) for a in inputs))
    check_em_combine([ranks(a, R) for a in jax.device_get(got)], inputs, EM_E, C, alignment, ranks_per_node=MAIN)
    no_timeouts(MAIN)


def test_expert_major_gradients_match_oracle():
    """d x: the internode combine of the rows' cotangents; d topk_weights: each pair's cotangent on its entries."""
    x, idx, w = em_case(R, np.float32, seed=3)
    g_out = O.make_x(np.random.default_rng(4), (R, EM_T, EM_H), np.float32)
    got = spmd(R, em_grad_body(internode_buffer(MAIN), EM_E))(flat(x), flat(w), flat(idx), flat(g_out))
    d_x, d_w = (ranks(a, R) for a in jax.device_get(got))
    check_em_grads(d_x, d_w, x, w, idx, g_out, EM_E, ranks_per_node=MAIN)
    no_timeouts(MAIN)


def test_expert_major_combine_gradient_rows():
    """The VJP of combine alone in y and the weights (a cached dispatch of the cotangent over the nodes): as in
    test_intranode.py, d y bit for bit on every pair's row and the written rows around, d weights within the dot's
    tolerance."""
    check_em_combine_gradient_rows(R, internode_buffer(MAIN))
    no_timeouts(MAIN)


def test_expert_major_repeated_runs_identical():
    """The same jitted expert-major dispatch, cached dispatch and combines, run again: the same bits."""
    check_em_repeated_runs(R, lambda E, alignment: em_combine_fn(MAIN, E, None, alignment))
    no_timeouts(MAIN)


# ----------------------------------------------------------------------------------------------------------------
# Gradients, determinism, loops
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def grad_fn(per_node, E: int):
    buf = internode_buffer(per_node)

    def loss(x, w, bias, idx, g_out, g_w):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
        c = jax_ep.combine(buf, d.recv_x, d.handle, topk_weights=d.recv_topk_weights, bias=bias)
        return jnp.sum(c.x.astype(jnp.float32) * g_out) + jnp.sum(c.topk_weights * g_w)

    def body(x, w, bias, idx, g_out, g_w):
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, bias, idx, g_out, g_w)

    return spmd(R, body)


@pytest.mark.parametrize("dtype", [O.BF16, np.float32], ids=["bf16", "f32"])
def test_gradients_match_oracle(dtype):
    """d combine = cached dispatch of the cotangent; d dispatch = the internode combine of the cotangents (of
    recv_x, and of recv_topk_weights where the expert is kept)."""
    T, H, K, E = 48, 256, 8, 32
    x, idx, w = make_case(R, T, H, K, E, seed=3, dtype=dtype)
    rng = np.random.default_rng(4)
    bias = O.make_x(rng, (R, T, H), dtype)
    g_out, g_w = O.make_x(rng, (R, T, H), np.float32), O.make_x(rng, (R, T, K), np.float32)
    got = jax.device_get(grad_fn(MAIN, E)(*(flat(a) for a in (x, w, bias, idx, g_out, g_w))))
    d_x, d_w, d_bias = (ranks(a, R) for a in got)

    ref = O.dispatch(x, idx, w, E)
    g_combined = g_out.astype(dtype)  # the cotangent of combine's output, in y's dtype
    (g_recv_x,) = O.cached_dispatch(g_combined, ref.routing)
    (g_recv_w,) = O.cached_dispatch(g_w, ref.routing)
    kept = np.where(ref.recv_topk_idx >= 0, g_recv_w, np.float32(0))
    assert_bits(d_x, O.combine_internode(g_recv_x, ref.routing, MAIN)[0], "d x vs oracle")
    assert_bits(d_w, O.combine_internode(kept, ref.routing, MAIN)[0], "d topk_weights vs oracle")
    assert_bits(d_bias, g_combined, "d bias vs oracle")


def test_repeated_runs_identical():
    T, H, K, E = 128, 1024, 8, 64
    x, idx, w = make_case(R, T, H, K, E, seed=9)
    y = O.make_x(np.random.default_rng(1), (R, R * T, H), O.BF16)
    fn = combine_fn(MAIN, E, None, False)
    args = tuple(flat(a) for a in (x, idx, w, x, y, None))
    first = jax.device_get(fn(*args))
    for i in range(10):
        for name, a, b in zip(("cached", "combine", "weights"), jax.device_get(fn(*args)), first):
            assert_bits(a, b, f"run {i}: {name}")
    no_timeouts(MAIN)


def test_jitted_loop():
    """20 dispatch + combine rounds in one jitted lax.fori_loop (combine(recv_x / 2) feeds the next): back to
    back calls reuse every rank's region, paced by the credits."""
    T, H, K, E, steps = 64, 256, 4, 16, 20
    x, idx, w = make_case(R, T, H, K, E, seed=21, dtype=np.float32, p_neg=0.3)
    buf = internode_buffer(MAIN)

    def body(x, idx, w):
        def step(_, x):
            d = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
            return jax_ep.combine(buf, d.recv_x * 0.5, d.handle).x

        return jax.lax.fori_loop(0, steps, step, x)

    got = jax.device_get(spmd(R, body)(flat(x), flat(idx), flat(w)))
    expected = x
    for _ in range(steps):
        ref = O.dispatch(expected, idx, w, E)
        expected = O.combine_internode(ref.recv_x[0] * np.float32(0.5), ref.routing, MAIN)[0]
    assert_bits(ranks(got, R), expected, f"{steps} jitted dispatch+combine steps vs oracle")
    no_timeouts(MAIN)
