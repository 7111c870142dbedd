"""jax_ep.grouped_matmul's Pallas paths on the GPU: jax_ep's kernels ("pallas") and JAX's ("jax_pallas")
against the NumPy float64 oracle and lax.ragged_dot's gradients, with random group sizes (empty groups,
rows past the last group), 16 and 64 groups, small shapes and one realistic MoE shape; and that "auto"
picks "pallas" on a Hopper GPU."""
import functools

import jax
import pytest

if jax.devices()[0].platform != "gpu":
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from grouped_matmul_harness import forward_and_grads, oracle, relative_error  # noqa: E402
from jax import lax  # noqa: E402

from jax_ep.grouped_matmul import (  # noqa: E402
    BLOCK_CONFIG_TABLE,
    DEFAULT_BLOCK_CONFIG,
    OPS,
    BlockConfig,
    config_unsupported_reason,
    pallas_grouped_op,
    pallas_unsupported_reason,
    resolve_implementation,
)

CAPABILITY = str(getattr(jax.devices()[0], "compute_capability", "unknown"))
needs_hopper = pytest.mark.skipif(not CAPABILITY.startswith("9."),
                                  reason=f"the Pallas kernels need compute capability 9.x, this GPU has {CAPABILITY}")

BF16_TOLERANCE = 1e-2  # relative L2 error of bf16 outputs (rounding alone is ~2^-9)


def random_group_sizes(rng, num_rows, groups):
    """Dirichlet-random sizes with about a tenth of the groups empty and 0-5% of the rows past the last
    group."""
    used_rows = num_rows - int(rng.integers(0, num_rows // 20 + 1))
    weights = rng.dirichlet(np.ones(groups))
    weights[rng.random(groups) < 0.1] = 0
    weights[rng.integers(groups)] += 1e-3  # at least one non-empty group
    return rng.multinomial(used_rows, weights / weights.sum()).astype(np.int32)


@jax.jit
def lax_forward_and_grads(x, w, dy, group_sizes):
    y, vjp = jax.vjp(lambda x, w: lax.ragged_dot(x, w, group_sizes), x, w)
    return (y, *vjp(dy))


SHAPES = [  # (M, K, N, G)
    (1024, 256, 384, 16),
    (1024, 256, 384, 64),
    (4096, 2048, 1408, 64),  # an expert projection of a realistic MoE block
]


@needs_hopper
@pytest.mark.parametrize("implementation", ["pallas", "jax_pallas"])
@pytest.mark.parametrize("m, k, n, groups", SHAPES)
def test_pallas_matches_oracle_and_lax(implementation, m, k, n, groups, capsys):
    rng = np.random.default_rng(m + k + n + groups)
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                for shape in ((m, k), (groups, k, n), (m, n)))
    sizes = random_group_sizes(rng, m, groups)
    group_sizes = jnp.asarray(sizes)
    y, dx, dw = forward_and_grads(x, w, dy, group_sizes, implementation)

    for name, actual, expected in zip(("y", "dx", "dw"), (y, dx, dw), oracle(x, w, dy, sizes)):
        assert relative_error(actual, expected) <= BF16_TOLERANCE, name
    total = int(sizes.sum())
    assert not np.any(np.asarray(y[total:], np.float32)), "rows past the last group must be zero"
    assert not np.any(np.asarray(dx[total:], np.float32)), "dx rows past the last group must be zero"
    assert not np.any(np.asarray(dw[sizes == 0], np.float32)), "dw of an empty group must be zero"

    identical = []
    for name, ours, theirs in zip(("y", "dx", "dw"), (y, dx, dw), lax_forward_and_grads(x, w, dy, group_sizes)):
        assert relative_error(ours, np.asarray(jnp.asarray(theirs, jnp.float32), np.float64)) <= BF16_TOLERANCE
        identical.append(f"{name}={bool(jnp.array_equal(ours, theirs))}")
    with capsys.disabled():
        print(f"\n{implementation} M={m} K={k} N={n} G={groups}: bit-identical to lax.ragged_dot: "
              f"{' '.join(identical)}")


@needs_hopper
@pytest.mark.parametrize("implementation", ["pallas", "jax_pallas"])
@pytest.mark.parametrize("sizes", [[300, 0, 500, 252], [300, 0, 500, 100]], ids=["to the last row", "short"])
def test_rows_not_a_multiple_of_8_match_oracle(sizes, implementation):
    """M = 1052 (2 x 256 x 2 + 4 x 7: the expert-major capacity of two ranks of 256 tokens, K=2, 4 local experts):
    Mosaic GPU's TMA copies take 8-row tiles, so the kernels run on rows padded to 1056; y, dx and dw against the
    float64 oracle, the groups ending at row M or before it (zero rows after them)."""
    m, k, n = 1052, 256, 384
    rng = np.random.default_rng(8)
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((m, k), (4, k, n), (m, n)))
    sizes = np.asarray(sizes, np.int32)
    y, dx, dw = forward_and_grads(x, w, dy, jnp.asarray(sizes), implementation)
    assert y.shape == (m, n) and dx.shape == (m, k)
    for name, actual, expected in zip(("y", "dx", "dw"), (y, dx, dw), oracle(x, w, dy, sizes)):
        assert relative_error(actual, expected) <= BF16_TOLERANCE, name
    total = int(sizes.sum())
    assert not np.any(np.asarray(y[total:], np.float32)) and not np.any(np.asarray(dx[total:], np.float32))
    assert not np.any(np.asarray(dw[sizes == 0], np.float32))


@needs_hopper
@pytest.mark.parametrize("num_sms", [1, 7, 10_000])
def test_sm_budget_matches_oracle(num_sms):
    """jax_ep's kernels on a budget of SMs (one, an odd few, more than the device has) compute the same
    products: each CTA of the persistent grid takes more work items."""
    m, k, n, groups = SHAPES[1]
    rng = np.random.default_rng(num_sms)
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                for shape in ((m, k), (groups, k, n), (m, n)))
    sizes = random_group_sizes(rng, m, groups)
    y, dx, dw = forward_and_grads(x, w, dy, jnp.asarray(sizes), implementation="pallas", num_sms=num_sms)
    for name, actual, expected in zip(("y", "dx", "dw"), (y, dx, dw), oracle(x, w, dy, sizes)):
        assert relative_error(actual, expected) <= BF16_TOLERANCE, name
    total = int(sizes.sum())
    assert not np.any(np.asarray(y[total:], np.float32)), "rows past the last group must be zero"


TILE_TEST_SHAPE = (2048, 768, 768, 16)  # (M, K, N, G): every tile shape below fits it (768 = 3 x 256 = 4 x 192)
# Each tile configuration the table gives an op of jax_ep's kernels, and the default, with that op; 192-column
# tiles, whose stores go in three 64-column pieces; and fwd and dx in 2-CTA clusters (a group's tiles in pairs).
TABLE_CONFIGS = list(dict.fromkeys([(rule.op, rule.config) for rule in BLOCK_CONFIG_TABLE if rule.kernels == "pallas"]
                                   + [(op, DEFAULT_BLOCK_CONFIG) for op in OPS]
                                   + [(op, BlockConfig(block_n=192, num_stages=3)) for op in OPS]
                                   + [(op, config) for op in ("fwd", "dx") for config in
                                      (BlockConfig(clustered=True),
                                       BlockConfig(block_n=256, num_stages=3, grid_tile_width=16, clustered=True))]))


@needs_hopper
@pytest.mark.parametrize("op, config", TABLE_CONFIGS, ids=str)
def test_table_tile_shapes_match_oracle(op, config):
    """fwd, dx and dw on jax_ep's kernels with each tile configuration they take from the block-configuration
    table (128 or 256 columns, 128 or 256 rows of dw[g], 3 to 6 stages) and with 192 columns, with unaligned
    group starts, empty groups and rows past the last group."""
    m, k, n, groups = TILE_TEST_SHAPE
    assert config_unsupported_reason("pallas", op, config, m, k, n) is None, "TILE_TEST_SHAPE must fit every tile"
    rng = np.random.default_rng(3)
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((m, k), (groups, k, n), (m, n)))
    sizes = random_group_sizes(rng, m, groups)
    lhs, rhs = {"fwd": (x, w), "dx": (dy, w), "dw": (x, dy)}[op]
    out = jax.jit(functools.partial(pallas_grouped_op, op, "pallas", config=config))(lhs, rhs, jnp.asarray(sizes))
    expected = oracle(x, w, dy, sizes)[OPS.index(op)]
    assert relative_error(out, expected) <= BF16_TOLERANCE
    if op == "dw":
        assert not np.any(np.asarray(out[sizes == 0], np.float32)), "dw of an empty group must be zero"
    else:
        assert not np.any(np.asarray(out[int(sizes.sum()):], np.float32)), "rows past the last group must be zero"


# Groups whose odd last tile holds at most 64 rows: 3 tiles with tails of 44, 12 (its group starting off a multiple of
# 8 rows), 64 and 16 rows (the last group's, starting off a multiple of 8), and 5 tiles with a tail of 24 on the
# group's second pair; beside groups with no tail (a lone tile of 7 rows, a 5-tile group whose last tile holds 90
# rows, the two paired across groups; a 2-tile group), an empty one and rows past the last group.
FUSED_TAIL_SIZES = [300, 264, 7, 0, 533, 320, 130, 600, 270]


@needs_hopper
@pytest.mark.parametrize("op", ["fwd", "dx"])
@pytest.mark.parametrize("not_finite", [False, True])
def test_fused_pair_tails_match_oracle_and_unfused(op, not_finite):
    """Clustered fwd and dx with fused_tails: each short last tile of a group computed by the group's last pair, in
    quarters of the columns, against the float64 oracle; bitwise the unfused kernel's (each output element takes the
    same steps over K in both); zero rows past the last group. not_finite: inf in a tail's row, nan in the row after
    it (the next group's first, which the tail reads and does not store) and -inf in the last group's last row: each
    stays in its own row, as in the unfused kernel."""
    m, k, n = 3072, 512, 768
    sizes = np.asarray(FUSED_TAIL_SIZES, np.int32)
    rng = np.random.default_rng(5)
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                for shape in ((m, k), (len(sizes), k, n), (m, n)))
    lhs, rhs = {"fwd": (x, w), "dx": (dy, w)}[op]
    if not_finite:
        ends = np.cumsum(sizes)
        special = {int(ends[0]) - 1: np.inf, int(ends[0]): np.nan, int(ends[-1]) - 1: -np.inf}
        for row, value in special.items():
            lhs = lhs.at[row].set(value)
    unfused = BlockConfig(block_n=256, num_stages=3, grid_tile_width=16, clustered=True)
    fused = BlockConfig(block_n=256, num_stages=3, grid_tile_width=16, clustered=True, fused_tails=True)
    out_fused, out_unfused = (jax.jit(functools.partial(pallas_grouped_op, op, "pallas", config=config))(
        lhs, rhs, jnp.asarray(sizes)) for config in (fused, unfused))
    if not_finite:
        finite_rows = np.all(np.isfinite(np.asarray(out_fused, np.float32)), axis=1)
        assert set(np.flatnonzero(~finite_rows).tolist()) == set(special), "only the rows given inf or nan"
    else:
        assert relative_error(out_fused, oracle(x, w, dy, sizes)[OPS.index(op)]) <= BF16_TOLERANCE
    np.testing.assert_array_equal(np.asarray(out_fused, np.float32), np.asarray(out_unfused, np.float32))
    assert not np.any(np.asarray(out_fused[int(sizes.sum()):], np.float32)), "rows past the last group must be zero"


@needs_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("implementation", ["pallas", "jax_pallas"])
def test_groups_past_row_m_are_cut(implementation, dtype):
    rng = np.random.default_rng(0)
    m, k, n = 512, 256, 256
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((m, k), (4, k, n), (m, n)))
    y, dx, dw = forward_and_grads(x, w, dy, jnp.array([300, -5, 400, 7], jnp.int32), implementation)
    for name, actual, expected in zip(("y", "dx", "dw"), (y, dx, dw), oracle(x, w, dy, np.array([300, 0, 212, 0]))):
        assert relative_error(actual, expected) <= BF16_TOLERANCE, name


@needs_hopper
def test_auto_picks_pallas_on_hopper():
    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16)
    assert pallas_unsupported_reason(x.shape, w.shape, x.dtype) is None
    assert resolve_implementation(x, w, "auto") == "pallas"


@needs_hopper
@pytest.mark.parametrize("implementation", ["pallas", "jax_pallas"])
def test_gradients_inside_shard_map(implementation):
    """Inside a shard_map the kernels' results vary over no axis; the VJP must still type each cotangent like
    its primal (x and w sharded over "ep"), as a MoE block's experts need."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((1,), ("ep",))
    rng = np.random.default_rng(1)
    m, k, n, groups = 1024, 256, 384, 16
    x, w, dy = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((m, k), (groups, k, n), (m, n)))
    sizes = random_group_sizes(rng, m, groups)

    def body(x, w, dy, group_sizes):
        return forward_and_grads.__wrapped__(x, w, dy, group_sizes, implementation)

    sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()),
                                    out_specs=(P("ep"), P("ep"), P("ep"))))
    operands = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in
                ((x, P("ep")), (w, P("ep")), (dy, P("ep")), (jnp.asarray(sizes), P()))]
    for name, actual, expected in zip(("y", "dx", "dw"), sharded(*operands), oracle(x, w, dy, sizes)):
        assert relative_error(actual, expected) <= BF16_TOLERANCE, name


@pytest.mark.parametrize("num_rows, cols, end", [(48, 192, 37), (88, 320, 17), (49376, 1408, 24581),
                                                 (66432, 2048, 32224), (4096, 2048, 0)])
def test_silu_mul_in_groups_kernels_match_oracle(num_rows, cols, end):
    """grouped_swiglu's elementwise step on the kernels' path (jax_ep.grouped_activation's Pallas Triton kernels,
    compiled) against the float64 oracle on the groups' rows, rounded once to bfloat16; its gradient zero on the
    rows_read_past_groups() rows after them (the rest is unspecified)."""
    import oracle as O
    from jax_ep.grouped_activation import silu_mul_in_groups
    from jax_ep.grouped_matmul import rows_read_past_groups

    rng = np.random.default_rng(3)
    gate_up = jnp.asarray(rng.standard_normal((num_rows, 2 * cols)) * 3, jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((num_rows, cols)), jnp.bfloat16)
    sizes = jnp.array([end // 3, end - end // 3], jnp.int32)

    @jax.jit
    def forward_and_grad(a, g):
        h, vjp = jax.vjp(lambda a: silu_mul_in_groups(a, sizes, "pallas"), a)
        return h, vjp(g)[0]

    h, d = forward_and_grad(gate_up, dh)
    for got, want, what in ((h, O.silu_mul(gate_up[:end]), "h"), (d, O.silu_mul_vjp(gate_up[:end], dh[:end]), "d")):
        got = np.asarray(got[:end], np.float64)
        bad = ~(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-6)  # (a NaN is bad)
        assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off"
    assert not np.asarray(d[end:end + rows_read_past_groups()], np.float32).any(), "d past the groups"


@needs_hopper
def test_grouped_swiglu_ignores_rows_past_the_groups():
    """The Flax block's expert FFN (jax_ep.flax.experts.grouped_swiglu: grouped_matmul's kernels and the
    activation kernels between them) with NaN in the rows past the groups, as the cuda expert-major dispatch may
    leave them: y on the groups' rows against a float64 NumPy oracle, and y, dx and both dW against the same
    block on lax.ragged_dot and XLA's elementwise ops (which zero those rows first); all finite."""
    from jax_ep.flax.experts import grouped_swiglu, swiglu
    from jax_ep.grouped_matmul import grouped_matmul, resolve_implementation

    rng = np.random.default_rng(5)
    # F=384: every product, the down projection's included, fits jax_ep's kernels (ragged_dot would zero the
    # activation's rows past the groups before the down projection read them).
    num_rows, d, f, sizes = 1024, 256, 384, np.array([300, 0, 250, 150], np.int32)
    for shape, w_shape in (((num_rows, d), (4, d, 2 * f)), ((num_rows, f), (4, f, d))):
        assert resolve_implementation(jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                                      jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)) == "pallas"
    end = int(sizes.sum())
    x = rng.standard_normal((num_rows, d)).astype(np.float32)
    x[end:] = np.nan
    w_gu = (rng.standard_normal((4, d, 2 * f)) / np.sqrt(d)).astype(np.float32)
    w_d = (rng.standard_normal((4, f, d)) / np.sqrt(f)).astype(np.float32)
    dy = rng.standard_normal((num_rows, d)).astype(np.float32)
    dy[end:end + 256] = 0  # as the combine's gradient leaves them
    args = [jnp.asarray(a, jnp.bfloat16) for a in (x, w_gu, w_d, dy)]
    group_sizes = jnp.asarray(sizes)

    def reference(x, g, a, b):
        return swiglu(x, a, b, matmul=functools.partial(grouped_matmul, group_sizes=g, implementation="ragged_dot"))

    def fwd_and_grads(fn):
        @jax.jit
        def run(x, a, b, dy):
            y, vjp = jax.vjp(lambda x, a, b: fn(x, group_sizes, a, b), x, a, b)
            return (y, *vjp(dy))
        return [np.asarray(v, np.float32) for v in run(*args)]

    got, want = fwd_and_grads(grouped_swiglu), fwd_and_grads(reference)
    bf = [np.asarray(a, np.float64) for a in args]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    expected_y = np.zeros((end, d))
    for g, (start, size) in enumerate(zip(starts, sizes)):
        gate, up = np.split(bf[0][start:start + size] @ bf[1][g], 2, axis=-1)
        expected_y[start:start + size] = (gate / (1 + np.exp(-gate)) * up) @ bf[2][g]
    assert relative_error(got[0][:end], expected_y) <= BF16_TOLERANCE, "y against the oracle"
    for name, a, b in zip(("y", "dx", "dw_gate_up", "dw_down"), got, want):
        if name in ("y", "dx"):
            a, b = a[:end], b[:end]
        assert np.isfinite(a).all(), f"{name}: not finite"
        assert relative_error(a, b) <= BF16_TOLERANCE, name


@needs_hopper
@pytest.mark.parametrize("clustered", [False, True])
def test_gate_up_activation_in_the_forward_kernel(clustered):
    """The rows kernel with gate_up_activation (the block's: approximate transcendentals): gate_up against the
    float64 oracle and bitwise the kernel's without it (each output element takes the same steps over K); h against
    silu(gate) * up of those bf16 values in float64, to bf16 rounding; both zero past the last group."""
    import oracle as O

    from jax_ep.grouped_activation import _epilogue_forward_math
    m, k, f = 3072, 512, 384
    sizes = np.asarray(FUSED_TAIL_SIZES, np.int32)
    rng = np.random.default_rng(9)
    # Gates from about -40 to 40: sigmoid's tails as well as its middle.
    x, w = (jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)
            for shape, scale in (((m, k), 1.0), ((len(sizes), k, 2 * f), 0.5)))
    config = BlockConfig(block_n=256, num_stages=3, grid_tile_width=16, clustered=clustered)
    fused = jax.jit(functools.partial(pallas_grouped_op, "fwd", "pallas", config=config,
                                      gate_up_activation=_epilogue_forward_math))
    gate_up, h = fused(x, w, jnp.asarray(sizes))
    plain = jax.jit(functools.partial(pallas_grouped_op, "fwd", "pallas", config=config))(x, w, jnp.asarray(sizes))
    assert relative_error(gate_up, oracle(x, w, np.zeros((m, 2 * f)), sizes)[0]) <= BF16_TOLERANCE
    np.testing.assert_array_equal(np.asarray(gate_up, np.float32), np.asarray(plain, np.float32))
    end = int(sizes.sum())
    want = O.silu_mul(np.asarray(gate_up[:end], np.float32))
    got = np.asarray(h[:end], np.float64)
    bad = ~(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-6)
    assert not bad.any(), f"h: {bad.sum()} of {bad.size} off"
    assert not np.asarray(gate_up[end:], np.float32).any() and not np.asarray(h[end:], np.float32).any()


@needs_hopper
def test_activation_gradient_in_dx_against_oracle():
    """dx with gate_up_activation_grad (the block's: approximate transcendentals) on 128-column tiles, gates from
    about -30 to 30 (sigmoid's tails as well as its middle): d_gate_up against the float64 oracle's SwiGLU gradient
    of dh = dy @ w[g]^T rounded to bf16; zero past the groups."""
    import oracle as O

    from jax_ep.grouped_activation import _epilogue_backward_math
    m, k, n = 3072, 384, 512  # dh [M, 384] from dy [M, 512]; gate_up [M, 768]
    sizes = np.asarray(FUSED_TAIL_SIZES, np.int32)
    rng = np.random.default_rng(23)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(n), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((m, 2 * k)) * 8, jnp.bfloat16)
    config = BlockConfig(num_stages=5, grid_tile_width=16)
    d_gate_up = jax.jit(functools.partial(pallas_grouped_op, "dx", "pallas", config=config,
                                          gate_up_activation_grad=_epilogue_backward_math))(
        dy, w, jnp.asarray(sizes), gate_up=gate_up)
    end = int(sizes.sum())
    dh = oracle(np.zeros((m, k)), w, dy, sizes)[1]
    dh = np.asarray(jnp.asarray(dh, jnp.bfloat16), np.float64)  # rounded as the kernel rounds it
    want = O.silu_mul_vjp(np.asarray(gate_up, np.float64)[:end], dh[:end])
    assert relative_error(d_gate_up[:end], want) <= BF16_TOLERANCE
    assert not np.any(np.asarray(d_gate_up[end:], np.float32)), "rows past the last group must be zero"


@needs_hopper
def test_grouped_gate_up_silu_mul_fused_against_oracle_and_the_two_steps():
    """grouped_gate_up_silu_mul where the fused kernel runs (the table's moe-a gate and up projection: 256-column
    tiles, no pair tails): h, dx and dW against the float64 oracle on two groups' rows, and against the two steps
    (grouped_matmul, then silu_mul_in_groups): h to bf16 rounding, dx and dW bitwise (the backward runs the same
    kernels on the same gate_up)."""
    import oracle as O
    from jax_ep.grouped_activation import grouped_gate_up_silu_mul, silu_mul_in_groups
    from jax_ep.grouped_matmul import fuses_gate_up_activation, grouped_matmul

    m, d, f, groups = 16384, 2048, 1408, 64
    assert fuses_gate_up_activation("pallas", m, d, 2 * f, groups)
    rng = np.random.default_rng(13)
    sizes = np.full(groups, 240, np.int32)
    sizes[::3] += 16  # 240 rows: a partial second tile; 256: two full ones; 672 rows past the groups
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((groups, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((m, f)), jnp.bfloat16)

    def run(fn):
        @jax.jit
        def go(x, w, dh):
            h, vjp = jax.vjp(lambda x, w: fn(x, w, jnp.asarray(sizes)), x, w)
            return (h, *vjp(dh))
        return go(x, w, dh)

    fused = run(lambda x, w, s: grouped_gate_up_silu_mul(x, w, s, implementation="pallas"))
    steps = run(lambda x, w, s: silu_mul_in_groups(grouped_matmul(x, w, s, implementation="pallas"), s, "pallas"))
    end = int(sizes.sum())
    np.testing.assert_allclose(np.asarray(fused[0][:end], np.float32), np.asarray(steps[0][:end], np.float32),
                               rtol=2.0**-7, atol=1e-6)
    for name, a, b in zip(("dx", "dW"), fused[1:], steps[1:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    rows = slice(int(sizes[0]), int(sizes[:3].sum()))  # groups 1 and 2
    xs, dhs = np.asarray(x[rows], np.float64), np.asarray(dh[rows], np.float64)
    group_of_row = np.repeat([1, 2], sizes[1:3])
    gate_up = np.einsum("rd,rdn->rn", xs, np.asarray(w, np.float64)[group_of_row])
    assert relative_error(fused[0][rows], O.silu_mul(gate_up)) <= BF16_TOLERANCE
    d_gate_up = O.silu_mul_vjp(gate_up, dhs)
    want_dx = np.einsum("rn,rdn->rd", d_gate_up, np.asarray(w, np.float64)[group_of_row])
    assert relative_error(fused[1][rows], want_dx) <= BF16_TOLERANCE
    for g in (1, 2):
        mine = group_of_row == g
        assert relative_error(fused[2][g], xs[mine].T @ d_gate_up[mine]) <= BF16_TOLERANCE, f"dW[{g}]"


@needs_hopper
def test_expert_swiglu_with_the_activation_gradient_in_dx_against_oracle_and_the_two_steps():
    """expert_swiglu where the down projection's dx also applies the activation's gradient (moe-a: 128-column dx
    tiles): y, dx and both dW against the float64 oracle on two groups' rows, and against the fused forward with
    the separate gradient pass (grouped_gate_up_silu_mul, then grouped_matmul): y and the down projection's dW
    bitwise (the same kernels), dx and the gate and up's dW to bf16 rounding (the activation's gradient compiled
    by Mosaic GPU instead of Triton); dx zero past the groups."""
    import oracle as O
    from jax_ep.grouped_activation import expert_swiglu, grouped_gate_up_silu_mul
    from jax_ep.grouped_matmul import fuses_gate_up_activation, fuses_gate_up_activation_grad, grouped_matmul

    m, d, f, groups = 16384, 2048, 1408, 64
    assert fuses_gate_up_activation("pallas", m, d, 2 * f, groups)
    assert fuses_gate_up_activation_grad("pallas", m, f, d, groups)
    rng = np.random.default_rng(17)
    sizes = np.full(groups, 240, np.int32)
    sizes[::3] += 16  # 240 rows: a partial second tile; 256: two full ones; 672 rows past the groups
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    w_gate_up = jnp.asarray(rng.standard_normal((groups, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((groups, f, d)) / np.sqrt(f), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)

    def run(fn):
        @jax.jit
        def go(*args):
            y, vjp = jax.vjp(lambda *a: fn(*a, jnp.asarray(sizes)), *args)
            return (y, *vjp(dy))
        return go(x, w_gate_up, w_down)

    fused = run(lambda x, wg, wd, s: expert_swiglu(x, wg, wd, s, implementation="pallas"))
    steps = run(lambda x, wg, wd, s: grouped_matmul(grouped_gate_up_silu_mul(x, wg, s, implementation="pallas"), wd, s,
                                                   implementation="pallas"))
    for name, a, b in (("y", fused[0], steps[0]), ("dW down", fused[3], steps[3])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    for name, a, b in (("dx", fused[1], steps[1]), ("dW gate/up", fused[2], steps[2])):
        assert relative_error(a, np.asarray(b, np.float64)) <= BF16_TOLERANCE, name
    end = int(sizes.sum())
    assert not np.asarray(fused[1][end:], np.float32).any()
    rows = slice(int(sizes[0]), int(sizes[:3].sum()))  # groups 1 and 2
    group_of_row = np.repeat([0, 1], sizes[1:3])  # of groups 1 and 2's weights
    want_y, (want_dx, want_dwg, want_dwd) = O.grouped_swiglu(x[rows], w_gate_up[1:3], w_down[1:3], dy[rows],
                                                             group_of_row)
    assert relative_error(fused[0][rows], want_y) <= BF16_TOLERANCE
    assert relative_error(fused[1][rows], want_dx) <= BF16_TOLERANCE
    for g in (1, 2):
        assert relative_error(fused[2][g], want_dwg[g - 1]) <= BF16_TOLERANCE, f"dW gate/up[{g}]"
        assert relative_error(fused[3][g], want_dwd[g - 1]) <= BF16_TOLERANCE, f"dW down[{g}]"


@needs_hopper
@pytest.mark.parametrize("m, d, f, groups", [(16384, 2048, 1408, 16), (8192, 2048, 512, 16)],
                         ids=["fused (moe-a)", "two steps"])
def test_expert_swiglu_without_zeros_past_the_groups(m, d, f, groups):
    """expert_swiglu(zero_past_groups=False), as the Flax block runs it, on rows of which the groups fill about a
    quarter (the default expert-major capacity at four ranks) and the rest NaN (as the cuda dispatch leaves them),
    with a cotangent zero on 256 rows past the groups and NaN after them (as the combine's gradient leaves it:
    unwritten), through the fused
    kernels (moe-a's widths) and the two steps (grouped_matmul, the activation's kernels, grouped_matmul: F=512
    does not fuse the forward, as v3's widths do not at two ranks): y and the gradient of the rows on the groups'
    rows, and both weights' gradients, bitwise those of zero_past_groups=True; y and dx zero on
    rows_read_past_groups() rows past the groups; y of two groups and both their weight gradients against a
    float64 NumPy oracle."""
    import oracle as O
    from jax_ep.grouped_activation import expert_swiglu
    from jax_ep.grouped_matmul import fuses_gate_up_activation, fuses_gate_up_activation_grad, rows_read_past_groups

    fused = f == 1408
    assert fuses_gate_up_activation("pallas", m, d, 2 * f, groups) == fused
    assert fuses_gate_up_activation_grad("pallas", m, f, d, groups) or not fused

    rng = np.random.default_rng(23)
    sizes = rng.multinomial(m // 4, np.full(groups, 1 / groups)).astype(np.int32)
    end = int(sizes.sum())
    x = rng.standard_normal((m, d)).astype(np.float32)
    x[end:] = np.nan
    dy = rng.standard_normal((m, d)).astype(np.float32)
    dy[end:end + 256] = 0
    dy[end + 256:] = np.nan  # unwritten there
    x, dy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    w_gate_up = jnp.asarray(rng.standard_normal((groups, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((groups, f, d)) / np.sqrt(f), jnp.bfloat16)

    def run(zero_past_groups):
        @jax.jit
        def go(x, wg, wd):
            y, vjp = jax.vjp(lambda *a: expert_swiglu(*a, jnp.asarray(sizes), implementation="pallas",
                                                      zero_past_groups=zero_past_groups), x, wg, wd)
            return (y, *vjp(dy))
        return [np.asarray(a, np.float32) for a in go(x, w_gate_up, w_down)]

    unzeroed, zeroed = run(False), run(True)
    for name, a, b in zip(("y", "dx"), unzeroed[:2], zeroed[:2]):
        np.testing.assert_array_equal(a[:end], b[:end], err_msg=name)
        assert not a[end:end + rows_read_past_groups()].any(), f"{name}: not zero past the groups"
    for name, a, b in zip(("dW gate/up", "dW down"), unzeroed[2:], zeroed[2:]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    bf = [np.asarray(a, np.float64) for a in (x, w_gate_up, w_down, dy)]
    for g in (1, groups - 1):
        rows = slice(int(starts[g]), int(starts[g] + sizes[g]))
        gate_up = bf[0][rows] @ bf[1][g]
        h = O.silu_mul(gate_up)
        assert relative_error(unzeroed[0][rows], h @ bf[2][g]) <= BF16_TOLERANCE, f"y of group {g}"
        d_gate_up = O.silu_mul_vjp(gate_up, bf[3][rows] @ bf[2][g].T)
        assert relative_error(unzeroed[2][g], bf[0][rows].T @ d_gate_up) <= BF16_TOLERANCE, f"dW gate/up[{g}]"
        assert relative_error(unzeroed[3][g], h.T @ bf[3][rows]) <= BF16_TOLERANCE, f"dW down[{g}]"
