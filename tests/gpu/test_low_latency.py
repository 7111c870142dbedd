"""The CUDA low-latency kernels (Buffer(backend="cuda") with low-latency sizes; run by plain pytest with one
process driving the GPUs, and by test_multiprocess_gpu.py with one process per GPU on both transports, peer
stores and NVSHMEM, and on internode Buffers: $JAX_EP_TEST_RANKS_PER_NODE ranks per "node", stores inside a node
and NVSHMEM puts between nodes) against the NumPy oracle and the `xla` backend: dispatch bit for bit (BF16; FP8 values and scales in every
scale mode), the handle, recv_count, statistics and invalid ids; combine bit for bit against the oracle's
float32 k-order sum; determinism; several calls in a row (both buffer sets, two results in flight, receives
out of order) and in a jitted loop, with default and forced command buffers; two micro-batches overlapped
with computation between send and receive; DeepEP hidden sizes; M=512 with K=11; gradients; the bounded
wait that a third send in flight runs into; and masked ranks (Config(on_timeout="mask")).
"""
from __future__ import annotations

import functools
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import LL_RANKS_PER_NODE, flat, ll_buffer, new_ll_buffer, ranks, spmd
from process_harness import run_in_fresh_process

import jax_ep
from gpu.conftest import RANKS_SHARE_GPUS, needs_nccl
from gpu.gpu_harness import (RANKS, assert_bits, check_jitted_loop_with_forced_command_buffers, make_ll_inputs,
                             needs_one_process)
from jax_ep.backends.cuda import low_latency

MODES = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8_round": dict(use_fp8=True, round_scale=True),
    "fp8_ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}


def outputs(d, out):
    """The per-rank results of one dispatch + combine, as arrays with a leading (split) axis."""
    recv = d.recv_x if isinstance(d.recv_x, tuple) else (d.recv_x,)
    return dict(recv=recv, recv_count=d.recv_count, src_token_index=d.handle.src_token_index,
                layout_range=d.handle.layout_range, stats=d.cumulative_local_expert_recv_stats,
                invalid_ids=d.invalid_ids[None], out=out)


def per_rank(got: dict, R: int) -> dict:
    def split(v):
        return None if v is None else tuple(split(c) for c in v) if isinstance(v, tuple) else ranks(v, R)

    got = {k: split(v) for k, v in jax.device_get(got).items()}
    got["invalid_ids"] = got["invalid_ids"].reshape(R)
    return got


@functools.cache
def ll_fn(R, M, H, E, backend, mode):
    buf = ll_buffer(R, M, H, E, backend)

    def body(x, idx, w, y, stats):
        d = jax_ep.low_latency_dispatch(buf, x, idx, cumulative_local_expert_recv_stats=stats, **MODES[mode])
        return outputs(d, jax_ep.low_latency_combine(buf, y, idx, w, d.handle))

    return spmd(R, body)


def run_ll(R, M, backend, mode, x, idx, w, y, stats):
    E = y.shape[1] * R
    return per_rank(ll_fn(R, M, x.shape[-1], E, backend, mode)(*map(flat, (x, idx, w, y, stats))), R)


def expected(x, idx, w, y, stats, E, M, mode):
    kw = MODES[mode]
    exp = O.low_latency_dispatch(x, idx, E, M, use_fp8=kw["use_fp8"], round_scale=kw.get("round_scale", False),
                                 use_ue8m0=kw.get("use_ue8m0", False), cumulative_stats=stats)
    return exp, O.low_latency_combine(y, idx, w, E, exp)[0].astype(O.BF16)


def check_oracle(got, exp, out, mode, what=""):
    """Every output bit for bit against the oracle (recv_x on the valid rows only)."""
    assert_bits(got["recv_count"], exp.recv_count, f"{what}recv_count")
    assert_bits(got["src_token_index"], exp.src_token_index, f"{what}handle.src_token_index")
    assert_bits(got["layout_range"], exp.layout_range, f"{what}handle.layout_range")
    assert_bits(got["invalid_ids"], exp.invalid_ids, f"{what}invalid_ids")
    if exp.cumulative_stats is not None:
        assert_bits(got["stats"], exp.cumulative_stats, f"{what}cumulative_local_expert_recv_stats")
    v = exp.valid
    if mode == "bf16":
        assert_bits(got["recv"][0][v], exp.recv_x[v], f"{what}recv_x")
    else:
        q, scales = got["recv"]
        assert_bits(q[v], exp.recv_x_fp8[v], f"{what}fp8 values")
        assert_bits(scales[v], exp.recv_scales_ue8m0[v] if mode == "fp8_ue8m0" else exp.recv_scales[v],
                    f"{what}fp8 scales")
        scale = O.ue8m0_unpack(scales[v]) if mode == "fp8_ue8m0" else scales[v]
        if v.any():
            assert O.deepep_diff(O.fp8_dequant(q[v], scale), exp.recv_x[v].astype(np.float32)) < 1e-3
    assert_bits(got["out"], out, f"{what}combine vs the oracle's float32 k-order sum")


# ----------------------------------------------------------------------------------------------------------------
# Against the oracle and the xla backend
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_oracle_and_xla(R, mode):
    T, H, K, E, M = 40, 512, 6, 4 * R, 48
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=R, p_invalid=0.03)
    exp, out = expected(x, idx, w, y, stats, E, M, mode)
    assert exp.invalid_ids.sum() > 0, "the case should hold invalid ids"
    got = run_ll(R, M, "cuda", mode, x, idx, w, y, stats)
    check_oracle(got, exp, out, mode)
    if RANKS_SHARE_GPUS:  # see needs_nccl
        return
    xla = run_ll(R, M, "xla", mode, x, idx, w, y, stats)
    for name in ("recv_count", "src_token_index", "layout_range", "invalid_ids", "stats"):
        assert_bits(got[name], xla[name], f"{name} vs xla")
    for i, (a, b) in enumerate(zip(got["recv"], xla["recv"])):
        assert_bits(a[exp.valid], b[exp.valid], f"recv_x[{i}] vs xla")
    # The xla backend's combine may fuse multiply-adds: within a BF16 step of it.
    np.testing.assert_allclose(got["out"].astype(np.float32), xla["out"].astype(np.float32), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("R", RANKS)
def test_small_shapes_every_mode(R):
    """Every dispatch mode and the BF16 and compressed combines at shapes small enough for many ranks
    (test_multiprocess_gpu.py runs this with 64 processes on one GPU)."""
    T, H, K, E, M = 8, 512, 4, 2 * R, 8
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=R + 1, p_invalid=0.05)
    for mode in MODES:
        exp, out = expected(x, idx, w, y, stats, E, M, mode)
        check_oracle(run_ll(R, M, "cuda", mode, x, idx, w, y, stats), exp, out, mode, f"{mode}: ")
    buf = ll_buffer(R, M, H, E, "cuda")

    def body(x, idx, w, y):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return jax_ep.low_latency_combine(buf, y, idx, w, d.handle, compression="logfmt")

    got = ranks(spmd(R, body)(*map(flat, (x, idx, w, y))), R).astype(np.float64)
    acc, bound = O.low_latency_combine_logfmt(y, idx, w, E, O.low_latency_dispatch(x, idx, E, M))
    assert not (np.abs(got - acc) > bound).any(), "compressed combine outside LogFMT's bound"


@pytest.mark.parametrize("R", RANKS)
def test_buffer_destroyed_and_made_again(R):
    """A Buffer destroyed after its ops (collectively, across processes; an internode Buffer's symmetric regions
    freed by every process together) and a new one of the same sizes: both give the oracle's results."""
    T, H, K, E, M = 8, 256, 4, 2 * R, 8
    x, idx, w, y, _ = make_ll_inputs(R, T, H, K, E, M, seed=R + 3)
    exp, out = expected(x, idx, w, y, None, E, M, "bf16")
    for attempt in range(2):
        buf = new_ll_buffer(R, M, H, E, "cuda")

        def body(x, idx, w, y):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            return d.recv_x, jax_ep.low_latency_combine(buf, y, idx, w, d.handle)

        recv, combined = (ranks(a, R) for a in jax.device_get(spmd(R, body)(*map(flat, (x, idx, w, y)))))
        assert_bits(recv[exp.valid], exp.recv_x[exp.valid], f"Buffer {attempt}: recv_x")
        assert_bits(combined, out, f"Buffer {attempt}: combine")
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # destroy warns about any problem it met
            buf.destroy()
        assert not buf.alive


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_rank", "empty", "dense_dups"])
def test_routing_modes(R, routing):
    """Repeated experts in a row, every token to one expert or one rank, nothing sent at all."""
    T, H, K, E, M = 33, 256, 4, 2 * R, 33
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=7, mode=routing)
    exp, out = expected(x, idx, w, y, stats, E, M, "bf16")
    check_oracle(run_ll(R, M, "cuda", "bf16", x, idx, w, y, stats), exp, out, "bf16")


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("experts_per_rank", [64, 72, 1024])
def test_few_tokens_many_experts(R, experts_per_rank):
    """Fewer tokens than SMs and many more experts than the send's counting warps: every warp counts several
    experts, most experts get no row (flags with count 0), and each expert's rows are split over several receive
    blocks. The combine send numbers the rows of E (expert, source) pairs in runs of consecutive pairs per
    thread: whole runs (64 per rank), a short last run (72, DeepEP's 288 experts at R=4) and runs of 16 or 32
    pairs (1024 per rank; 4096 experts, the most the kernels take, at R=4)."""
    T, H, K, M = 5, 512, 8, 8  # UE8M0 packs four 128-channel scales per int32: H % 512 == 0
    E = min(experts_per_rank * R, low_latency.MAX_EXPERTS)
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=13, p_invalid=0.05)
    for mode in ("bf16", "fp8_ue8m0"):
        exp, out = expected(x, idx, w, y, stats, E, M, mode)
        check_oracle(run_ll(R, M, "cuda", mode, x, idx, w, y, stats), exp, out, mode, f"{mode}: ")


@pytest.mark.parametrize("H", [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192])
def test_deepep_hidden_sizes(H):
    R = RANKS[-1] if len(jax.devices()) >= RANKS[-1] else 2
    T, K, E, M = 24, 8, 4 * R, 32
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=H)
    for mode in ("bf16", "fp8_ue8m0"):
        exp, out = expected(x, idx, w, y, stats, E, M, mode)
        check_oracle(run_ll(R, M, "cuda", mode, x, idx, w, y, stats), exp, out, mode, f"H={H} {mode}: ")


@pytest.mark.parametrize("R", RANKS)
def test_max_tokens_512_and_topk_11(R):
    T, H, K, E, M = 512, 2048, 11, 4 * R, 512
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=11, mode="uniform", p_invalid=0.01)
    for mode in ("bf16", "fp8"):
        exp, out = expected(x, idx, w, y, stats, E, M, mode)
        check_oracle(run_ll(R, M, "cuda", mode, x, idx, w, y, stats), exp, out, mode, f"{mode}: ")


@pytest.mark.parametrize("R", RANKS)
# H=128: one block a row (the send's second piece is empty); H=384: pieces of 2 and 1 blocks.
@pytest.mark.parametrize("H, scale", [(128, 1.0), (384, 1.0), (512, 1.0), (7168, 1.0), (512, 1e-30), (512, 1e30)])
def test_logfmt_combine_within_the_bound(R, H, scale):
    """compression="logfmt": the send's warps encode each row into its slot (or, for a rank reached by NVSHMEM puts,
    into its staging row, then put), the receive decodes as it sums; every output within sum_k |w_k| * (LogFMT's
    bound on row k, tests/oracle.py) of the float32 k-order sum, plus its bfloat16 rounding."""
    T, K, E, M = 40, 8, 4 * R, 48
    x, idx, w, y, _ = make_ll_inputs(R, T, H, K, E, M, seed=R + H, p_invalid=0.03)
    y = (y.astype(np.float32) * scale).astype(O.BF16)
    buf = ll_buffer(R, M, H, E, "cuda")

    def body(x, idx, w, y):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return jax_ep.low_latency_combine(buf, y, idx, w, d.handle, compression="logfmt")

    out = ranks(spmd(R, body)(*map(flat, (x, idx, w, y))), R).astype(np.float64)
    exp = O.low_latency_dispatch(x, idx, E, M)
    acc, bound = O.low_latency_combine_logfmt(y, idx, w, E, exp)
    bad = np.abs(out - acc) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off, e.g. got {out[bad][0]} want {acc[bad][0]}"
    # The rows did travel compressed: the sums are not the uncompressed ones' bits.
    assert np.mean(out == acc.astype(O.BF16).astype(np.float64)) < 0.9


def test_buffer_transport_follows_the_setting():
    """The Buffers of this suite use the transport the environment asks for (test_multiprocess_gpu.py runs the
    suite with JAX_EP_LL_TRANSPORT=nvshmem, and on internode Buffers): the suite cannot pass on peer stores when
    NVSHMEM was asked for."""
    nvshmem = os.environ.get("JAX_EP_LL_TRANSPORT") == "nvshmem" or LL_RANKS_PER_NODE is not None
    buf = ll_buffer(RANKS[0], 8, 128, 2 * RANKS[0], "cuda")
    assert (buf.low_latency_transport, buf.internode) == ("nvshmem" if nvshmem else "peer_stores",
                                                          LL_RANKS_PER_NODE is not None)
    if LL_RANKS_PER_NODE:
        assert buf.ranks_per_node == LL_RANKS_PER_NODE


def test_topk_beyond_kernel_limit_rejected():
    R, M, H, E = RANKS[0], 8, 128, 2 * RANKS[0]
    buf = ll_buffer(R, M, H, E, "cuda")
    x = np.zeros((R * M, H), O.BF16)
    idx = np.zeros((R * M, 17), np.int32)
    with pytest.raises(ValueError, match="at most 16 top-k entries per token, got 17"):
        spmd(R, lambda x, idx: jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False).recv_count)(x, idx)


# ----------------------------------------------------------------------------------------------------------------
# Handles, gradients, determinism
# ----------------------------------------------------------------------------------------------------------------
@needs_nccl
@pytest.mark.parametrize("R", RANKS)
def test_xla_combine_accepts_cuda_handle(R):
    T, H, K, E, M = 20, 256, 4, 2 * R, 24
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=3)
    cuda, xla = ll_buffer(R, M, H, E, "cuda"), ll_buffer(R, M, H, E, "xla")

    def body(x, idx, w, y):
        return jax_ep.low_latency_combine(xla, y, idx, w, jax_ep.low_latency_dispatch(cuda, x, idx, use_fp8=False).handle)

    got = ranks(jax.device_get(spmd(R, body)(*map(flat, (x, idx, w, y)))), R)
    _, out = expected(x, idx, w, y, None, E, M, "bf16")
    np.testing.assert_allclose(got.astype(np.float32), out.astype(np.float32), rtol=2**-7, atol=1e-5)


@needs_nccl
@pytest.mark.parametrize("R", RANKS)
def test_gradients_match_xla(R):
    T, H, K, E, M = 16, 256, 4, 2 * R, 16
    x, idx, w, _, _ = make_ll_inputs(R, T, H, K, E, M, seed=5, p_neg=0.0)

    def grads(backend):
        buf = ll_buffer(R, M, H, E, backend)

        def loss(x, w, idx):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            out = jax_ep.low_latency_combine(buf, d.recv_x * 2, idx, w, d.handle)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.device_get(spmd(R, jax.grad(loss, argnums=(0, 1)))(*map(flat, (x, w, idx))))

    # The forward outputs may differ in the last bf16 place (XLA on GPU fuses w*y + acc into an FMA, the
    # kernel rounds product and sum as the oracle does), and d loss / d out = 2 out carries that into the
    # gradients: compare to within bf16 rounding of each gradient's scale.
    for name, a, b in zip(("d x", "d topk_weights"), grads("cuda"), grads("xla")):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2**-6, atol=2**-6 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("R", RANKS)
def test_repeated_runs_identical(R):
    T, H, K, E, M = 64, 1024, 8, 8 * R, 64
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=9)
    exp, _ = expected(x, idx, w, y, stats, E, M, "bf16")
    for mode in ("bf16", "fp8_round"):
        first = run_ll(R, M, "cuda", mode, x, idx, w, y, stats)
        for i in range(10):
            again = run_ll(R, M, "cuda", mode, x, idx, w, y, stats)
            for name in ("recv_count", "src_token_index", "layout_range", "out"):
                assert_bits(again[name], first[name], f"{mode} run {i}: {name}")
            for a, b in zip(again["recv"], first["recv"]):
                assert_bits(a[exp.valid], b[exp.valid], f"{mode} run {i}: recv_x")
    assert ll_buffer(R, M, H, E, "cuda").errors() == []


# ----------------------------------------------------------------------------------------------------------------
# Several calls: both buffer sets, two results in flight, loops, command buffers, overlap
# ----------------------------------------------------------------------------------------------------------------
CALLS = 5


@pytest.mark.parametrize("R", RANKS)
def test_calls_in_a_row_and_two_in_flight(R):
    """CALLS fused calls in a chain (each call's output is the next one's input, as layers of a decode step;
    the chain also keeps XLA from moving a send ahead of an earlier receive), alternating BF16 and FP8 and
    the routing, then two split dispatches in flight received in reverse order, and two combines in flight."""
    T, H, K, E, M = 24, 256, 4, 2 * R, 24
    x, idx, w, y, stats = make_ll_inputs(R, T, H, K, E, M, seed=17)
    w = np.abs(w) / K  # keeps the chained values in range
    buf = ll_buffer(R, M, H, E, "cuda")

    def body(x, idx, w, y, stats):
        results = []
        for i in range(CALLS):
            idxi, wi = jnp.roll(idx, i, axis=0), jnp.roll(w, i, axis=0)
            d = jax_ep.low_latency_dispatch(buf, x, idxi, cumulative_local_expert_recv_stats=stats, use_fp8=i % 2 == 1)
            results.append(outputs(d, jax_ep.low_latency_combine(buf, y, idxi, wi, d.handle)))
            x = results[-1]["out"]
        first = jax_ep.low_latency_dispatch_send(buf, x, idx, use_fp8=False)
        second = jax_ep.low_latency_dispatch_send(buf, jnp.roll(x, 1, axis=0), jnp.roll(idx, 1, axis=0), use_fp8=False)
        d2 = jax_ep.low_latency_dispatch_recv(buf, second)
        d1 = jax_ep.low_latency_dispatch_recv(buf, first)
        c1 = jax_ep.low_latency_combine_send(buf, y, idx, w, d1.handle)
        c2 = jax_ep.low_latency_combine_send(buf, y, jnp.roll(idx, 1, axis=0), jnp.roll(w, 1, axis=0), d2.handle)
        out2 = jax_ep.low_latency_combine_recv(buf, c2)
        out1 = jax_ep.low_latency_combine_recv(buf, c1)
        return results, outputs(d1, out1), outputs(d2, out2)

    results, split1, split2 = jax.device_get(spmd(R, body)(*map(flat, (x, idx, w, y, stats))))
    for i, got in enumerate(results):
        idxi, wi = np.roll(idx, i, axis=1), np.roll(w, i, axis=1)
        mode = "fp8" if i % 2 else "bf16"
        exp, out = expected(x, idxi, wi, y, stats, E, M, mode)
        check_oracle(per_rank(got, R), exp, out, mode, f"call {i}: ")
        x = out
    for shift, got in ((0, split1), (1, split2)):
        xi, idxi, wi = (np.roll(a, shift, axis=1) for a in (x, idx, w))
        check_oracle(per_rank(got, R), *expected(xi, idxi, wi, y, None, E, M, "bf16"), "bf16", f"in flight {shift}: ")


def loop_fn(R: int, steps: int):
    """`steps` low-latency dispatch + combine rounds in one jitted lax.fori_loop (the output feeds the next)."""
    T, H, K, E, M = 32, 256, 4, 2 * R, 32
    buf = ll_buffer(R, M, H, E, "cuda")

    def body(x, idx, w):
        def step(_, x):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            return jax_ep.low_latency_combine(buf, d.recv_x, idx, w, d.handle)

        return jax.lax.fori_loop(0, steps, step, x)

    return spmd(R, body), (T, H, K, E, M)


def check_loop(R: int, steps: int = 7):
    fn, (T, H, K, E, M) = loop_fn(R, steps)
    x, idx, w, _, _ = make_ll_inputs(R, T, H, K, E, M, seed=21, p_neg=0.3)
    w = np.abs(w) / K  # keeps the values in range over the steps
    got = ranks(jax.device_get(fn(*map(flat, (x, idx, w)))), R)
    want = x
    for _ in range(steps):
        exp = O.low_latency_dispatch(want, idx, E, M)
        want = O.low_latency_combine(exp.recv_x, idx, w, E, exp)[0].astype(O.BF16)
    assert_bits(got, want, f"{steps} jitted low-latency rounds vs oracle")
    assert ll_buffer(R, M, H, E, "cuda").errors() == []


@pytest.mark.parametrize("R", RANKS)
def test_jitted_loop_default_flags(R):
    check_loop(R)


@needs_one_process
@pytest.mark.parametrize("R", RANKS)
def test_jitted_loop_forced_command_buffers(R):
    """test_jitted_loop_default_flags with every op captured into CUDA graphs, in a fresh process (the flags apply
    at backend start)."""
    check_jitted_loop_with_forced_command_buffers(__file__, R)


@pytest.mark.parametrize("R", RANKS)
def test_two_micro_batches_overlap_computation(R):
    """DeepEP's two-micro-batch overlap: both dispatches in flight while a matmul runs, then both combines."""
    T, H, K, E, M = 32, 512, 6, 4 * R, 32
    xa, idx_a, wa, ya, _ = make_ll_inputs(R, T, H, K, E, M, seed=31)
    xb, idx_b, wb, yb, _ = make_ll_inputs(R, T, H, K, E, M, seed=32)
    buf = ll_buffer(R, M, H, E, "cuda")
    z = np.random.default_rng(0).standard_normal((R * 256, 256)).astype(np.float32)

    def body(xa, idx_a, wa, ya, xb, idx_b, wb, yb, z):
        send_a = jax_ep.low_latency_dispatch_send(buf, xa, idx_a, use_fp8=True)
        send_b = jax_ep.low_latency_dispatch_send(buf, xb, idx_b, use_fp8=False)
        z = jnp.tanh(z @ z.T) @ z  # computation between the halves
        da = jax_ep.low_latency_dispatch_recv(buf, send_a)
        db = jax_ep.low_latency_dispatch_recv(buf, send_b)
        ca = jax_ep.low_latency_combine_send(buf, ya, idx_a, wa, da.handle)
        z = jnp.tanh(z @ z.T) @ z
        cb = jax_ep.low_latency_combine_send(buf, yb, idx_b, wb, db.handle)
        out_a = jax_ep.low_latency_combine_recv(buf, ca)
        out_b = jax_ep.low_latency_combine_recv(buf, cb)
        return outputs(da, out_a), outputs(db, out_b), z

    got_a, got_b, _ = jax.device_get(spmd(R, body)(*map(flat, (xa, idx_a, wa, ya, xb, idx_b, wb, yb)), z))
    check_oracle(per_rank(got_a, R), *expected(xa, idx_a, wa, ya, None, E, M, "fp8"), "fp8", "micro-batch a: ")
    check_oracle(per_rank(got_b, R), *expected(xb, idx_b, wb, yb, None, E, M, "bf16"), "bf16", "micro-batch b: ")


# ----------------------------------------------------------------------------------------------------------------
# Misuse: a third send in flight
# ----------------------------------------------------------------------------------------------------------------
@needs_one_process
@pytest.mark.bounded_wait
@pytest.mark.parametrize("R", [2])
def test_third_send_in_flight_times_out(R):
    """Three dispatch sends before the first receive (tests/worker.py, mode third_send): the third waits for a
    credit that only that receive gives, times out, records the op and the credit wait, and traps; the error
    reaches Python. (With one process per GPU, test_multiprocess_gpu.py runs it in every process, on both
    transports.)"""
    proc = run_in_fresh_process("third_send", R)
    assert "RAISED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = [line for line in proc.stdout.splitlines() if line.startswith("RECORD")]
    assert record and "low_latency_dispatch (send) timed out" in record[0] and "credit" in record[0], proc.stdout


# Masked ranks: the Buffer's bound on each wait (the asymmetric masks below make one rank wait that long once).
MASK_TIMEOUT_S = 2.0


@pytest.mark.parametrize("R", RANKS)
def test_masked_ranks_by_hand_then_reset(R):
    """Config(on_timeout="mask") on the kernels (docs/design.md, "Masked ranks"), against the oracle with the masks:
    1. every rank masks rank 1 and rank 1 every other (no wait on a masked rank): dispatch bit for bit, num_masked,
       combine within the k-order sum's rounding; masked_ranks reads the masks back with the call they took
       effect at; the GPUs' memory in use is the same after 1,000 more steps and after 1,000 after those;
    2. every other rank masks rank 1, which masks none: rank 1's waits pass the bound and mask them all, without
       a trap; the results are still the oracle's (a row travels only between ranks that mask neither one
       another). (Only rank 0 masking rank 1 would leave a third rank waiting on the stalled rank 1, and that one
       could time out on it in turn, or not: docs/design.md, the cascade.)
    3. Buffer.reset_low_latency: no masks, full results; unmask_ranks refuses on this backend."""
    T, H, K, E, M = 16, 256, 4, 4 * R, 16
    buf = new_ll_buffer(R, M, H, E, "cuda", timeout_s=MASK_TIMEOUT_S, on_timeout="mask")
    x, idx, w, y, _ = make_ll_inputs(R, T, H, K, E, M, seed=7)

    def body(x, idx, w, y):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return d.recv_x, d.recv_count, d.num_masked[None], jax_ep.low_latency_combine(buf, y, idx, w, d.handle)

    step = spmd(R, body)
    args = (flat(x), flat(idx), flat(w), flat(y))

    def check(masked, what):
        recv_x, count, num_masked, out = jax.block_until_ready(step(*args))
        exp = O.low_latency_dispatch(x, idx, E, M, masked=masked)
        assert_bits(ranks(count, R), exp.recv_count, f"{what}: recv_count")
        assert_bits(np.asarray(num_masked), exp.num_masked, f"{what}: num_masked")
        rx = np.asarray(recv_x).reshape((R, E // R) + np.asarray(recv_x).shape[1:])
        assert_bits(rx[exp.valid], exp.recv_x[exp.valid], f"{what}: recv_x")
        acc, mag = O.low_latency_combine(y, idx, w, E, exp, masked=masked)
        got = ranks(out, R).astype(np.float32)
        assert np.all(np.abs(got - acc) <= 2.0**-8 * np.abs(acc) * 1.01 + 1e-5 * mag + 1e-30), f"{what}: combine"

    def set_masks(masked):
        for r in range(R):  # (with one process per GPU each process sets its own ranks')
            buf.mask_ranks(np.flatnonzero(masked[r]).tolist(), on=r)

    check(None, "before")
    out_of_job = np.zeros((R, R), bool)
    out_of_job[:, 1] = out_of_job[1, :] = True
    np.fill_diagonal(out_of_job, False)
    set_masks(out_of_job)
    local = buf.masked_ranks()
    assert local == {r: {p: 1 for p in np.flatnonzero(out_of_job[r])} for r in local}, local  # after one call
    check(out_of_job, "rank 1 out")
    in_use = []
    for _ in range(3):  # memory in use after each of three rounds of 1,000 steps
        for _ in range(1000):
            outs = step(*args)
        jax.block_until_ready(outs)
        del outs
        time.sleep(0.5)  # (buffers of the last calls' inputs are freed once their programs are done)
        in_use.append([d.memory_stats()["bytes_in_use"] for d in jax.local_devices()])
    # No growth: the last round above neither earlier one's. (One round's figure can come out below the steady
    # one, a buffer of the host-to-device copies not yet taken, so two rounds' figures alone can rise without a leak;
    # a leak raises every round's.)
    first, second, last = (np.array(round) for round in in_use)
    assert np.all(last <= np.maximum(first, second)), in_use

    buf.reset_low_latency()
    one_sided = np.zeros((R, R), bool)
    one_sided[:, 1] = True
    one_sided[1, 1] = False
    set_masks(one_sided)
    check(one_sided, "the others mask rank 1")
    local = buf.masked_ranks()
    others = set(range(R)) - {1}
    assert {r: set(v) for r, v in local.items()} == {r: others if r == 1 else {1} for r in local}, local

    buf.reset_low_latency()
    assert buf.masked_ranks() == {r: {} for r in local}
    check(None, "after the reset")
    with pytest.raises(ValueError, match="reset_low_latency"):
        buf.unmask_ranks()
