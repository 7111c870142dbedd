"""Bad input (docs/design.md, "Bad input"): a clear Python error before anything runs, naming the argument and the
expected value; values that only exist inside jit (ids, counts) are counted on the device and `strict=True`
turns them into a run-time error.

Trace-time checks are exercised through `jax.jit(...).lower(...)`, which traces and lowers but compiles and
runs nothing.
"""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import mesh_of

R, T, H, K, E = 4, 4, 128, 2, 8  # ranks, tokens per rank, hidden, top-k, experts
L = E // R


# ---- helpers ----------------------------------------------------------------------------------------------

def lower_in_shard_map(mesh, op, *global_args):
    """Traces `op(*local_args)` per rank inside jit(shard_map) over axis "ep" (arguments split on their first
    axis) and lowers it; nothing runs. Returns the lowered computation."""

    def body(*local_args):
        op(*local_args)
        return jnp.zeros((1,), jnp.float32)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*global_args)


def run_in_shard_map(mesh, body, *global_args):
    """Runs `body` per rank under jit(shard_map); its outputs carry a leading per-rank axis."""
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*global_args)
    return jax.block_until_ready(out)


def x_global(dtype=jnp.float32, hidden=H, tokens=T):
    return jnp.ones((R * tokens, hidden), dtype)


def routing(tokens=T):
    """Valid global ids [R*T, K]: token g goes to expert g % E (rank (g % E) // L) and nowhere else, so every
    rank receives exactly tokens rows."""
    idx = np.full((R * tokens, K), -1, np.int32)
    idx[:, 0] = np.arange(R * tokens) % E
    return idx


def weights_global(tokens=T):
    return np.full((R * tokens, K), 0.5, np.float32)


def msg(text: str) -> str:
    """A literal pattern for pytest.raises(match=...)."""
    return re.escape(text)


@pytest.fixture(scope="module")
def mesh():
    return mesh_of(R)


@pytest.fixture
def buffer(mesh):
    with jax_ep.Buffer(mesh, "ep", backend="xla", num_experts=E) as buf:
        yield buf


@pytest.fixture
def ll_buffer(mesh):
    with jax_ep.Buffer(mesh, "ep", backend="xla", num_max_dispatch_tokens_per_rank=T, hidden=H,
                       num_experts=E) as buf:
        yield buf


def test_valid_inputs_lower(mesh, buffer, ll_buffer):
    """The baseline every other test perturbs is accepted."""

    def normal(x, idx, w):
        out = jax_ep.dispatch(buffer, x, idx, w)
        jax_ep.combine(buffer, out.recv_x, out.handle, topk_weights=out.recv_topk_weights, bias=x)
        jax_ep.get_dispatch_layout(buffer, idx)

    def low_latency(x, idx, w):
        out = jax_ep.low_latency_dispatch(ll_buffer, x, idx, use_fp8=False)
        jax_ep.low_latency_combine(ll_buffer, out.recv_x, idx, w, out.handle)

    lower_in_shard_map(mesh, normal, x_global(), routing(), weights_global())
    lower_in_shard_map(mesh, low_latency, x_global(jnp.bfloat16), routing(), weights_global())


# ---- x ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x, got", [
    (jnp.ones((R * T, H), jnp.int32), "int32[4, 128]"),
    (jnp.ones((R * T,), jnp.float32), "float32[4]"),
    (jnp.ones((R * T, 2, H), jnp.float32), "float32[4, 2, 128]"),
    (jnp.ones((R * T, H), jnp.bool_), "bool[4, 128]"),
], ids=["int", "rank1", "rank3", "bool"])
def test_dispatch_x_dtype_and_rank(mesh, buffer, x, got):
    with pytest.raises(TypeError, match=msg(f"jax_ep.dispatch: x must be a floating [num_tokens, hidden] array, got {got}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), x, routing())


@pytest.mark.parametrize("hidden", [100, 64, 129, 200])
def test_dispatch_hidden_not_multiple_of_128(mesh, buffer, hidden):
    with pytest.raises(ValueError, match=msg(f"x hidden size must be a positive multiple of 128, got {hidden}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), x_global(hidden=hidden), routing())


def test_get_dispatch_layout_takes_no_hidden_and_checks_topk_idx(mesh, buffer):
    with pytest.raises(TypeError, match=msg("jax_ep.get_dispatch_layout: topk_idx must be int32 [num_tokens, num_topk >= 1], got float32[4, 2]")):
        lower_in_shard_map(mesh, lambda i: jax_ep.get_dispatch_layout(buffer, i), routing().astype(np.float32))


# ---- topk_idx / topk_weights ------------------------------------------------------------------------------

@pytest.mark.parametrize("idx, got", [
    (np.zeros((R * T, K), np.float32), "float32[4, 2]"),
    (np.zeros((R * T, K), np.int16), "int16[4, 2]"),
    (np.zeros((R * T, K), np.uint32), "uint32[4, 2]"),
    (np.zeros((R * T,), np.int32), "int32[4]"),
    (np.zeros((R * T, K, 1), np.int32), "int32[4, 2, 1]"),
], ids=["float32", "int16", "uint32", "rank1", "rank3"])
def test_dispatch_topk_idx_dtype_and_rank(mesh, buffer, idx, got):
    with pytest.raises(TypeError, match=msg(f"jax_ep.dispatch: topk_idx must be int32 [num_tokens, num_topk >= 1], got {got}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), x_global(), idx)


def test_dispatch_topk_idx_token_count_differs_from_x(mesh, buffer):
    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: topk_idx has 2 tokens, x has 4")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), x_global(), routing(tokens=2))


def test_dispatch_requires_topk_idx_or_handle(mesh, buffer):
    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: topk_idx is required (or pass handle= for a cached dispatch)")):
        lower_in_shard_map(mesh, lambda x: jax_ep.dispatch(buffer, x), x_global())


@pytest.mark.parametrize("w, got", [
    (np.zeros((R * T, K), np.float16), "float16[4, 2]"),
    (jnp.zeros((R * T, K), jnp.bfloat16), "bfloat16[4, 2]"),
    (np.zeros((R * T, K), np.int32), "int32[4, 2]"),
    (np.zeros((R * T, K + 1), np.float32), "float32[4, 3]"),
    (np.zeros((R * T,), np.float32), "float32[4]"),
], ids=["float16", "bfloat16", "int32", "wrong_k", "rank1"])
def test_dispatch_topk_weights(mesh, buffer, w, got):
    with pytest.raises(TypeError, match=msg(f"jax_ep.dispatch: topk_weights must be float32 [4, 2] like topk_idx, got {got}")):
        lower_in_shard_map(mesh, lambda x, i, w: jax_ep.dispatch(buffer, x, i, w), x_global(), routing(), w)


def test_dispatch_topk_idx_without_columns(mesh, buffer):
    with pytest.raises((TypeError, ValueError), match="topk_idx"):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), x_global(), np.zeros((R * T, 0), np.int32))


# ---- FP8 pair ---------------------------------------------------------------------------------------------

def fp8_pair(values_dtype=jnp.float8_e4m3fn, hidden=H, scales_shape=None, scales_dtype=jnp.float32):
    values = jnp.zeros((R * T, hidden), values_dtype)
    scales = jnp.ones(scales_shape or (R * T, hidden // 128), scales_dtype)
    return values, scales


def test_fp8_pair_accepted(mesh, buffer):
    lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), fp8_pair(), routing())


@pytest.mark.parametrize("pair, exc, text", [
    (fp8_pair(values_dtype=jnp.float32), TypeError,
     "jax_ep.dispatch: x_e4m3 must be float8_e4m3fn [T, H], got float32[4, 128]"),
    (fp8_pair(values_dtype=jnp.float8_e5m2), TypeError,
     "jax_ep.dispatch: x_e4m3 must be float8_e4m3fn [T, H], got float8_e5m2[4, 128]"),
    (fp8_pair(scales_shape=(R * T, H)), TypeError,
     "jax_ep.dispatch: FP8 scales must be float32 [4, 1], got float32[4, 128]"),
    (fp8_pair(hidden=256, scales_shape=(R * T, 1)), TypeError,
     "jax_ep.dispatch: FP8 scales must be float32 [4, 2], got float32[4, 1]"),
    (fp8_pair(scales_dtype=jnp.bfloat16), TypeError,
     "jax_ep.dispatch: FP8 scales must be float32 [4, 1], got bfloat16[4, 1]"),
    (fp8_pair(hidden=192, scales_shape=(R * T, 1)), ValueError,
     "jax_ep.dispatch: x hidden size must be a positive multiple of 128, got 192"),
    ((jnp.zeros((R * T, H), jnp.float8_e4m3fn),), TypeError,
     "jax_ep.dispatch: an FP8 x is the pair (x_e4m3, scales), got 1 arrays"),
], ids=["values_f32", "values_e5m2", "scales_shape", "scales_groups", "scales_dtype", "hidden", "not_a_pair"])
def test_fp8_pair_bad(mesh, buffer, pair, exc, text):
    with pytest.raises(exc, match=msg(text)):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i), pair, routing())


def test_fp8_pair_cached_dispatch_checked(mesh, buffer):
    def op(x, i):
        handle = jax_ep.dispatch(buffer, x, i).handle
        jax_ep.dispatch(buffer, (x.astype(jnp.float8_e4m3fn), jnp.ones((T, 2), jnp.float32)), handle=handle)

    with pytest.raises(TypeError, match=msg("FP8 scales must be float32 [4, 1], got float32[4, 2]")):
        lower_in_shard_map(mesh, op, x_global(), routing())


# ---- expert ids (concrete values) -------------------------------------------------------------------------
# Inside shard_map the ops see tracers for their arguments; the value check runs when topk_idx is concrete,
# e.g. a NumPy array captured by the per-rank function. Traced ids are counted instead (see strict below).

@pytest.mark.parametrize("bad_id", [E, E + 5, -2, -100])
@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_concrete_expert_ids_out_of_range(mesh, buffer, bad_id, jitted):
    local_idx = routing()[:T].copy()
    local_idx[1, 1] = bad_id

    def body(x):
        jax_ep.dispatch(buffer, x, local_idx)  # concrete, captured: checked while tracing
        return jnp.zeros((1,), jnp.float32)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(ValueError, match=msg(f"jax_ep.dispatch: topk_idx holds ids outside [-1, {E}): [{bad_id}]")):
        (jax.jit(fn).lower if jitted else fn)(x_global())


def test_concrete_expert_ids_checked_by_layout_and_low_latency(mesh, ll_buffer):
    local_idx = routing()[:T].copy()
    local_idx[0, 0] = E
    with pytest.raises(ValueError, match=msg(f"jax_ep.get_dispatch_layout: topk_idx holds ids outside [-1, {E}): [{E}]")):
        lower_in_shard_map(mesh, lambda x: jax_ep.get_dispatch_layout(ll_buffer, local_idx), x_global())
    with pytest.raises(ValueError, match=msg(f"jax_ep.low_latency_dispatch: topk_idx holds ids outside [-1, {E}): [{E}]")):
        lower_in_shard_map(mesh, lambda x: jax_ep.low_latency_dispatch(ll_buffer, x, local_idx), x_global(jnp.bfloat16))


def test_concrete_ids_message_lists_the_bad_ids(mesh, buffer):
    local_idx = np.array([[0, 9], [-3, 1], [12, -1], [2, 3]], np.int32)
    with pytest.raises(ValueError, match=msg(f"topk_idx holds ids outside [-1, {E}): [9, -3, 12]")):
        lower_in_shard_map(mesh, lambda x: jax_ep.dispatch(buffer, x, local_idx), x_global())


def test_traced_invalid_ids_are_counted_not_raised(mesh, buffer):
    """Without strict, an id outside [-1, E) inside jit is treated as -1 and counted in invalid_ids."""
    idx = routing()
    idx[0, 1], idx[5, 1], idx[6, 1] = E, -2, 1000

    def body(x, i):
        out = jax_ep.dispatch(buffer, x, i)
        return out.invalid_ids[None], out.num_recv_tokens[None]

    invalid, num_recv = run_in_shard_map(mesh, body, x_global(), idx)
    np.testing.assert_array_equal(invalid, [1, 2, 0, 0])
    np.testing.assert_array_equal(num_recv, [T] * R)  # the invalid entries routed nothing


# ---- number of experts / ranks ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_experts", [6, 9, 2, -4])
def test_num_experts_not_a_multiple_of_ranks(mesh, num_experts):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla")
    text = f"num_experts must be a positive multiple of the {R} EP ranks, got {num_experts}"
    with pytest.raises(ValueError, match=msg(f"jax_ep.dispatch: {text}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buf, x, i, num_experts=num_experts), x_global(), routing())
    with pytest.raises(ValueError, match=msg(f"jax_ep.get_dispatch_layout: {text}")):
        lower_in_shard_map(mesh, lambda i: jax_ep.get_dispatch_layout(buf, i, num_experts), routing())


def test_num_experts_required_by_layout(mesh):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla")
    with pytest.raises(ValueError, match=msg("jax_ep.get_dispatch_layout: num_experts is required (pass it or set it on the Buffer)")):
        lower_in_shard_map(mesh, lambda i: jax_ep.get_dispatch_layout(buf, i), routing())


def test_num_experts_required_by_dispatch(mesh):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla")
    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: num_experts is required (pass it or set it on the Buffer)")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buf, x, i), x_global(), routing())


@pytest.mark.parametrize("num_experts", [8.0, "8", True])
def test_num_experts_not_an_integer(mesh, num_experts):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla")
    text = f"jax_ep.dispatch: num_experts must be an integer, got {num_experts!r} ({type(num_experts).__name__})"
    with pytest.raises(TypeError, match=msg(text)):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buf, x, i, num_experts=num_experts), x_global(), routing())


def test_num_experts_zero_with_buffer_default(mesh, buffer):
    with pytest.raises(ValueError, match=msg("num_experts must be a positive multiple")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i, num_experts=0), x_global(), routing())


@pytest.mark.parametrize("name, value", [("max_recv_tokens", 0), ("max_recv_tokens", -3), ("expert_alignment", 0)])
def test_dispatch_positive_integers(mesh, buffer, name, value):
    with pytest.raises(ValueError, match=msg(f"jax_ep.dispatch: {name} must be a positive integer, got {value}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i, **{name: value}), x_global(), routing())


@pytest.mark.parametrize("expert_alignment, capacity", [(2 ** 30, None), (1, 2 ** 31)])
def test_expert_major_rows_beyond_int32(mesh, buffer, expert_alignment, capacity):
    """Padding groups to 2^30 rows (or a capacity of 2^31) would overflow the int32 group offsets and pair rows."""
    with pytest.raises(ValueError, match=msg("more than int32 row indices hold")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i, layout="expert_major",
                                                              expert_alignment=expert_alignment,
                                                              max_recv_tokens=capacity), x_global(), routing())


def test_dispatch_fractional_capacity(mesh, buffer):
    with pytest.raises((TypeError, ValueError), match="max_recv_tokens"):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i, max_recv_tokens=2.5), x_global(), routing())


def test_buffer_used_on_an_axis_of_another_size(buffer):
    mesh8 = mesh_of(8)
    with pytest.raises(ValueError, match=r"4.*8|8.*4"):
        lower_in_shard_map(mesh8, lambda x, i: jax_ep.dispatch(buffer, x, i),
                           jnp.ones((8 * T, H), jnp.float32), np.zeros((8 * T, K), np.int32))


# ---- cached dispatch --------------------------------------------------------------------------------------

def test_cached_dispatch_token_count(mesh, buffer):
    def op(x, i):
        handle = jax_ep.dispatch(buffer, x, i).handle
        jax_ep.dispatch(buffer, x[:2], handle=handle)

    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: x has 2 tokens, the handle routes 4")):
        lower_in_shard_map(mesh, op, x_global(), routing())


def test_cached_dispatch_x_checked(mesh, buffer):
    def op(x, i):
        handle = jax_ep.dispatch(buffer, x, i).handle
        jax_ep.dispatch(buffer, x.astype(jnp.int32), handle=handle)

    with pytest.raises(TypeError, match=msg("jax_ep.dispatch: x must be a floating [num_tokens, hidden] array, got int32[4, 128]")):
        lower_in_shard_map(mesh, op, x_global(), routing())


# ---- combine ----------------------------------------------------------------------------------------------

def combine_after_dispatch(buffer, make_y, max_recv_tokens=None, topk_weights=None, bias=None):
    def op(x, i):
        out = jax_ep.dispatch(buffer, x, i, max_recv_tokens=max_recv_tokens)
        w = None if topk_weights is None else topk_weights(out)
        b = None if bias is None else bias(x)
        jax_ep.combine(buffer, make_y(out), out.handle, topk_weights=w, bias=b)
    return op


@pytest.mark.parametrize("make_y, capacity, got", [
    (lambda out: out.recv_x[:-1], R * T, "float32[15, 128]"),
    (lambda out: jnp.concatenate([out.recv_x, out.recv_x]), R * T, "float32[32, 128]"),
    (lambda out: out.recv_x[None], R * T, "float32[1, 16, 128]"),
    (lambda out: out.recv_x.astype(jnp.int32), R * T, "int32[16, 128]"),
    (lambda out: jnp.zeros((R * T, H)), 6, "float32[16, 128]"),
], ids=["fewer_rows", "more_rows", "rank3", "int", "capacity_6"])
def test_combine_y_shape(mesh, buffer, make_y, capacity, got):
    max_recv = None if capacity == R * T else capacity
    text = f"jax_ep.combine: y must be floating [{capacity}, hidden] (the dispatch capacity), got {got}"
    with pytest.raises(TypeError, match=msg(text)):
        lower_in_shard_map(mesh, combine_after_dispatch(buffer, make_y, max_recv), x_global(), routing())


def test_combine_y_hidden_not_multiple_of_128(mesh, buffer):
    with pytest.raises(ValueError, match=msg("jax_ep.combine: y hidden size must be a positive multiple of 128, got 96")):
        lower_in_shard_map(mesh, combine_after_dispatch(buffer, lambda out: out.recv_x[:, :96]), x_global(), routing())


@pytest.mark.parametrize("make_bias, got", [
    (lambda x: x[:2], "[2, 128]"),
    (lambda x: jnp.concatenate([x, x], axis=1), "[4, 256]"),
    (lambda x: x[0], "[128]"),
], ids=["tokens", "hidden", "rank1"])
def test_combine_bias_shape(mesh, buffer, make_bias, got):
    op = combine_after_dispatch(buffer, lambda out: out.recv_x, bias=make_bias)
    with pytest.raises(TypeError, match=msg(f"jax_ep.combine: bias must be floating [4, 128], got float32{got}")):
        lower_in_shard_map(mesh, op, x_global(), routing())


def test_combine_integer_bias(mesh, buffer):
    """An integer bias is an error, not a silent cast."""
    op = combine_after_dispatch(buffer, lambda out: out.recv_x, bias=lambda x: x.astype(jnp.int32))
    with pytest.raises(TypeError, match=msg("jax_ep.combine: bias must be floating [4, 128], got int32[4, 128]")):
        lower_in_shard_map(mesh, op, x_global(), routing())


def test_combine_handle_of_another_kind(mesh, buffer):
    def op(x, idx):
        return jax_ep.combine(buffer, jax_ep.dispatch(buffer, x, idx, num_experts=E).recv_x, {"rows": idx}).x

    with pytest.raises(TypeError, match=msg("jax_ep.combine: handle must be the handle of a jax_ep.dispatch "
                                            "(DispatchResult.handle), got dict")):
        lower_in_shard_map(mesh, op, x_global(), routing())


@pytest.mark.parametrize("extra, names", [(dict(num_experts=E), "num_experts"), (dict(strict=True), "strict"),
                                          (dict(max_recv_tokens=8, expert_alignment=2), "max_recv_tokens, "
                                                                                         "expert_alignment")])
def test_cached_dispatch_takes_x_alone(mesh, buffer, extra, names):
    def op(x, idx):
        handle = jax_ep.dispatch(buffer, x, idx, num_experts=E).handle
        return jax_ep.dispatch(buffer, x, handle=handle, **extra).recv_x

    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: a cached dispatch (handle=) takes x alone, the routing "
                                             f"comes from the handle; got {names} too")):
        lower_in_shard_map(mesh, op, x_global(), routing())


def test_cached_dispatch_ignores_no_topk_idx(mesh, buffer):
    def op(x, idx):
        handle = jax_ep.dispatch(buffer, x, idx, num_experts=E).handle
        return jax_ep.dispatch(buffer, x, idx, handle=handle).recv_x

    with pytest.raises(ValueError, match=msg("got topk_idx too")):
        lower_in_shard_map(mesh, op, x_global(), routing())


@pytest.mark.parametrize("call", ["dispatch", "combine", "get_dispatch_layout"])
def test_buffer_left_out(mesh, buffer, call):
    """Called without the Buffer (the other arguments shifted one place), each op names the missing first
    argument, not what then lands in its second."""
    def combine_without_buffer(x, i):
        d = jax_ep.dispatch(buffer, x, i, num_experts=E)
        return jax_ep.combine(d.recv_x, d.handle, d.recv_topk_weights)

    ops = {"dispatch": lambda x, i: jax_ep.dispatch(x, i, None, num_experts=E),
           "combine": combine_without_buffer,
           "get_dispatch_layout": lambda x, i: jax_ep.get_dispatch_layout(i, E)}
    with pytest.raises(TypeError, match=msg(f"jax_ep.{call}: the first argument must be the jax_ep.Buffer")):
        lower_in_shard_map(mesh, ops[call], x_global(), routing())


@pytest.mark.parametrize("make_w, exc_text", [
    (lambda out: jnp.zeros((R * T - 1, K), jnp.float32), "topk_weights must be float32 [16, num_topk], got [15, 2]"),
    (lambda out: jnp.zeros((R * T,), jnp.float32), "topk_weights must be float32 [16, num_topk], got [16]"),
    (lambda out: jnp.zeros((R * T, K), jnp.float16), "topk_weights must be float32[16, 2], got float16[16, 2]"),
], ids=["rows", "rank1", "dtype"])
def test_combine_topk_weights(mesh, buffer, make_w, exc_text):
    op = combine_after_dispatch(buffer, lambda out: out.recv_x, topk_weights=make_w)
    with pytest.raises(TypeError, match=msg(f"jax_ep.combine: {exc_text}")):
        lower_in_shard_map(mesh, op, x_global(), routing())


# ---- outside shard_map ------------------------------------------------------------------------------------

def test_ops_outside_shard_map(mesh, buffer, ll_buffer):
    x, idx, w = x_global()[:T], routing()[:T], weights_global()[:T]
    inside = "call it inside jax.shard_map over the Buffer's axis 'ep'"
    with pytest.raises(ValueError, match=msg(f"jax_ep.dispatch: {inside}")):
        jax_ep.dispatch(buffer, x, idx, w)
    with pytest.raises(ValueError, match=msg(f"jax_ep.get_dispatch_layout: {inside}")):
        jax_ep.get_dispatch_layout(buffer, idx)
    with pytest.raises(ValueError, match=msg(f"jax_ep.low_latency_dispatch: {inside}")):
        jax_ep.low_latency_dispatch(ll_buffer, x.astype(jnp.bfloat16), idx)
    with pytest.raises(ValueError, match=msg(f"jax_ep.dispatch: {inside}")):
        jax.jit(lambda x, i: jax_ep.dispatch(buffer, x, i))(x, idx)

    # combine and low_latency_combine with genuine handles brought out of a shard_map
    def body(x, i):
        out = jax_ep.dispatch(buffer, x, i)
        ll = jax_ep.low_latency_dispatch(ll_buffer, x.astype(jnp.bfloat16), i, use_fp8=False)
        return out.recv_x, out.handle, ll.recv_x[None], jax.tree.map(lambda a: a[None], ll.handle)

    recv_x, handle, ll_recv, ll_handle = run_in_shard_map(mesh, body, x_global(), routing())
    with pytest.raises(ValueError, match=msg(f"jax_ep.combine: {inside}")):
        jax_ep.combine(buffer, recv_x, handle)
    with pytest.raises(ValueError, match=msg(f"jax_ep.low_latency_combine: {inside}")):
        jax_ep.low_latency_combine(ll_buffer, ll_recv[0], idx, w, jax.tree.map(lambda a: a[0], ll_handle))


def test_ops_in_shard_map_over_another_axis(buffer):
    other = mesh_of(R, axis_name="tokens")

    def body(x, i):
        jax_ep.dispatch(buffer, x, i)
        return x

    fn = jax.shard_map(body, mesh=other, in_specs=P("tokens"), out_specs=P("tokens"))
    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: call it inside jax.shard_map over the Buffer's axis 'ep'")):
        jax.jit(fn).lower(x_global(), routing())


# ---- Buffer arguments -------------------------------------------------------------------------------------

def test_buffer_mesh_type():
    with pytest.raises(TypeError, match=msg("jax_ep.Buffer: mesh must be a jax.sharding.Mesh, got list")):
        jax_ep.Buffer(list(jax.devices()), "ep")


def test_buffer_axis_not_in_mesh(mesh):
    with pytest.raises(ValueError, match=msg("jax_ep.Buffer: axis_name 'tp' is not an axis of the mesh {'ep': 4}")):
        jax_ep.Buffer(mesh, "tp", backend="xla")


@pytest.mark.parametrize("hidden", [100, 0, -128, 64])
def test_buffer_bad_hidden(mesh, hidden):
    with pytest.raises(ValueError, match=msg(f"jax_ep.Buffer: hidden must be a positive multiple of 128, got {hidden}")):
        jax_ep.Buffer(mesh, "ep", backend="xla", hidden=hidden)


@pytest.mark.parametrize("num_experts", [6, 0, -8, 3])
def test_buffer_bad_num_experts(mesh, num_experts):
    text = f"jax_ep.Buffer: num_experts must be a positive multiple of the 4 ranks on axis 'ep', got {num_experts}"
    with pytest.raises(ValueError, match=msg(text)):
        jax_ep.Buffer(mesh, "ep", backend="xla", num_experts=num_experts)


@pytest.mark.parametrize("value", [0, -1])
def test_buffer_bad_num_max_dispatch_tokens(mesh, value):
    text = f"jax_ep.Buffer: num_max_dispatch_tokens_per_rank must be positive, got {value}"
    with pytest.raises(ValueError, match=msg(text)):
        jax_ep.Buffer(mesh, "ep", backend="xla", num_max_dispatch_tokens_per_rank=value)


@pytest.mark.parametrize("backend", ["tpu", "XLA", "", None])
def test_buffer_bad_backend_name(mesh, backend):
    with pytest.raises(ValueError, match=msg(f"jax_ep: backend must be one of ('auto', 'cuda', 'xla'), got {backend!r}")):
        jax_ep.Buffer(mesh, "ep", backend=backend)


def test_buffer_cuda_backend_on_cpu():
    cpu_mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("ep",))
    with pytest.raises(ValueError, match=msg("jax_ep: backend='cuda' needs CUDA devices, the mesh is on 'cpu'")):
        jax_ep.Buffer(cpu_mesh, "ep", backend="cuda")


def test_buffer_auto_backend_on_cpu_is_xla():
    cpu_mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("ep",))
    assert jax_ep.Buffer(cpu_mesh, "ep").backend == "xla"


def test_buffer_config_type(mesh):
    with pytest.raises(TypeError, match="config"):
        jax_ep.Buffer(mesh, "ep", backend="xla", config={"num_sms": 3})


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_max_dispatch_tokens_per_rank=2.5), "num_max_dispatch_tokens_per_rank"),
    (dict(hidden=256.0), "hidden"),
    (dict(hidden="256"), "hidden"),
    (dict(num_experts=8.0), "num_experts"),
], ids=["M_float", "hidden_float", "hidden_str", "E_float"])
def test_buffer_sizes_must_be_integers(mesh, kwargs, name):
    with pytest.raises((TypeError, ValueError), match=f"jax_ep.Buffer: {name}"):
        jax_ep.Buffer(mesh, "ep", backend="xla", **kwargs)


# ---- low-latency transport -------------------------------------------------------------------------------

LL_SIZES = dict(num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)


@pytest.mark.parametrize("transport", ["NVSHMEM", "peer_stores", "", None])
def test_buffer_bad_low_latency_transport(mesh, transport):
    text = f"jax_ep.Buffer: low_latency_transport must be one of ('auto', 'nvshmem'), got {transport!r}"
    with pytest.raises(ValueError, match=msg(text)):
        jax_ep.Buffer(mesh, "ep", backend="xla", low_latency_transport=transport, **LL_SIZES)


def test_buffer_bad_low_latency_transport_environment(mesh, monkeypatch):
    monkeypatch.setenv("JAX_EP_LL_TRANSPORT", "ibgda")
    text = "jax_ep.Buffer: $JAX_EP_LL_TRANSPORT must be one of ('auto', 'nvshmem') or unset, got 'ibgda'"
    with pytest.raises(ValueError, match=msg(text)):
        jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES)


@pytest.mark.parametrize("sizes", [LL_SIZES, {}], ids=["low_latency_sizes", "no_sizes"])
def test_nvshmem_transport_needs_the_cuda_kernels(mesh, sizes):
    with pytest.raises(ValueError, match=msg("jax_ep.Buffer: low_latency_transport='nvshmem' is for the cuda "
                                             "low-latency kernels; this Buffer has the 'xla' backend")):
        jax_ep.Buffer(mesh, "ep", backend="xla", low_latency_transport="nvshmem", **sizes)


def test_forced_nvshmem_transport_is_ignored_where_no_kernels_run(mesh, monkeypatch):
    """The environment forces the transport of the Buffers it can apply to; an xla Buffer has no transport."""
    monkeypatch.setenv("JAX_EP_LL_TRANSPORT", "nvshmem")
    assert jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES).low_latency_transport is None


def resolve(requested, *, environ=None, low_latency=True, one_process_per_gpu=False):
    forced = jax_ep.environment.overrides(environ or {}).low_latency_transport
    return jax_ep.backends.selection.resolve_low_latency_transport(requested, backend="cuda", low_latency=low_latency,
                                                                     one_process_per_gpu=one_process_per_gpu,
                                                                     forced=forced)


def test_transport_resolution_of_a_cuda_buffer():
    """What a cuda Buffer (which a CPU run cannot create) resolves to: peer stores unless NVSHMEM is asked for,
    by argument or environment; nothing without low-latency sizes."""
    assert resolve("auto") == "peer_stores"
    assert resolve("auto", environ={"JAX_EP_LL_TRANSPORT": "auto"}) == "peer_stores"
    assert resolve("auto", environ={"JAX_EP_LL_TRANSPORT": ""}) == "peer_stores"
    assert resolve("auto", environ={"JAX_EP_LL_TRANSPORT": "nvshmem"}, low_latency=False) is None
    with pytest.raises(ValueError, match="this Buffer has no low-latency sizes"):
        resolve("nvshmem", low_latency=False)


@pytest.mark.parametrize("forced_by", ["argument", "environment"])
def test_nvshmem_transport_with_one_process_driving_several_gpus(forced_by):
    """NVSHMEM has one PE per process: forcing it for a Buffer whose process drives several GPUs (or whose mesh
    leaves processes out) is an error that names the setting, not a silent fallback."""
    requested, environ = ("nvshmem", {}) if forced_by == "argument" else ("auto", {"JAX_EP_LL_TRANSPORT": "nvshmem"})
    source = "low_latency_transport='nvshmem'" if forced_by == "argument" else "$JAX_EP_LL_TRANSPORT=nvshmem"
    with pytest.raises(ValueError, match=msg(f"jax_ep.Buffer: {source} needs one process per GPU over every process")):
        resolve(requested, environ=environ, one_process_per_gpu=False)


def test_one_process_per_gpu_of_a_mesh(mesh):
    """This CPU run is one process with 8 devices: a mesh of several of them is not one process per device, a
    mesh of one device is (the process owns exactly that device of the mesh)."""
    assert not jax_ep.backends.selection.one_process_per_gpu(mesh)
    assert jax_ep.backends.selection.one_process_per_gpu(Mesh(np.array(jax.devices()[:1]), ("ep",)))


def test_nvshmem_transport_needs_an_nvshmem_build(monkeypatch):
    monkeypatch.setattr(jax_ep._native, "with_nvshmem", lambda: False)
    with pytest.raises(RuntimeError, match="needs NVSHMEM, but this jax_ep was built without it"):
        resolve("nvshmem", one_process_per_gpu=True)


# ---- destroyed Buffer -------------------------------------------------------------------------------------

DESTROYED = "jax_ep: this Buffer was destroyed; create a new one"


def test_destroy_is_idempotent(mesh):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla")
    assert buf.alive
    buf.destroy()
    buf.destroy()
    assert not buf.alive


def each_op(buf, live):
    """Every public op with `buf` as its Buffer; `live` (an alive Buffer of the same shape) makes the handles."""

    def layout(x, i):
        jax_ep.get_dispatch_layout(buf, i)

    def dispatch(x, i):
        jax_ep.dispatch(buf, x, i)

    def cached_dispatch(x, i):
        jax_ep.dispatch(buf, x, handle=jax_ep.dispatch(live, x, i).handle)

    def combine(x, i):
        out = jax_ep.dispatch(live, x, i)
        jax_ep.combine(buf, out.recv_x, out.handle)

    def ll_dispatch(x, i):
        jax_ep.low_latency_dispatch(buf, x.astype(jnp.bfloat16), i)

    def ll_dispatch_send(x, i):
        jax_ep.low_latency_dispatch_send(buf, x.astype(jnp.bfloat16), i)

    def ll_combine(x, i):
        out = jax_ep.low_latency_dispatch(live, x.astype(jnp.bfloat16), i, use_fp8=False)
        jax_ep.low_latency_combine(buf, out.recv_x, i, jnp.ones(i.shape, jnp.float32), out.handle)

    return dict(layout=layout, dispatch=dispatch, cached_dispatch=cached_dispatch, combine=combine,
                ll_dispatch=ll_dispatch, ll_dispatch_send=ll_dispatch_send, ll_combine=ll_combine)


OPS = list(each_op(None, None))
LL_SIZES = dict(num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)


@pytest.mark.parametrize("op", OPS)
def test_destroyed_buffer(mesh, ll_buffer, op):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES)
    buf.destroy()
    with pytest.raises(RuntimeError, match=msg(DESTROYED)):
        lower_in_shard_map(mesh, each_op(buf, ll_buffer)[op], x_global(), routing())


@pytest.mark.parametrize("op", OPS)
def test_buffer_context_manager_destroys(mesh, ll_buffer, op):
    with jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES) as buf:
        assert buf.alive
        lower_in_shard_map(mesh, each_op(buf, ll_buffer)[op], x_global(), routing())  # fine inside
    assert not buf.alive
    with pytest.raises(RuntimeError, match=msg(DESTROYED)):
        lower_in_shard_map(mesh, each_op(buf, ll_buffer)[op], x_global(), routing())


def test_destroyed_buffer_between_send_and_recv(mesh):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES)

    def op(x, i):
        pending = jax_ep.low_latency_dispatch_send(buf, x, i)
        buf.destroy()
        jax_ep.low_latency_dispatch_recv(buf, pending)

    with pytest.raises(RuntimeError, match=msg(DESTROYED)):
        lower_in_shard_map(mesh, op, x_global(jnp.bfloat16), routing())


# ---- low-latency mode -------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", [
    dict(hidden=H, num_experts=E),
    dict(num_max_dispatch_tokens_per_rank=T, num_experts=E),
    dict(num_max_dispatch_tokens_per_rank=T, hidden=H),
    dict(),
], ids=["no_M", "no_H", "no_E", "none"])
def test_low_latency_needs_buffer_sizes(mesh, given):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla", **given)
    missing = ", ".join(n for n in ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts") if n not in given)
    text = f"jax_ep.low_latency_dispatch: create the Buffer with {missing} for low-latency ops"
    with pytest.raises(ValueError, match=msg(text)):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i), x_global(jnp.bfloat16), routing())


def test_low_latency_combine_needs_buffer_sizes(mesh, ll_buffer):
    buf = jax_ep.Buffer(mesh, "ep", backend="xla", num_experts=E)

    def op(x, i):
        out = jax_ep.low_latency_dispatch(ll_buffer, x, i, use_fp8=False)
        jax_ep.low_latency_combine(buf, out.recv_x, i, jnp.ones(i.shape, jnp.float32), out.handle)

    text = "jax_ep.low_latency_combine: create the Buffer with num_max_dispatch_tokens_per_rank, hidden for low-latency ops"
    with pytest.raises(ValueError, match=msg(text)):
        lower_in_shard_map(mesh, op, x_global(jnp.bfloat16), routing())


def test_low_latency_too_many_tokens(mesh, ll_buffer):
    text = f"jax_ep.low_latency_dispatch: {T + 1} tokens exceed the Buffer's num_max_dispatch_tokens_per_rank={T}"
    with pytest.raises(ValueError, match=msg(text)):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i),
                           x_global(jnp.bfloat16, tokens=T + 1), routing(tokens=T + 1))


def test_low_latency_fewer_tokens_than_m_is_fine(mesh, ll_buffer):
    lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i),
                       x_global(jnp.bfloat16, tokens=T - 1), routing(tokens=T - 1))


def test_low_latency_combine_too_many_tokens(mesh, ll_buffer):
    def op(x, i):
        out = jax_ep.low_latency_dispatch(ll_buffer, x, i, use_fp8=False)
        idx = jnp.concatenate([i, i])
        jax_ep.low_latency_combine(ll_buffer, out.recv_x, idx, jnp.ones(idx.shape, jnp.float32), out.handle)

    text = f"jax_ep.low_latency_combine: {2 * T} tokens exceed the Buffer's num_max_dispatch_tokens_per_rank={T}"
    with pytest.raises(ValueError, match=msg(text)):
        lower_in_shard_map(mesh, op, x_global(jnp.bfloat16), routing())


def test_low_latency_hidden_differs_from_buffer(mesh, ll_buffer):
    text = f"jax_ep.low_latency_dispatch: hidden {2 * H} differs from the Buffer's hidden={H}"
    with pytest.raises(ValueError, match=msg(text)):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i),
                           x_global(jnp.bfloat16, hidden=2 * H), routing())


def test_low_latency_combine_hidden_differs_from_buffer(mesh, ll_buffer):
    def op(x, i):
        out = jax_ep.low_latency_dispatch(ll_buffer, x, i, use_fp8=False)
        y = jnp.concatenate([out.recv_x, out.recv_x], axis=-1)
        jax_ep.low_latency_combine(ll_buffer, y, i, jnp.ones(i.shape, jnp.float32), out.handle)

    with pytest.raises(ValueError, match=msg(f"jax_ep.low_latency_combine: hidden {2 * H} differs from the Buffer's hidden={H}")):
        lower_in_shard_map(mesh, op, x_global(jnp.bfloat16), routing())


@pytest.mark.parametrize("x, text", [
    (x_global(jnp.float32), "x must be bfloat16[4, 128], got float32[4, 128]"),
    (x_global(jnp.float16), "x must be bfloat16[4, 128], got float16[4, 128]"),
    (jnp.ones((R * T, 1, H), jnp.bfloat16), "x must be bfloat16 [num_tokens, hidden], got bfloat16[4, 1, 128]"),
], ids=["float32", "float16", "rank3"])
def test_low_latency_x(mesh, ll_buffer, x, text):
    with pytest.raises(TypeError, match=msg(f"jax_ep.low_latency_dispatch: {text}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i), x, routing())


def test_low_latency_topk_idx(mesh, ll_buffer):
    with pytest.raises(TypeError, match=msg("jax_ep.low_latency_dispatch: topk_idx must be int32 [num_tokens, num_topk >= 1], got float32[4, 2]")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i),
                           x_global(jnp.bfloat16), routing().astype(np.float32))
    with pytest.raises(ValueError, match=msg("jax_ep.low_latency_dispatch: topk_idx has 3 tokens, x has 4")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i),
                           x_global(jnp.bfloat16), routing(tokens=3))


@pytest.mark.parametrize("stats, got", [
    (jnp.zeros((R * 3,), jnp.int32), "int32[3]"),
    (jnp.zeros((R * L,), jnp.float32), "float32[2]"),
], ids=["shape", "dtype"])
def test_low_latency_stats(mesh, ll_buffer, stats, got):
    def op(x, i, s):
        jax_ep.low_latency_dispatch(ll_buffer, x, i, cumulative_local_expert_recv_stats=s)

    text = f"jax_ep.low_latency_dispatch: cumulative_local_expert_recv_stats must be int32[{L}], got {got}"
    with pytest.raises(TypeError, match=msg(text)):
        lower_in_shard_map(mesh, op, x_global(jnp.bfloat16), routing(), stats)


def ll_combine_op(buffer, make_y=None, make_w=None):
    def op(x, i):
        out = jax_ep.low_latency_dispatch(buffer, x, i, use_fp8=False)
        y = out.recv_x if make_y is None else make_y(out.recv_x)
        w = jnp.ones(i.shape, jnp.float32) if make_w is None else make_w(i)
        jax_ep.low_latency_combine(buffer, y, i, w, out.handle)
    return op


@pytest.mark.parametrize("make_y, got", [
    (lambda y: y.astype(jnp.float32), "float32[2, 16, 128]"),
    (lambda y: y[:, :-1], "bfloat16[2, 15, 128]"),
    (lambda y: y[:1], "bfloat16[1, 16, 128]"),
], ids=["dtype", "rows", "experts"])
def test_low_latency_combine_y(mesh, ll_buffer, make_y, got):
    text = f"jax_ep.low_latency_combine: y must be bfloat16[{L}, {R * T}, {H}], got {got}"
    with pytest.raises(TypeError, match=msg(text)):
        lower_in_shard_map(mesh, ll_combine_op(ll_buffer, make_y=make_y), x_global(jnp.bfloat16), routing())


@pytest.mark.parametrize("make_w, got", [
    (lambda i: jnp.ones(i.shape, jnp.bfloat16), "bfloat16[4, 2]"),
    (lambda i: jnp.ones((T, K + 1), jnp.float32), "float32[4, 3]"),
], ids=["dtype", "shape"])
def test_low_latency_combine_weights(mesh, ll_buffer, make_w, got):
    text = f"jax_ep.low_latency_combine: topk_weights must be float32[{T}, {K}], got {got}"
    with pytest.raises(TypeError, match=msg(text)):
        lower_in_shard_map(mesh, ll_combine_op(ll_buffer, make_w=make_w), x_global(jnp.bfloat16), routing())


# ---- FP8 scale options ------------------------------------------------------------------------------------

UE8M0 = "use_ue8m0=True needs round_scale=True"


def test_ue8m0_needs_round_scale_cast():
    with pytest.raises(ValueError, match=msg(f"jax_ep: {UE8M0}")):
        jax_ep.per_token_cast_to_fp8(jnp.ones((T, 512), jnp.float32), use_ue8m0=True)


def test_ue8m0_needs_round_scale_low_latency(mesh, ll_buffer):
    with pytest.raises(ValueError, match=msg(f"jax_ep.low_latency_dispatch: {UE8M0}")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i, use_ue8m0=True),
                           x_global(jnp.bfloat16), routing())


def test_ue8m0_hidden_not_multiple_of_512(mesh, ll_buffer):
    with pytest.raises(ValueError, match="hidden.*512|512.*hidden"):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.low_latency_dispatch(ll_buffer, x, i, round_scale=True, use_ue8m0=True),
                           x_global(jnp.bfloat16), routing())


def test_cast_to_fp8_hidden_not_multiple_of_128():
    with pytest.raises(ValueError, match="128"):
        jax_ep.per_token_cast_to_fp8(jnp.ones((T, 100), jnp.float32))


# ---- Config -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, text", [
    (dict(num_sms=2.5), "Config.num_sms must be a positive integer, got 2.5"),
    (dict(num_sms=0), "Config.num_sms must be a positive integer, got 0"),
    (dict(num_sms=-2), "Config.num_sms must be a positive integer, got -2"),
    (dict(timeout_s=0), "Config.timeout_s must be positive, got 0"),
    (dict(timeout_s=-1.5), "Config.timeout_s must be positive, got -1.5"),
    (dict(host_timeout_s=0), "Config.host_timeout_s must be positive, got 0"),
    (dict(on_timeout="skip"), "Config.on_timeout must be one of ('trap', 'mask'), got 'skip'"),
], ids=["fractional_sms", "zero_sms", "negative_sms", "zero_timeout", "negative_timeout", "zero_host_timeout",
        "on_timeout"])
def test_config_validation(kwargs, text):
    with pytest.raises(ValueError, match=msg(text)):
        jax_ep.Config(**kwargs)


def test_config_valid():
    config = jax_ep.Config(num_sms=23, timeout_s=5, host_timeout_s=7)
    assert (config.num_sms, config.timeout_s, config.host_timeout_s) == (23, 5, 7)
    assert jax_ep.Config().host_timeout_s == 120  # processes reach a Buffer's creation minutes apart
    assert jax_ep.Config().on_timeout == "trap"


# ---- the key-value exchange of Buffer creation across processes -------------------------------------------

class FakeKeyValueStore:
    """What runtime.exchange uses of jax.distributed's client: set, and a get bounded in milliseconds that raises
    on its deadline (as the client does)."""

    def __init__(self, published=None):
        self.values, self.waits = dict(published or {}), []

    def key_value_set(self, key, value):
        if key in self.values:
            raise RuntimeError(f"key {key} already exists")
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        self.waits.append(timeout_ms)
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.values[key]


def test_exchange_publishes_then_reads_each_key_within_the_bound(monkeypatch):
    from jax_ep.backends.cuda import runtime

    store = FakeKeyValueStore({"b/1": "theirs"})
    monkeypatch.setattr(runtime.distributed.global_state, "client", store)
    assert runtime.exchange({"b/0": "mine"}, ["b/0", "b/1", "b/2"], timeout_s=1.5) == ["mine", "theirs", None]
    assert store.waits == [1500] * 3  # each wait bounded by timeout_s, a missing key read as None


def test_a_value_not_published_names_its_publisher():
    from jax_ep.backends.cuda import runtime

    assert runtime.require_published(["a", "b"], ["process 0", "process 1"], "create Buffer #2", 1.5) == ["a", "b"]
    with pytest.raises(RuntimeError, match=msg("jax_ep.Buffer: process 1 did not create Buffer #2 within 1.5 s")):
        runtime.require_published(["a", None], ["process 0", "process 1"], "create Buffer #2", 1.5)


def test_exchange_needs_jax_distributed(monkeypatch):
    from jax_ep.backends.cuda import runtime

    monkeypatch.setattr(runtime.distributed.global_state, "client", None)
    with pytest.raises(RuntimeError, match="the EP axis spans processes but jax.distributed is not initialized"):
        runtime.exchange({}, ["a"], timeout_s=1)


def test_different_sizes_name_the_rank():
    from jax_ep.backends.cuda import runtime

    mine = dict(num_ranks=2, hidden=256)
    runtime.require_same_sizes(mine, json.dumps(dict(mine, process=1, host="h")), "rank 1", "Buffer #3")  # extra keys
    with pytest.raises(ValueError, match=msg("jax_ep.Buffer: rank 1 created Buffer #3 with {'num_ranks': 2, "
                                             "'hidden': 512}, this process with {'num_ranks': 2, 'hidden': 256}; "
                                             "every rank must pass the same sizes")):
        runtime.require_same_sizes(mine, json.dumps(dict(num_ranks=2, hidden=512)), "rank 1", "Buffer #3")


# ---- strict: run-time errors for values inside jit --------------------------------------------------------

@pytest.fixture
def reset_effects(mesh, buffer):
    """A strict error leaves JAX's runtime token of those devices failed (re-raised by jax.effects_barrier and at
    exit). After the test, a successful strict run on the same devices replaces it."""
    yield
    run_in_shard_map(mesh, strict_body(buffer, None), x_global(), routing())
    jax.effects_barrier()


def strict_body(buffer, max_recv_tokens, strict=True):
    def body(x, i):
        out = jax_ep.dispatch(buffer, x, i, max_recv_tokens=max_recv_tokens, strict=strict)
        return out.num_dropped[None], out.invalid_ids[None], out.num_recv_tokens[None]
    return body


@pytest.mark.parametrize("capacity", [None, T, 2 * T])
def test_strict_passes_when_nothing_is_dropped(mesh, buffer, capacity):
    dropped, invalid, num_recv = run_in_shard_map(mesh, strict_body(buffer, capacity), x_global(), routing())
    jax.effects_barrier()
    np.testing.assert_array_equal(dropped, [0] * R)
    np.testing.assert_array_equal(invalid, [0] * R)
    np.testing.assert_array_equal(num_recv, [T] * R)


def test_not_strict_counts_dropped_tokens(mesh, buffer):
    dropped, _, num_recv = run_in_shard_map(mesh, strict_body(buffer, T - 1, strict=False), x_global(), routing())
    np.testing.assert_array_equal(dropped, [1] * R)
    np.testing.assert_array_equal(num_recv, [T - 1] * R)


def test_strict_raises_when_tokens_are_dropped(mesh, buffer, reset_effects):
    with pytest.raises(Exception) as info:
        run_in_shard_map(mesh, strict_body(buffer, T - 2), x_global(), routing())
    assert "jax_ep.dispatch(strict=True): 2 received tokens did not fit max_recv_tokens" in str(info.value)


def test_strict_raises_on_invalid_ids_inside_jit(mesh, buffer, reset_effects):
    idx = routing()
    idx[3, 1] = E  # traced: cannot be checked while tracing, counted on the device
    with pytest.raises(Exception) as info:
        run_in_shard_map(mesh, strict_body(buffer, None), x_global(), idx)
    assert "jax_ep.dispatch(strict=True): 1 top-k ids were outside [-1, 8) (treated as -1)" in str(info.value)


def test_strict_raises_on_negative_ids_inside_jit(mesh, buffer, reset_effects):
    idx = routing()
    idx[T + 1, 1] = -7
    idx[T + 2, 1] = -2
    with pytest.raises(Exception) as info:
        run_in_shard_map(mesh, strict_body(buffer, None), x_global(), idx)
    assert "jax_ep.dispatch(strict=True): 2 top-k ids were outside [-1, 8) (treated as -1)" in str(info.value)


def test_strict_message_names_the_needed_capacity(mesh, buffer, reset_effects):
    with pytest.raises(Exception) as info:
        run_in_shard_map(mesh, strict_body(buffer, T - 2), x_global(), routing())
    assert re.search(rf"max_recv_tokens\D+{T}\b", str(info.value)), str(info.value)


def test_dispatch_needs_tokens(mesh, buffer):
    x = np.zeros((0, H), np.float32)
    idx = np.zeros((0, K), np.int32)
    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: dispatch needs at least one token per rank, got 0")):
        lower_in_shard_map(mesh, lambda x, i: jax_ep.dispatch(buffer, x, i, num_experts=E).recv_x, x, idx)


def test_strict_raises_on_every_rank_when_one_rank_fails(mesh, buffer, reset_effects):
    """An invalid id on one rank only, then a collective (combine): every rank raises the same catchable error,
    naming the rank; before the ranks agreed on the counts, the others waited in the collective until XLA
    aborted the process."""
    idx = routing()
    idx[2 * T + 1, 0] = E + 3  # rank 2's token 1

    def body(x, i):
        out = jax_ep.dispatch(buffer, x, i, strict=True)
        return jax_ep.combine(buffer, out.recv_x, out.handle).x

    with pytest.raises(Exception) as info:
        run_in_shard_map(mesh, body, x_global(), idx)
    assert "jax_ep.dispatch(strict=True): 1 top-k ids were outside [-1, 8) (treated as -1) on rank 2" in str(
        info.value)


def test_strict_expert_major_names_the_rows_alignment_needs(mesh, buffer, reset_effects):
    """Expert-major rows: rank 0 receives one pair for each of its 2 experts, groups aligned to 4 rows (rows 0 and
    4); with 1 row the second pair drops, and keeping it needs 5 rows, not 1 + the 1 dropped."""
    idx = np.full((R * T, K), -1, np.int32)
    idx[0, 0], idx[1, 0] = 0, 1  # rank 0's tokens 0 and 1 to experts 0 and 1 (rank 0's)

    def body(x, i):
        out = jax_ep.dispatch(buffer, x, i, max_recv_tokens=1, expert_alignment=4, strict=True,
                              layout="expert_major")
        return out.num_dropped[None]

    with pytest.raises(Exception) as info:
        run_in_shard_map(mesh, body, x_global(), idx)
    assert ("jax_ep.dispatch(strict=True): 1 received (token, expert) pairs did not fit max_recv_tokens=1 on rank 0 "
            "(it needs max_recv_tokens >= 5)") in str(info.value), info.value


def test_strict_checkify_raises_with_the_message_first(mesh, buffer):
    """strict="checkify": under jax.experimental.checkify, err.throw() raises jax_ep's message first (no XLA
    callback text before it), the same on every rank, and nothing when nothing is wrong."""
    from jax.experimental import checkify

    idx = routing()
    idx[2 * T + 1, 0] = E + 3  # rank 2's token 1

    def body(x, i):
        out = jax_ep.dispatch(buffer, x, i, strict="checkify")
        return jax_ep.combine(buffer, out.recv_x, out.handle).x

    step = jax.jit(checkify.checkify(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))))
    err, _ = step(x_global(), idx)
    with pytest.raises(Exception) as info:
        err.throw()
    assert str(info.value).startswith(
        "jax_ep.dispatch(strict='checkify'): 1 top-k ids were outside [-1, 8) (treated as -1) on rank 2"), info.value
    err, _ = step(x_global(), routing())
    err.throw()  # nothing dropped, no invalid id


def test_strict_checkify_needs_checkify(mesh, buffer):
    """Without checkify.checkify around it, JAX refuses the checks while tracing (its message says what to do)."""
    with pytest.raises(ValueError, match="checkify"):
        lower_in_shard_map(mesh, strict_body(buffer, None, strict="checkify"), x_global(), routing())


def test_strict_must_be_a_mode(mesh, buffer):
    with pytest.raises(ValueError, match=msg("jax_ep.dispatch: strict must be one of (False, True, 'checkify'), got "
                                             "'yes'")):
        lower_in_shard_map(mesh, strict_body(buffer, None, strict="yes"), x_global(), routing())


def test_low_latency_combine_takes_the_dispatch_tokens(mesh, ll_buffer):
    """A combine given more (or fewer) tokens than its dispatch sent raises before anything runs: the rows of
    tokens it never sent do not exist (the cuda receive would read slots this call's send did not write)."""

    def body(x, idx, idx_more, w_more):
        out = jax_ep.low_latency_dispatch(ll_buffer, x, idx, use_fp8=False)
        return jax_ep.low_latency_combine(ll_buffer, out.recv_x, idx_more, w_more, out.handle)

    fewer = T - 1
    with pytest.raises(ValueError, match=msg(f"jax_ep.low_latency_combine: topk_idx has {T} tokens, the handle's "
                                             f"low_latency_dispatch sent {fewer}")):
        lower_in_shard_map(mesh, body, x_global(jnp.bfloat16, tokens=fewer), routing(fewer), routing(),
                           weights_global())


def test_low_latency_combine_needs_a_low_latency_handle(mesh, buffer, ll_buffer):
    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(ll_buffer, x, idx, use_fp8=False)
        return jax_ep.low_latency_combine(ll_buffer, out.recv_x, idx, w, {"src_token_index": out.handle})

    with pytest.raises(TypeError, match=msg("jax_ep.low_latency_combine: handle must be the handle of a "
                                            "jax_ep.low_latency_dispatch (LowLatencyDispatchResult.handle), got dict")):
        lower_in_shard_map(mesh, body, x_global(jnp.bfloat16), routing(), weights_global())


# ---- low-latency sends in flight ---------------------------------------------------------------------------

def test_third_low_latency_send_in_flight_raises(mesh):
    """Two sends of one op may await their receive; a third raises while tracing (the cuda kernels would wait for
    a receive that cannot run first). The other op's sends count apart."""
    buf = jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES)

    def three_sends(x, i):
        sends = [jax_ep.low_latency_dispatch_send(buf, x, i) for _ in range(3)]
        return sum(jax_ep.low_latency_dispatch_recv(buf, p).recv_count for p in sends)

    text = ("jax_ep.low_latency_dispatch_send: 2 sends of this Buffer already await their low_latency_dispatch_recv;"
            " at most 2 may (call a receive first)")
    with pytest.raises(ValueError, match=msg(text)):
        lower_in_shard_map(mesh, three_sends, x_global(jnp.bfloat16), routing())


def test_low_latency_sends_within_the_limit_run(mesh):
    """Send, send, receive, send, receive, receive: never more than two waiting, also when a pending passed through
    an optimization barrier (JAX rebuilds it) or the other op's sends are waiting too."""
    buf = jax_ep.Buffer(mesh, "ep", backend="xla", **LL_SIZES)

    def interleaved(x, i):
        first = jax_ep.low_latency_dispatch_send(buf, x, i, use_fp8=False)
        second = jax_ep.low_latency_dispatch_send(buf, x, i, use_fp8=False)
        first, second = jax.lax.optimization_barrier((first, second))
        counts = jax_ep.low_latency_dispatch_recv(buf, first).recv_count
        third = jax_ep.low_latency_dispatch_send(buf, x, i, use_fp8=False)
        counts += jax_ep.low_latency_dispatch_recv(buf, second).recv_count
        received = jax_ep.low_latency_dispatch_recv(buf, third)
        y = jnp.zeros_like(received.recv_x)
        weights = jnp.ones(i.shape, jnp.float32)
        combines = [jax_ep.low_latency_combine_send(buf, y, i, weights, received.handle) for _ in range(2)]
        out = sum(jax_ep.low_latency_combine_recv(buf, p).astype(jnp.float32) for p in combines)
        return counts + received.recv_count, out

    for _ in range(2):  # traced twice: nothing left counted from the first trace
        lower_in_shard_map(mesh, interleaved, x_global(jnp.bfloat16), routing())
