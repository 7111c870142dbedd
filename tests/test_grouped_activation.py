"""jax_ep.grouped_activation (SwiGLU's silu(gate) * up on grouped rows) against the float64 oracle: the XLA
path on every row, the Pallas Triton kernels (interpreted on CPU; tests/gpu runs them compiled) on the rows they
promise, through the custom VJP too."""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import oracle as O
import pytest
from conftest import mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import grouped_activation as ga
from jax_ep.grouped_matmul import rows_read_past_groups

# One rounding to bfloat16 of a float32 result (8 bits of mantissa), plus the float32 math's own error.
BF16_RTOL, BF16_ATOL = 2.0**-8, 1e-6


def inputs(num_rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    gate_up = jnp.asarray(rng.standard_normal((num_rows, 2 * cols)) * 3, jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((num_rows, cols)), jnp.bfloat16)
    return gate_up, dh


def assert_close(got, want, what):
    got = np.asarray(got, np.float64)
    bad = ~(np.abs(got - want) <= BF16_RTOL * np.abs(want) + BF16_ATOL)  # (a NaN is bad)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, first at {np.argwhere(bad)[0]}"


def group_sizes_ending_at(end, groups=4):
    sizes = np.full(groups, end // groups)
    sizes[-1] += end - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("num_rows, cols, end", [(48, 192, 37), (64, 256, 64), (40, 128, 0), (88, 320, 17)])
def test_kernels_on_the_rows_they_promise(num_rows, cols, end):
    """Forward: the oracle on rows before the groups' end. Gradient: the oracle there, zeros on the next rows
    (as many as the caller asks, here 5), both rounded once to bfloat16. Blocks of 8 and 16 rows, of 64 to 256
    columns (F a multiple of 64, not of 256, too)."""
    gate_up, dh = inputs(num_rows, cols)
    h = ga.forward_kernel(gate_up, jnp.array([end], jnp.int32), interpret=True)
    d = ga.backward_kernel(gate_up, dh, jnp.array([end], jnp.int32), 5, interpret=True)
    assert h.shape == (num_rows, cols) and h.dtype == jnp.bfloat16 and d.shape == gate_up.shape
    assert_close(h[:end], O.silu_mul(gate_up)[:end], "h")
    assert_close(d[:end], O.silu_mul_vjp(gate_up, dh)[:end], "d gate_up")
    assert not np.asarray(d[end:end + 5], np.float32).any(), "d gate_up past the groups"


def interpret_kernels(monkeypatch):
    """The kernels interpreted: the path grouped_matmul's own kernels take on a GPU."""
    monkeypatch.setattr(ga, "forward_kernel", functools.partial(ga.forward_kernel, interpret=True))
    monkeypatch.setattr(ga, "backward_kernel", functools.partial(ga.backward_kernel, interpret=True))


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("sizes, end", [([100, -5, 70, 30], 200), ([200, 150], 304)])
def test_silu_mul_in_groups_and_its_vjp(monkeypatch, kernels, sizes, end):
    """Through the custom VJP: the oracle on the groups' rows; on the XLA path zeros past them, forward and
    gradient; on the kernels' path zeros on the rows_read_past_groups() rows after them. Group sizes are clamped
    as grouped_matmul clamps them (a negative size counts as 0, groups end at row M)."""
    num_rows, cols = 304, 128
    if kernels:
        interpret_kernels(monkeypatch)
    gate_up, dh = inputs(num_rows, cols, seed=1)
    sizes = jnp.array(sizes, jnp.int32)
    h, vjp = jax.vjp(lambda a: ga.silu_mul_in_groups(a, sizes, "pallas" if kernels else "ragged_dot"), gate_up)
    (d,) = vjp(dh)
    assert_close(h[:end], O.silu_mul(gate_up)[:end], "h")
    assert_close(d[:end], O.silu_mul_vjp(gate_up, dh)[:end], "d gate_up")
    zeroed = num_rows if not kernels else end + rows_read_past_groups()
    assert not np.asarray(d[end:zeroed], np.float32).any(), "d gate_up past the groups"
    if not kernels:
        assert not np.asarray(h[end:], np.float32).any(), "h past the groups"


def test_gate_up_needs_an_even_number_of_columns():
    with pytest.raises(ValueError, match="gate_up"):
        ga.silu_mul_in_groups(jnp.zeros((4, 5)), jnp.array([4], jnp.int32), "ragged_dot")


@pytest.mark.parametrize("num_rows, cols, blocks", [(49376, 1408, (16, 128)), (66432, 2048, (16, 256)),
                                                    (40, 192, (8, 64)), (300, 128, None), (304, 96, None)])
def test_kernel_blocks_tile_the_arrays_or_leave_them_to_xla(monkeypatch, num_rows, cols, blocks):
    """The kernels' blocks divide the rows and F exactly (moe-a's and v3's EP2 capacity rows above); where only
    blocks under 8 rows or 64 columns would, the XLA path runs instead, even on "pallas"."""
    assert ga.kernel_blocks(num_rows, cols) == blocks
    if blocks is None:
        monkeypatch.setattr(ga, "forward_kernel", lambda *a, **k: pytest.fail("the kernels ran"))
        h = ga.silu_mul_in_groups(jnp.ones((num_rows, 2 * cols), jnp.bfloat16), jnp.array([5], jnp.int32), "pallas")
        assert not np.asarray(h[5:], np.float32).any()
        with pytest.raises(ValueError, match="multiple of 8"):
            ga.backward_kernel(jnp.ones((num_rows, 2 * cols)), jnp.ones((num_rows, cols)), jnp.array([5]), 5)


def test_the_epilogue_sigmoid_against_the_oracle():
    """The fused kernels' sigmoid, rsqrt(1 + exp(-x))^2, in float32 (here XLA's exact ops; the kernels' approximate
    ones add about 2^-22): within a few float32 ulps of 1 / (1 + exp(-x)) in float64 over the normal range, 0 and 1 at the
    infinities, nan at nan, and the block's SwiGLU step and its gradient through it against the oracle's."""
    x = np.concatenate([np.linspace(-90, 90, 4001), [-np.inf, -1e30, -200.0, 200.0, 1e30, np.inf]])
    x = x.astype(np.float32).astype(np.float64)  # the kernels' inputs
    with np.errstate(over="ignore"):
        want = 1 / (1 + np.exp(-x))
    got = np.asarray(jax.jit(ga._epilogue_sigmoid)(jnp.asarray(x, jnp.float32)), np.float64)
    # (Below float32's smallest normal the approximate ops flush to zero.)
    np.testing.assert_allclose(got, want, rtol=2.0**-20, atol=np.finfo(np.float32).tiny)
    assert got[x == -np.inf] == 0 and got[x == np.inf] == 1
    assert np.isnan(np.asarray(ga._epilogue_sigmoid(jnp.float32(np.nan))))
    rng = np.random.default_rng(5)
    gate_up = rng.standard_normal((64, 256)) * 4
    dh = rng.standard_normal((64, 128))
    gate, up = (jnp.asarray(a, jnp.float32) for a in np.split(gate_up, 2, axis=-1))
    h = np.asarray(ga._epilogue_forward_math(gate, up), np.float64)
    np.testing.assert_allclose(h, O.silu_mul(gate_up), rtol=2.0**-18, atol=1e-30)
    grads = ga._epilogue_backward_math(gate, up, jnp.asarray(dh, jnp.float32))
    np.testing.assert_allclose(np.concatenate([np.asarray(g, np.float64) for g in grads], axis=-1),
                               O.silu_mul_vjp(gate_up, dh), rtol=2.0**-16, atol=1e-5)


def test_unresolved_implementation_is_refused():
    with pytest.raises(ValueError, match="implementation"):
        ga.silu_mul_in_groups(jnp.zeros((8, 128)), jnp.array([4], jnp.int32), "auto")


@pytest.mark.parametrize("kernels", [False, True])
def test_inside_shard_map(monkeypatch, kernels):
    """Per rank, inside shard_map, forward and gradient as on one device: the oracle on each rank's groups. The
    XLA path under shard_map's vma checks (the MoE block's); the interpreted kernels without them (JAX's Pallas
    interpreter slices the varying operands with unvarying block indices, which the checks refuse; compiled
    kernels have no such slices: test_kernels_lower_for_cuda_inside_shard_map)."""
    R, num_rows, cols = 4, 48, 128
    if kernels:
        interpret_kernels(monkeypatch)
    gate_up, dh = inputs(R * num_rows, cols, seed=2)
    sizes = np.array([[10, 20], [0, 0], [48, 9], [5, 1]], np.int32)

    def body(a, g, s):
        h, vjp = jax.vjp(lambda a: ga.silu_mul_in_groups(a, s, "pallas" if kernels else "ragged_dot"), a)
        return h, vjp(g)[0]

    mesh = mesh_of(R)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=not kernels))
    h, d = step(np.asarray(gate_up), np.asarray(dh), sizes.reshape(-1))
    for r in range(R):
        rows = slice(r * num_rows, r * num_rows + min(int(sizes[r].sum()), num_rows))
        assert_close(h[rows], O.silu_mul(gate_up[rows]), f"rank {r}: h")
        assert_close(d[rows], O.silu_mul_vjp(gate_up[rows], dh[rows]), f"rank {r}: d gate_up")


@pytest.mark.usefixtures("triton_lowers_for_an_h200")
def test_kernels_lower_for_cuda_inside_shard_map():
    """The kernels' path under shard_map's vma checks, as the MoE block runs it: forward and gradient lower for
    CUDA (two Triton kernels), their results typed as the rank's rows vary."""
    mesh = mesh_of(2)
    rows = jax.ShapeDtypeStruct((2 * 48, 2 * 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("ep")))
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(mesh, P("ep")))

    def body(a, s):
        h, vjp = jax.vjp(lambda a: ga.silu_mul_in_groups(a, s, "pallas"), a)
        return h, vjp(h)[0]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    text = step.trace(rows, sizes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2, "the forward and the gradient kernel"


gm_module = importlib.import_module("jax_ep.grouped_matmul")  # the name jax_ep.grouped_matmul is the function
needs_pallas = pytest.mark.skipif(gm_module._pallas_modules().ours is None, reason="this JAX has no Pallas Mosaic GPU")


# (rows, D, 2F, groups) per rank: moe-a's gate and up projection, whose table rule takes 256-column tiles without
# pair tails; V3's slice at EP2, whose rule has pair tails.
MOE_A_GATE_UP = (16384, 2048, 2816, 64)
V3_EP2_GATE_UP = (32768, 7168, 4096, 128)


@needs_pallas
def test_which_forward_kernels_take_the_activation():
    fuses = gm_module.fuses_gate_up_activation
    assert fuses("pallas", *MOE_A_GATE_UP)
    assert not fuses("pallas", *V3_EP2_GATE_UP)  # pair tails
    assert not fuses("pallas", 1024, 256, 768, 5)  # the default tiles: 128 columns
    assert not fuses("ragged_dot", *MOE_A_GATE_UP) and not fuses("jax_pallas", *MOE_A_GATE_UP)


def lowered_for_cuda_in_shard_map(monkeypatch, body, *shapes) -> str:
    """body jitted in shard_map over two ranks, jax_ep's kernels chosen, and lowered for CUDA: its text. Argument i
    is [2 * a, ...] for shapes[i] = (a, ...), split over the ranks; bfloat16, the last (the group sizes) int32."""
    monkeypatch.setattr(ga, "resolve_implementation", lambda x, w, implementation="auto": "pallas")
    monkeypatch.setattr(gm_module, "_num_sms", lambda budget=None: 132)  # an H200's (no GPU here to ask)
    mesh = mesh_of(2)
    ranks = NamedSharding(mesh, P("ep"))
    args = [jax.ShapeDtypeStruct((2 * shape[0], *shape[1:]), jnp.int32 if i == len(shapes) - 1 else jnp.bfloat16,
                                 sharding=ranks) for i, shape in enumerate(shapes)]
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@needs_pallas
@pytest.mark.usefixtures("triton_lowers_for_an_h200")
def test_fused_gate_up_activation_lowers_for_cuda_inside_shard_map(monkeypatch):
    """grouped_gate_up_silu_mul's fused path under shard_map's vma checks, as the MoE block runs it: forward and
    gradient lower for CUDA as three Mosaic GPU kernels (the fused forward, dx, dW) and one Triton kernel (the
    activation's gradient; no forward activation kernel), every result typed as the rank's rows vary."""
    rows, d, n, groups = MOE_A_GATE_UP

    def body(x, w, s):
        h, vjp = jax.vjp(lambda x, w: ga.grouped_gate_up_silu_mul(x, w, s, implementation="pallas"), x, w)
        return h, vjp(h)

    text = lowered_for_cuda_in_shard_map(monkeypatch, body, (rows, d), (groups, d, n), (groups,))
    assert text.count("__gpu$xla.gpu.triton") == 1, "only the activation's gradient runs apart"
    assert text.count("custom_call @mosaic_gpu") == 3, "the fused forward, dx and dW"

# (rows, F, D, groups) per rank: moe-a's down projection, whose dx rule takes 128-column tiles and 5 stages.
MOE_A_DOWN = (16384, 1408, 2048, 64)


@needs_pallas
def test_which_dx_kernels_take_the_activation_gradient():
    fuses = gm_module.fuses_gate_up_activation_grad
    assert fuses("pallas", *MOE_A_DOWN)
    assert not fuses("pallas", 32768, 2048, 7168, 128)  # V3's slice at EP2: 256 columns, pair tails
    assert not fuses("pallas", 32768, 2048, 7168, 256)  # V3 at EP1: 256 columns
    assert not fuses("ragged_dot", *MOE_A_DOWN) and not fuses("jax_pallas", *MOE_A_DOWN)
    assert not fuses("pallas", 256, 192, 128, 2)  # the default 128-column tiles do not divide dx's 192 columns


@needs_pallas
@pytest.mark.parametrize("zero_past_groups", [True, False])
def test_expert_swiglu_fused_both_ways_lowers_for_cuda_inside_shard_map(monkeypatch, zero_past_groups):
    """expert_swiglu where both the forward activation and its gradient fuse (moe-a), under shard_map's vma checks
    as the MoE block runs it (zero_past_groups=False) and by default: forward and gradient lower for CUDA as six
    Mosaic GPU kernels (the fused forward, the down projection, its dW, its dx writing the cotangent of gate_up, dx
    and dW of the gate and up) and no Triton kernel."""
    rows, f, d, groups = MOE_A_DOWN

    def body(x, w_gate_up, w_down, s):
        y, vjp = jax.vjp(lambda *a: ga.expert_swiglu(*a, s, implementation="pallas",
                                                     zero_past_groups=zero_past_groups), x, w_gate_up, w_down)
        return y, vjp(y)

    text = lowered_for_cuda_in_shard_map(monkeypatch, body, (rows, d), (groups, d, 2 * f), (groups, f, d), (groups,))
    assert text.count("__gpu$xla.gpu.triton") == 0
    assert text.count("custom_call @mosaic_gpu") == 6


@pytest.mark.parametrize("zero_past_groups", [True, False])
def test_expert_swiglu_on_xla_against_the_oracle(zero_past_groups):
    """expert_swiglu where nothing fuses (XLA's ragged_dot): y and its pullback to the rows and both weights
    against the float64 oracle; zeros past the groups (with zero_past_groups=False at least on the
    rows_read_past_groups() rows after them)."""
    rng = np.random.default_rng(5)
    m, d, f, sizes = 64, 32, 48, np.asarray([10, 0, 23, 15], np.int32)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    w_gate_up = jnp.asarray(rng.standard_normal((len(sizes), d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((len(sizes), f, d)) / np.sqrt(f), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)

    @jax.jit
    def step(x, w_gate_up, w_down, dy):
        y, vjp = jax.vjp(lambda *a: ga.expert_swiglu(*a, jnp.asarray(sizes), implementation="ragged_dot",
                                                     zero_past_groups=zero_past_groups), x, w_gate_up, w_down)
        return y, vjp(dy)

    y, (dx, dwg, dwd) = step(x, w_gate_up, w_down, dy)
    end = int(sizes.sum())
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    want_y, (want_dx, want_dwg, want_dwd) = O.grouped_swiglu(x[:end], w_gate_up, w_down, dy[:end], group_of_row)
    for name, got, want in (("y", y[:end], want_y), ("dx", dx[:end], want_dx), ("dW gate/up", dwg, want_dwg),
                            ("dW down", dwd, want_dwd)):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want), name
    zeroed = m if zero_past_groups else end + rows_read_past_groups()
    assert not np.asarray(y[end:zeroed], np.float32).any() and not np.asarray(dx[end:zeroed], np.float32).any()


@needs_pallas
def test_expert_swiglu_resolves_each_projection_for_its_own_shapes(monkeypatch):
    """"auto" on a Hopper GPU (faked): at F=192 the gate and up projection can run on jax_ep's kernels but the down
    projection cannot (its dx's 192 columns are no multiple of the 128-column tiles), which then takes XLA's
    ragged_dot as grouped_matmul(h, w_down) alone would, instead of failing."""
    monkeypatch.setattr(gm_module, "_hopper_unsupported_reason", lambda: None)
    monkeypatch.setattr(gm_module, "_num_sms", lambda budget=None: 132)
    m, d, f, groups = 256, 128, 192, 2
    assert gm_module.resolve_implementation(jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
                                            jax.ShapeDtypeStruct((groups, d, 2 * f), jnp.bfloat16)) == "pallas"
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((m, d), (groups, d, 2 * f), (groups, f, d))]
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    y = jax.eval_shape(lambda *a: ga.expert_swiglu(*a), *args, sizes)
    assert y.shape == (m, d)
