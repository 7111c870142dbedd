"""jax_ep.grouped_matmul without a GPU: forward and gradients ("ragged_dot") against a NumPy float64 oracle,
argument errors, the choice of implementation, and jax_ep's Pallas kernels as far as a CPU takes them (the
tile schedule, lowering to Mosaic GPU, and the forward kernel in JAX's GPU interpreter). The Pallas kernels
themselves are checked on the GPU by tests/gpu/test_grouped_matmul_gpu.py."""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from grouped_matmul_harness import forward_and_grads, oracle, oracle_group_ranges, relative_error, silu_mul
from jax.test_util import check_grads

from jax_ep import grouped_matmul
from jax_ep.grouped_matmul import (
    BLOCK_CONFIG_TABLE,
    BlockConfig,
    DEFAULT_BLOCK_CONFIG,
    config_unsupported_reason,
    pallas_unsupported_reason,
    resolve_implementation,
    rows_read_past_groups,
)

gm_module = importlib.import_module("jax_ep.grouped_matmul")  # the name jax_ep.grouped_matmul is the function
# These tests also run on GPU machines (tests/conftest.py); a few are about what happens without one.
cpu_only = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="checks the behaviour on a CPU")


def full_float32():
    """float32 products in float32 (a GPU would otherwise use TF32), for the float32 tolerances below."""
    return jax.default_matmul_precision("highest")


def random_operands(rng, m, k, n, groups, dtype):
    cast = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return cast((m, k)), cast((groups, k, n)), cast((m, n))


def check_against_oracle(x, w, dy, sizes, tolerance):
    with full_float32():
        y, dx, dw = forward_and_grads(x, w, dy, jnp.asarray(sizes, jnp.int32))
    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, w.dtype)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731 (the rounded inputs)
    expected = oracle(as64(x), as64(w), as64(dy), sizes)
    for name, actual, want in zip(("y", "dx", "dw"), (y, dx, dw), expected):
        assert relative_error(actual, want) <= tolerance, name
    # Rows past the last group: exactly zero output and zero dx.
    end = oracle_group_ranges(sizes, x.shape[0])[-1][1]
    assert not np.any(np.asarray(y[end:], np.float32)) and not np.any(np.asarray(dx[end:], np.float32))


SHAPES = [(37, 5, 3, 1), (64, 8, 16, 4), (50, 3, 7, 6)]  # (M, K, N, G): few, so jit compiles each once


@st.composite
def problems(draw):
    """A shape of SHAPES and group sizes: random with empty groups, all rows in one group, a sum below or
    above M, negative sizes."""
    m, k, n, groups = draw(st.sampled_from(SHAPES))
    kind = draw(st.sampled_from(["random", "one_group", "short", "long", "negative"]))
    if kind == "one_group":
        sizes = [0] * groups
        sizes[draw(st.integers(0, groups - 1))] = m
    else:
        high = {"random": m // groups + 3, "short": m // (2 * groups), "long": m, "negative": m // groups}[kind]
        low = -3 if kind == "negative" else 0
        sizes = draw(st.lists(st.integers(low, high), min_size=groups, max_size=groups))
        if kind == "random":  # zero or more empty groups, then give the remaining rows to a random group
            sizes[draw(st.integers(0, groups - 1))] += max(m - sum(sizes), 0)
    return (m, k, n, groups), sizes, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None)
@given(problems())
def test_matches_oracle_float32(problem):
    (m, k, n, groups), sizes, seed = problem
    x, w, dy = random_operands(np.random.default_rng(seed), m, k, n, groups, jnp.float32)
    check_against_oracle(x, w, dy, sizes, tolerance=1e-5)


@settings(max_examples=10, deadline=None)
@given(problems())
def test_matches_oracle_bfloat16(problem):
    (m, k, n, groups), sizes, seed = problem
    x, w, dy = random_operands(np.random.default_rng(seed), m, k, n, groups, jnp.bfloat16)
    check_against_oracle(x, w, dy, sizes, tolerance=1e-2)  # bf16 outputs: ~2^-9 relative rounding


@pytest.mark.parametrize("sizes", [[3, 0, 9, 4], [16, 0, 0, 0], [0, 0, 0, 0], [5, 20, 7, 2]])
def test_gradients_by_finite_differences(sizes):
    x, w, _ = random_operands(np.random.default_rng(1), 16, 4, 3, 4, jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    with full_float32():
        check_grads(lambda x, w: grouped_matmul(x, w, group_sizes), (x, w), order=1, modes=("rev",),
                    eps=1e-2, atol=1e-2, rtol=1e-2)


def test_single_group_is_a_matmul():
    x, w, _ = random_operands(np.random.default_rng(2), 24, 6, 5, 1, jnp.float32)
    with full_float32():
        y = grouped_matmul(x, w, jnp.array([24], jnp.int32))
    np.testing.assert_allclose(y, np.asarray(x, np.float64) @ np.asarray(w[0], np.float64), rtol=1e-5, atol=1e-5)


def test_group_sizes_are_traced_under_jit():
    x, w, dy = random_operands(np.random.default_rng(3), 64, 8, 16, 4, jnp.float32)
    with full_float32():  # as check_against_oracle calls it (the precision is part of the jit cache key)
        forward_and_grads(x, w, dy, jnp.array([16, 16, 16, 16], jnp.int32))
    compiles = forward_and_grads._cache_size()
    check_against_oracle(x, w, dy, [1, 0, 40, 2], tolerance=1e-5)
    assert forward_and_grads._cache_size() == compiles  # new sizes, same executable


@pytest.mark.parametrize("x_shape, w_shape, sizes_shape, sizes_dtype, x_dtype, w_dtype, error, match", [
    ((8,), (2, 8, 4), (2,), jnp.int32, jnp.float32, jnp.float32, ValueError, "x must be 2-D"),
    ((8, 3), (3, 4), (2,), jnp.int32, jnp.float32, jnp.float32, ValueError, "w must be 3-D"),
    ((8, 3), (2, 5, 4), (2,), jnp.int32, jnp.float32, jnp.float32, ValueError, "w's K"),
    ((8, 3), (2, 3, 4), (3,), jnp.int32, jnp.float32, jnp.float32, ValueError, "group_sizes must have shape"),
    ((8, 3), (2, 3, 4), (2, 1), jnp.int32, jnp.float32, jnp.float32, ValueError, "group_sizes must have shape"),
    ((8, 3), (2, 3, 4), (2,), jnp.uint32, jnp.float32, jnp.float32, TypeError, "group_sizes must be int32"),
    ((8, 3), (2, 3, 4), (2,), jnp.float32, jnp.float32, jnp.float32, TypeError, "group_sizes must be int32"),
    ((8, 3), (2, 3, 4), (2,), jnp.int32, jnp.float32, jnp.bfloat16, TypeError, "w must have x's dtype"),
    ((8, 3), (2, 3, 4), (2,), jnp.int32, jnp.int32, jnp.int32, TypeError, "x must have a floating dtype"),
    ((8, 3), (0, 3, 4), (0,), jnp.int32, jnp.float32, jnp.float32, ValueError, "at least one group"),
])
def test_argument_errors(x_shape, w_shape, sizes_shape, sizes_dtype, x_dtype, w_dtype, error, match):
    x = jax.ShapeDtypeStruct(x_shape, x_dtype)
    w = jax.ShapeDtypeStruct(w_shape, w_dtype)
    sizes = jax.ShapeDtypeStruct(sizes_shape, sizes_dtype)
    with pytest.raises(error, match=match):
        jax.eval_shape(grouped_matmul, x, w, sizes)


def test_unknown_implementation():
    x, w, _ = random_operands(np.random.default_rng(4), 8, 2, 2, 1, jnp.float32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        grouped_matmul(x, w, jnp.array([8], jnp.int32), implementation="cuda")


@pytest.mark.parametrize("num_sms", [0, -3, 2.0, "8", True])
def test_bad_sm_budget(num_sms):
    x, w, _ = random_operands(np.random.default_rng(4), 8, 2, 2, 1, jnp.float32)
    with pytest.raises(ValueError, match=r"num_sms must be a positive integer or None, got"):
        grouped_matmul(x, w, jnp.array([8], jnp.int32), num_sms=num_sms)


def test_sm_budget_leaves_ragged_dot_as_it_is():
    """ragged_dot has no SM budget: with one it matches the oracle and its own result without one, bit for bit,
    forward and gradients."""
    rng = np.random.default_rng(11)
    x, w, dy = random_operands(rng, 64, 16, 8, 3, jnp.float32)
    sizes = jnp.array([20, 0, 30], jnp.int32)

    budgeted = forward_and_grads(x, w, dy, sizes, num_sms=4)
    for name, ours, unbudgeted, expected in zip(("y", "dx", "dw"), budgeted, forward_and_grads(x, w, dy, sizes),
                                                oracle(x, w, dy, sizes)):
        np.testing.assert_allclose(np.asarray(ours, np.float64), expected, rtol=1e-5, atol=1e-5, err_msg=name)
        assert jnp.array_equal(ours, unbudgeted), name


@cpu_only
def test_auto_falls_back_to_ragged_dot_on_cpu():
    x, w, dy = random_operands(np.random.default_rng(5), 256, 128, 128, 4, jnp.bfloat16)
    assert "not a CUDA GPU" in pallas_unsupported_reason(x.shape, w.shape, x.dtype)
    assert resolve_implementation(x, w, "auto") == "ragged_dot"
    sizes = jnp.array([100, 0, 50, 60], jnp.int32)
    auto = forward_and_grads(x, w, dy, sizes, implementation="auto")
    explicit = forward_and_grads(x, w, dy, sizes, implementation="ragged_dot")
    for a, b in zip(auto, explicit):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@cpu_only
@pytest.mark.parametrize("implementation", ["pallas", "jax_pallas"])
def test_pallas_on_cpu_raises_with_the_reason(implementation):
    x, w, _ = random_operands(np.random.default_rng(6), 256, 128, 128, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match=f"implementation='{implementation}' cannot run here: .*not a CUDA GPU"):
        grouped_matmul(x, w, jnp.array([128, 128], jnp.int32), implementation=implementation)


@pytest.mark.parametrize("dtype, m, k, n, expected", [
    (jnp.bfloat16, 4096, 2048, 1408, "pallas"),
    (jnp.float16, 256, 128, 256, "pallas"),
    (jnp.float32, 4096, 2048, 1408, "ragged_dot"),   # dtype
    (jnp.bfloat16, 4096, 2048, 1400, "ragged_dot"),  # N not a multiple of 128
    (jnp.bfloat16, 4096, 2000, 1408, "ragged_dot"),  # K not a multiple of 128 (the dw tiles)
    (jnp.bfloat16, 100, 2048, 1408, "ragged_dot"),   # fewer rows than one tile
])
def test_auto_choice_on_a_hopper_gpu(monkeypatch, dtype, m, k, n, expected):
    """The choice "auto" makes where the device is a Hopper GPU (pretended; nothing runs)."""
    monkeypatch.setattr(gm_module, "_hopper_unsupported_reason", lambda: None)
    x, w = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((16, k, n), dtype)
    assert resolve_implementation(x, w, "auto") == expected


# --- jax_ep's Pallas kernels, as far as a CPU takes them ------------------------------------------------

try:
    from jax_ep import _grouped_matmul_kernels as kernels
except ImportError:
    kernels = None
needs_pallas = pytest.mark.skipif(kernels is None, reason="this JAX has no Pallas Mosaic GPU")


@functools.partial(jax.jit, static_argnums=1)
def _schedule(group_sizes, num_rows, zero_rows_end=None):
    return kernels.row_tile_schedule(group_sizes, num_rows, zero_rows_end)


def _rows_written(sizes, num_rows, zero_rows_end):
    """Where the schedule's rows end: every row, or past the groups only those before zero_rows_end (at least the
    groups' rows, at most num_rows)."""
    return num_rows if zero_rows_end is None else min(max(zero_rows_end, int(np.sum(sizes))), num_rows)


_ZERO_ROWS_ENDS = st.one_of(st.none(), st.integers(-5, 1100))


@needs_pallas
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=5, max_size=5), st.sampled_from([700, 1024]), _ZERO_ROWS_ENDS)
def test_row_tile_schedule_writes_every_row_once(sizes, num_rows, zero_rows_end):
    """Every row once, up to zero_rows_end past the groups (all rows without it), none after it."""
    sizes = np.asarray(gm_module.clamp_group_sizes(jnp.asarray(sizes, jnp.int32), num_rows))
    zero_end = None if zero_rows_end is None else jnp.asarray(zero_rows_end, jnp.int32)
    tile_group, first, end = (np.asarray(a) for a in _schedule(jnp.asarray(sizes), num_rows, zero_end))
    ranges = oracle_group_ranges(sizes, num_rows)
    rows_end = _rows_written(sizes, num_rows, zero_rows_end)
    written = np.zeros(num_rows, int)
    for group, lo, hi in zip(tile_group, first, end):
        if lo == hi:
            continue
        written[lo:hi] += 1
        tile_start = lo - lo % kernels.ROW_ALIGNMENT
        assert hi - tile_start <= kernels.BLOCK_ROWS  # within one tile's rows
        group_start, group_end = ranges[group] if group >= 0 else (ranges[-1][1], rows_end)
        assert group_start <= lo and hi <= group_end
    np.testing.assert_array_equal(written[:rows_end], 1)
    np.testing.assert_array_equal(written[rows_end:], 0)
    # Unused entries are at the end, and each group has as few tiles as its aligned rows need.
    used = first < end
    assert used[:used.sum()].all()
    for g, (start, stop) in enumerate(ranges):
        aligned = start - start % kernels.ROW_ALIGNMENT
        tiles = -(-(stop - aligned) // kernels.BLOCK_ROWS) if stop > start else 0
        assert np.sum(used & (tile_group == g)) == tiles


@functools.partial(jax.jit, static_argnums=(1, 2))
def _paired_schedule(group_sizes, num_rows, fuse_tails=False, zero_rows_end=None):
    return kernels.paired_row_tile_schedule(group_sizes, num_rows, fuse_tails, zero_rows_end)


@needs_pallas
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=9), st.sampled_from([700, 1024, 3000]), _ZERO_ROWS_ENDS)
def test_paired_row_tile_schedule_pairs_each_groups_tiles(sizes, num_rows, zero_rows_end):
    """The clustered kernel's schedule: the same tiles as row_tile_schedule (so every row written once, up to
    zero_rows_end where it is given), in pairs (entries 2p, 2p + 1) of which all but at most one tile per group
    pair with another tile of its group, in row order; unused entries write nothing and never come first in a
    pair."""
    sizes = np.asarray(gm_module.clamp_group_sizes(jnp.asarray(sizes, jnp.int32), num_rows))
    zero_end = None if zero_rows_end is None else jnp.asarray(zero_rows_end, jnp.int32)
    group, first, end = (np.asarray(a) for a in _paired_schedule(jnp.asarray(sizes), num_rows, False, zero_end))
    assert len(group) % 2 == 0
    used = first < end
    expected = sorted((g, lo, hi) for g, lo, hi in zip(*(np.asarray(a) for a in _schedule(
        jnp.asarray(sizes), num_rows, zero_end))) if lo < hi)
    assert sorted(zip(group[used].tolist(), first[used].tolist(), end[used].tolist())) == expected
    _check_pairs(sizes, group, first, used)


def _check_pairs(sizes, group, first, used):
    assert (group[~used] == -1).all()
    pair_group, pair_first, pair_used = group.reshape(-1, 2), first.reshape(-1, 2), used.reshape(-1, 2)
    assert not (pair_used[:, 1] & ~pair_used[:, 0]).any(), "an unused entry comes first in a pair"
    same = pair_used.all(axis=1) & (pair_group[:, 0] == pair_group[:, 1])
    assert (pair_first[same, 0] < pair_first[same, 1]).all()
    for g in range(len(sizes)):
        tiles = np.sum(used & (group == g))
        assert tiles - 2 * np.sum(same & (pair_group[:, 0] == g)) in (0, 1), f"group {g}: more than one lone tile"
    return same


@needs_pallas
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=9), st.sampled_from([1024, 3000]))
def test_paired_schedule_with_tails_fuses_each_short_last_tile(sizes, num_rows):
    """fuse_tails: every row written once, by a tile or by a pair's tail; a group whose tiles (row_tile_schedule's)
    are odd in number, at least 3, and whose last one holds at most 64 rows has that tile as the tail of its last
    pair (rows right after the pair's, starting at a multiple of 8) and no lone tile; other groups are as
    without it."""
    sizes = np.asarray(gm_module.clamp_group_sizes(jnp.asarray(sizes, jnp.int32), num_rows))
    group, first, end, tail_first, tail_end = (np.asarray(a) for a in _paired_schedule(jnp.asarray(sizes), num_rows,
                                                                                       True))
    used = first < end
    same = _check_pairs(sizes, group, first, used)
    written = np.zeros(num_rows, int)
    for lo, hi in zip(first[used], end[used]):
        written[lo:hi] += 1
    has_tail = tail_first < tail_end
    for p in np.flatnonzero(has_tail):
        written[tail_first[p]:tail_end[p]] += 1
    np.testing.assert_array_equal(written, 1)
    plain_group, plain_first, plain_end = (np.asarray(a) for a in _schedule(jnp.asarray(sizes), num_rows))
    ranges = oracle_group_ranges(sizes, num_rows)
    for g, (start, stop) in enumerate(ranges):
        mine = (plain_group == g) & (plain_first < plain_end)
        last_rows = (plain_end[mine] - plain_first[mine])[-1] if mine.any() else 0
        fused = mine.sum() >= 3 and mine.sum() % 2 == 1 and last_rows <= kernels.ROWS_PER_WARPGROUP
        tails = np.flatnonzero(has_tail & (group.reshape(-1, 2)[:, 0] == g))
        assert len(tails) == int(fused), f"group {g}"
        if fused:
            p = tails[0]
            assert same[p] and end[2 * p + 1] == tail_first[p] and tail_end[p] == stop
            assert tail_first[p] % kernels.ROW_ALIGNMENT == 0 and tail_end[p] - tail_first[p] <= 64
            assert np.sum(used & (group == g)) == mine.sum() - 1  # no lone tile


@needs_pallas
def test_expert_major_gradient_zeroes_the_rows_dw_reads_past_a_group():
    """dw's kernels read up to block_k - 1 rows of dy past a group's end (and need them finite); the cuda
    expert-major combine's gradient zeroes that many rows past its last group and leaves the rest unwritten."""
    from jax_ep import _native

    zeroed = _native.limit("expert_major_grad_zero_rows")
    if zeroed is None:
        pytest.skip("the native extension did not load")
    configs = [rule.config for rule in BLOCK_CONFIG_TABLE if rule.kernels == "pallas" and rule.op == "dw"]
    assert max(config.block_k for config in configs + [DEFAULT_BLOCK_CONFIG]) - 1 <= rows_read_past_groups() < zeroed


def test_the_public_group_row_alignment_is_the_kernels():
    assert gm_module.GROUP_ROW_ALIGNMENT == kernels.ROW_ALIGNMENT


@needs_pallas
@pytest.mark.parametrize("num_row_blocks, num_col_blocks, width", [(5, 4, 2), (3, 7, 3), (4, 1, 1), (6, 5, 8)])
def test_striped_order_visits_every_block_once(num_row_blocks, num_col_blocks, width):
    index = jnp.arange(num_row_blocks * num_col_blocks)
    rows, cols = kernels._striped_order(index, num_row_blocks, num_col_blocks, width)
    pairs = sorted(zip(np.asarray(rows).tolist(), np.asarray(cols).tolist()))
    assert pairs == [(r, c) for r in range(num_row_blocks) for c in range(num_col_blocks)]


KERNEL_CONFIG = dict(block_n=128, block_k=64, num_stages=4, grid_tile_width=4, num_sms=132)


@needs_pallas
@pytest.mark.parametrize("op", ["fwd", "dx", "dw", "dw with 256-row tiles", "fwd clustered", "dx clustered",
                                "fwd clustered with tails", "dx clustered with tails", "fwd with activation",
                                "fwd clustered with activation", "dx with the activation's gradient"])
def test_kernels_lower_to_mosaic_gpu(op):
    """Lowering runs Mosaic GPU's layout inference and shared-memory sizing: what a compile on the device
    would reject first. (The final PTX compile needs the device.)"""
    m, k, n, groups = 1024, 256, 384, 5
    bf16 = jnp.bfloat16
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    if op.startswith("dw"):
        args = (jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct((m, n), bf16), sizes)
        config = dict(KERNEL_CONFIG, num_stages=3, block_rows=256) if "256" in op else KERNEL_CONFIG
        fn = functools.partial(kernels.ragged_contraction_matmul, **config)
    else:
        from jax_ep.grouped_activation import _epilogue_backward_math, _epilogue_forward_math
        transpose_rhs, clustered, tails = op.startswith("dx"), "clustered" in op, op.endswith("tails")
        # The epilogue's activation as the block runs it (approximate transcendentals, no division).
        activation = _epilogue_forward_math if op.endswith("activation") else None
        # 256-column tiles: a quarter of 64 per warpgroup of the pair's tails; 128 of the gate's columns and the
        # up's with the activation.
        wide = tails or activation is not None
        n = 512 if wide else n
        rows_k = n if transpose_rhs else k
        config = dict(KERNEL_CONFIG, block_n=256, num_stages=3) if wide else KERNEL_CONFIG
        args = (jax.ShapeDtypeStruct((m, rows_k), bf16), jax.ShapeDtypeStruct((groups, k, n), bf16), sizes)

        grad = {}
        if op.endswith("gradient"):  # moe-a's down projection's dx: 128 columns, 5 stages, beside gate_up [M, 2K]
            config = dict(KERNEL_CONFIG, block_n=128, num_stages=5)
            args = (jax.ShapeDtypeStruct((m, n), bf16), jax.ShapeDtypeStruct((groups, k, n), bf16), sizes)
            grad = dict(gate_up=jnp.zeros((m, 2 * k), bf16), gate_up_activation_grad=_epilogue_backward_math)

        def fn(lhs, rhs, group_sizes):
            schedule = (kernels.paired_row_tile_schedule(group_sizes, lhs.shape[0], fuse_tails=tails) if clustered
                        else kernels.row_tile_schedule(group_sizes, lhs.shape[0]))
            return kernels.ragged_rows_matmul(lhs, rhs, *schedule, transpose_rhs=transpose_rhs, clustered=clustered,
                                              gate_up_activation=activation, **grad, **config)
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@needs_pallas
@pytest.mark.parametrize("m,k,f,groups", [(1052, 256, 256, 4), (24580, 2048, 1408, 32)],
                         ids=["plain", "moe-a, activation fused"])
def test_rows_not_a_multiple_of_8_lower(monkeypatch, m, k, f, groups):
    """Mosaic GPU refuses TMA copies of an array whose row count is not a multiple of its 8-row tiles (the Flax
    block at two ranks of 256 tokens, K=2 and 4 local experts has 1052 rows): grouped_matmul and the expert SwiGLU
    (at moe-a's widths, where the forward fuses the activation and the down projection's dx its gradient) lower
    forward and backward on the Pallas kernels for such M. Their results: test_rows_not_a_multiple_of_8_in_the_gpu_
    interpreter here and the GPU tests."""
    from jax_ep.grouped_activation import expert_swiglu
    monkeypatch.setattr(gm_module, "_hopper_unsupported_reason", lambda: None)
    monkeypatch.setattr(gm_module, "_num_sms", lambda budget=None: 132)
    assert m % 8
    bf16, sizes = jnp.bfloat16, jax.ShapeDtypeStruct((groups,), jnp.int32)
    rows, w_gate_up = jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct((groups, k, 2 * f), bf16)
    w_down = jax.ShapeDtypeStruct((groups, f, k), bf16)

    def loss(rows, w_gate_up, w_down, sizes):
        gate_up = grouped_matmul(rows, w_gate_up, sizes, implementation="pallas")
        swiglu = expert_swiglu(rows, w_gate_up, w_down, sizes, implementation="pallas")
        return jnp.sum(gate_up.astype(jnp.float32)) + jnp.sum(swiglu.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert "mosaic_gpu" in step.trace(rows, w_gate_up, w_down, sizes).lower(lowering_platforms=("cuda",)).as_text()


@needs_pallas
@pytest.mark.parametrize("op", ["fwd", "dx"])
def test_rows_not_a_multiple_of_8_lower_on_jax_kernels(monkeypatch, op):
    """The same for JAX's own Pallas kernels (`implementation="jax_pallas"`, kept for comparison), whose TMA copies
    take the same 8-row tiles: fwd and dx lower at M = 1052 and give M rows."""
    monkeypatch.setattr(gm_module, "_num_sms", lambda budget=None: 132)
    m, k, n, groups = 1052, 256, 512, 4
    bf16 = jnp.bfloat16
    lhs = jax.ShapeDtypeStruct((m, n if op == "dx" else k), bf16)
    args = (lhs, jax.ShapeDtypeStruct((groups, k, n), bf16), jax.ShapeDtypeStruct((groups,), jnp.int32))

    def fn(lhs, rhs, sizes):
        return gm_module.grouped_op(op, "jax_pallas", lhs, rhs, sizes, (m, k, n, groups))

    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert jax.eval_shape(fn, *args).shape == (m, k if op == "dx" else n)


@cpu_only
@needs_pallas
def test_rows_not_a_multiple_of_8_in_the_gpu_interpreter(monkeypatch):
    """pallas_grouped_op's forward with M = 260 (the kernels take it padded to 264 rows of zeros): the [260, N]
    result against the float64 oracle, with the last group ending at row 260 and zero rows past the groups when
    they end earlier."""
    interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params",
                                    reason="JAX's Pallas GPU interpreter moved")
    monkeypatch.setattr(gm_module, "_num_sms", lambda budget=None: 2)
    rng = np.random.default_rng(17)
    m, k, n = 260, 64, 128
    config = BlockConfig(block_m=128, block_n=128, block_k=64, num_stages=2, grid_tile_width=1)
    for sizes in ([60, 0, 200], [60, 0, 100]):
        x, w, _ = random_operands(rng, m, k, n, len(sizes), jnp.bfloat16)
        group_sizes = jnp.asarray(sizes, jnp.int32)
        params = interpret.InterpretGPUParams(out_of_bounds_reads="uninitialized")
        with interpret.force_gpu_interpret_mode(params):
            y = gm_module.pallas_grouped_op("fwd", "pallas", x, w, group_sizes, config)
        assert y.shape == (m, n)
        expected = oracle(np.asarray(x, np.float64), np.asarray(w, np.float64), np.zeros((m, n)), sizes)[0]
        assert relative_error(y, expected) <= 1e-2
        np.testing.assert_array_equal(np.asarray(y[sum(sizes):], np.float32), 0)


@cpu_only
@needs_pallas
def test_forward_kernel_with_the_activation_in_the_gpu_interpreter():
    """The rows kernel with gate_up_activation (the block's epilogue math), run by JAX's Pallas GPU interpreter:
    gate_up against the float64 oracle, and h = silu(gate) * up of the bf16-rounded gate_up (the oracle's
    activation), zero past the groups; column block j holds the gate's columns j * 128... and the up's same ones."""
    from jax_ep.grouped_activation import _epilogue_forward_math
    interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params",
                                    reason="JAX's Pallas GPU interpreter moved")
    rng = np.random.default_rng(11)
    m, k, f, sizes = 256, 64, 256, [0, 37, 100, 80]
    x, w, _ = random_operands(rng, m, k, 2 * f, len(sizes), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    params = interpret.InterpretGPUParams(out_of_bounds_reads="uninitialized")
    with interpret.force_gpu_interpret_mode(params):
        gate_up, h = kernels.ragged_rows_matmul(x, w, *kernels.row_tile_schedule(group_sizes, m),
                                                transpose_rhs=False, block_n=256, block_k=64, num_stages=2,
                                                grid_tile_width=1, num_sms=2,
                                                gate_up_activation=_epilogue_forward_math)
    expected = oracle(np.asarray(x, np.float64), np.asarray(w, np.float64), np.zeros((m, 2 * f)), sizes)[0]
    assert relative_error(gate_up, expected) <= 1e-2
    end = sum(sizes)
    want_h = O.silu_mul(np.asarray(gate_up, np.float32)[:end])
    np.testing.assert_allclose(np.asarray(h[:end], np.float64), want_h, rtol=2.0**-7, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(gate_up[end:], np.float32), 0)
    np.testing.assert_array_equal(np.asarray(h[end:], np.float32), 0)


@cpu_only
@needs_pallas
@pytest.mark.parametrize("zeroed_past_groups", [None, 20])
def test_rows_kernel_with_the_activation_gradient_in_the_gpu_interpreter(zeroed_past_groups):
    """The rows kernel with gate_up_activation_grad, run by JAX's Pallas GPU interpreter (with transpose_rhs=False:
    the interpreter cannot run dx's transposed operands, the device test does), two column blocks: d_gate_up
    against the float64 oracle's SwiGLU gradient of dh = x @ w[g] rounded to bfloat16; zero past the groups (on
    zeroed_past_groups rows there with the schedule's zero_rows_end, the rows after them unwritten (the
    interpreter's uninitialised nan), on all without). gate_up's rows past the groups are inf and nan, which zero
    tiles must not read."""
    interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params",
                                    reason="JAX's Pallas GPU interpreter moved")
    from jax_ep.grouped_activation import _epilogue_backward_math
    rng = np.random.default_rng(13)
    m, k, n, sizes = 256, 64, 256, [0, 37, 100, 80]
    x, w, _ = random_operands(rng, m, k, n, len(sizes), jnp.bfloat16)
    end = sum(sizes)
    gate_up = rng.standard_normal((m, 2 * n)).astype(np.float32)
    gate_up[end:, ::2], gate_up[end:, 1::2] = np.inf, np.nan
    gate_up = jnp.asarray(gate_up, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    zero_rows_end = None if zeroed_past_groups is None else jnp.asarray(end + zeroed_past_groups, jnp.int32)
    params = interpret.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
    with interpret.force_gpu_interpret_mode(params):
        d_gate_up = kernels.ragged_rows_matmul(x, w, *kernels.row_tile_schedule(group_sizes, m, zero_rows_end),
                                               transpose_rhs=False, block_n=128, block_k=64, num_stages=2,
                                               grid_tile_width=1, num_sms=2, gate_up=gate_up,
                                               gate_up_activation_grad=_epilogue_backward_math)
    dh = oracle(np.asarray(x, np.float64), np.asarray(w, np.float64), np.zeros((m, n)), sizes)[0]
    dh = np.asarray(jnp.asarray(dh, jnp.bfloat16), np.float64)  # the kernel rounds dh as a separate pass would read it
    expected = O.silu_mul_vjp(np.asarray(gate_up, np.float64)[:end], dh[:end])
    assert relative_error(d_gate_up[:end], expected) <= 1e-2
    zeroed = m if zeroed_past_groups is None else end + zeroed_past_groups
    np.testing.assert_array_equal(np.asarray(d_gate_up[end:zeroed], np.float32), 0)
    assert np.isnan(np.asarray(d_gate_up[zeroed:], np.float32)).all()


@needs_pallas
@pytest.mark.parametrize("bad", ["gate_up alone", "the gradient alone", "with the forward activation",
                                 "gate_up's shape", "256 columns", "pair tails"])
def test_rows_kernel_refuses_a_bad_activation_gradient(bad):
    from jax_ep.grouped_activation import _backward_math
    m, k, n, groups = 1024, 256, 128, 5
    lhs, rhs = jnp.zeros((m, n), jnp.bfloat16), jnp.zeros((groups, k, n), jnp.bfloat16)
    sizes = jnp.full((groups,), 100, jnp.int32)
    grad = dict(gate_up=jnp.zeros((m, 2 * k), jnp.bfloat16), gate_up_activation_grad=_backward_math)
    config = dict(KERNEL_CONFIG, num_stages=5)
    schedule = kernels.row_tile_schedule(sizes, m)
    if bad == "gate_up alone":
        del grad["gate_up_activation_grad"]
    elif bad == "the gradient alone":
        del grad["gate_up"]
    elif bad == "with the forward activation":
        grad["gate_up_activation"] = silu_mul
    elif bad == "gate_up's shape":
        grad["gate_up"] = jnp.zeros((m, k), jnp.bfloat16)
    elif bad == "256 columns":
        config["block_n"], rhs, grad["gate_up"] = 256, jnp.zeros((groups, 512, n), jnp.bfloat16), jnp.zeros(
            (m, 1024), jnp.bfloat16)
    else:
        schedule = kernels.paired_row_tile_schedule(sizes, m, fuse_tails=True)
        config["block_n"] = 256
    with pytest.raises(ValueError, match="gate_up"):
        kernels.ragged_rows_matmul(lhs, rhs, *schedule, transpose_rhs=True, clustered=bad == "pair tails", **grad,
                                   **config)


@needs_pallas
def test_the_activation_gradient_fits_five_stages_of_128_columns():
    """Shared memory: 5 stages of a 128-row lhs block and a 128-column rhs block (160 KB) beside the two
    warpgroups' gate and up blocks (64 KB) fit; 6 stages do not."""
    reason = kernels.activation_grad_unsupported_reason
    assert reason(128, 64, 5, jnp.bfloat16, False) is None
    assert "shared memory" in reason(128, 64, 6, jnp.bfloat16, False)
    assert reason(256, 64, 3, jnp.bfloat16, False) is not None
    assert reason(128, 64, 3, jnp.bfloat16, True) is not None


@cpu_only
@needs_pallas
@pytest.mark.parametrize("block_n,zeroed_past_groups", [(64, None), (192, None), (256, None), (192, 11)])
def test_forward_kernel_in_the_gpu_interpreter(block_n, zeroed_past_groups):
    """The rows kernel run by JAX's Pallas GPU interpreter: warp specialization, the tile schedule with
    unaligned group starts and an empty group, partial stores (stored in column pieces; block_n 64, 192 and
    256 give one, three and two pieces), zero rows past the last group: all of them, or zeroed_past_groups of
    them with the schedule's zero_rows_end and the rest unwritten (the interpreter's uninitialised nan). (The
    interpreter cannot run transposed wgmma operands, which dx and dw use.)"""
    interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params",
                                    reason="JAX's Pallas GPU interpreter moved")
    rng = np.random.default_rng(7)
    m, k, n, sizes = 256, 64, 768, [0, 37, 100, 80]
    x, w, _ = random_operands(rng, m, k, n, len(sizes), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    end = sum(sizes)
    zeroed = m if zeroed_past_groups is None else end + zeroed_past_groups
    zero_rows_end = None if zeroed_past_groups is None else jnp.asarray(zeroed, jnp.int32)
    # Reads past the array (a tile's rows from an aligned group start) are TMA zero fills on the device.
    params = interpret.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
    with interpret.force_gpu_interpret_mode(params):
        y = kernels.ragged_rows_matmul(x, w, *kernels.row_tile_schedule(group_sizes, m, zero_rows_end),
                                       transpose_rhs=False, block_n=block_n, block_k=64, num_stages=2,
                                       grid_tile_width=1, num_sms=2)
    expected = oracle(np.asarray(x, np.float64), np.asarray(w, np.float64), np.zeros((m, n)), sizes)[0]
    assert relative_error(y[:end], expected[:end]) <= 1e-2
    np.testing.assert_array_equal(np.asarray(y[end:zeroed], np.float32), 0)
    assert np.isnan(np.asarray(y[zeroed:], np.float32)).all()  # unwritten


@pytest.mark.parametrize("varying", [("ep",), ()])
def test_cotangents_are_typed_like_their_primals_inside_shard_map(varying):
    """A value varying over no axis (as a pallas_call's result) becomes varying like its primal; a value
    varying over an axis its primal does not is summed over it."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ep._cotangents import typed_like, varying_axes
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])

    def body(sharded, replicated):
        like = sharded if varying else replicated
        plain = jnp.ones((2,), jnp.float32)
        typed_plain = typed_like(plain, like)
        typed_varying = typed_like(sharded * 1.0, like)
        assert varying_axes(typed_plain) == varying_axes(like) == frozenset(varying)
        assert varying_axes(typed_varying) == frozenset(varying)
        return typed_plain, typed_varying

    out_spec = P("ep") if varying else P()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P()), out_specs=(out_spec, out_spec)))
    sharded = jax.device_put(jnp.arange(4, dtype=jnp.float32), NamedSharding(mesh, P("ep")))
    replicated = jax.device_put(jnp.zeros((2,), jnp.float32), NamedSharding(mesh, P()))
    plain, summed = (np.asarray(a) for a in f(sharded, replicated))
    np.testing.assert_array_equal(plain, np.ones(4 if varying else 2))
    np.testing.assert_array_equal(summed, np.arange(4.0) if varying else np.array([0.0 + 2, 1 + 3]))


def test_block_config_table_rules_fit_their_shapes():
    """The tuned rules apply where measured, and a rule whose tiles do not fit a shape is passed over (a
    config that does not fit must not turn "auto" into the slow fallback)."""
    from jax_ep.grouped_matmul import block_config
    down_dw = block_config("pallas", "dw", 24576, 1408, 2048, 64)
    assert down_dw.block_n == 256 and config_unsupported_reason("pallas", "dw", down_dw, 24576, 1408, 2048) is None
    gate_dw = block_config("pallas", "dw", 24576, 2048, 1408, 64)
    assert (gate_dw.block_m, gate_dw.block_n) == (256, 128)
    assert config_unsupported_reason("pallas", "dw", gate_dw, 24576, 2048, 1408) is None
    # N=1664 = 13 x 128 is in the first rule's range but not a multiple of its 256-column tiles, and K=1408 is
    # not a multiple of the second rule's 256 rows: the third rule's 128 x 128 tiles.
    assert (block_config("pallas", "dw", 24576, 1408, 1664, 64).block_m,
            block_config("pallas", "dw", 24576, 1408, 1664, 64).block_n) == (128, 128)
    # 256-row tiles are dw's alone: the rows kernels take 128.
    assert config_unsupported_reason("pallas", "fwd", gate_dw, 24576, 2048, 1408) is not None
    # 8 to 31 groups (moe-a at EP4 and EP8) have rules of their own; fewer were not measured.
    few_groups_dw = BlockConfig(block_n=256, num_stages=4, grid_tile_width=2)
    for groups in (8, 16, 31):
        assert block_config("pallas", "dw", 24576, 1408, 2048, groups) == few_groups_dw
        assert block_config("pallas", "fwd", 24576, 2048, 2816, groups) == BlockConfig(
            block_n=256, num_stages=3, grid_tile_width=16, clustered=True)
        # dx of the down projection writes 1408 columns: no 256-column tiles, the next rule's 128.
        assert block_config("pallas", "dx", 24576, 1408, 2048, groups) == BlockConfig(num_stages=5,
                                                                                      grid_tile_width=16)
    assert block_config("pallas", "dw", 24576, 1408, 2048, 32) == BlockConfig(block_n=256, num_stages=3,
                                                                               grid_tile_width=8)
    assert block_config("pallas", "dw", 24576, 1408, 2048, 7) == DEFAULT_BLOCK_CONFIG
    assert block_config("jax_pallas", "dw", 24576, 1408, 2048, 64) == DEFAULT_BLOCK_CONFIG
    assert all(rule.kernels == "pallas" for rule in BLOCK_CONFIG_TABLE)
    clustered = BlockConfig(clustered=True)
    assert config_unsupported_reason("pallas", "fwd", clustered, 24576, 2048, 1408) is None
    for kernels_name, op in (("pallas", "dw"), ("jax_pallas", "fwd")):
        assert "only jax_ep's fwd and dx kernels run clustered" in config_unsupported_reason(
            kernels_name, op, clustered, 24576, 2048, 1408)
