"""SwiGLU's elementwise step, silu(gate) * up, on rows sorted by group (the MoE block's expert-major rows), with
its VJP:

    h = silu_mul_in_groups(gate_up, group_sizes, implementation)   # gate_up [M, 2F] -> h [M, F]

gate_up holds each row's gate (its first F columns) and up (the last F), as `grouped_matmul` of the rows with
the experts' [D, 2F] weights gives them. For a row r below sum(group_sizes) (sizes clamped as grouped_matmul
clamps them) h[r] = silu(gate[r]) * up[r], computed in float32 from the inputs and rounded once to their dtype;
the VJP's d gate = dh * up * s * (1 + gate * (1 - s)) and d up = dh * gate * s with s = sigmoid(gate), likewise.

Rows past the groups depend on `implementation`, that of the grouped_matmul that gave gate_up (whose dw reads the
gradient):

* "pallas" (grouped_matmul's own kernels, on a CUDA GPU), where M is a multiple of 8 and F of 64
  (`kernel_blocks`): Pallas Triton kernels that stop at the last group, so that their work follows the rows the
  groups hold, not M (the expert-major capacity, which by default never drops: R * T * min(K, L) rows per rank,
  about R times what the groups fill). h past the groups is unspecified (no output of grouped_matmul depends on
  those rows of its x); the gradient is zero on the first `rows_read_past_groups()` rows past them
  (grouped_matmul's dw kernels read that many of their rhs past a group's end and multiply them by zero, so they
  must be finite) and unspecified after them. Inside shard_map the kernels' results vary over the mesh axes
  their operands vary over (their out_shape says so, as shard_map's vma checks need).
* any other: XLA's elementwise ops over all M rows, zero past the groups (forward and gradient).

    h = grouped_gate_up_silu_mul(rows, w_gate_up, group_sizes, implementation)

is silu_mul_in_groups(grouped_matmul(rows, w_gate_up, group_sizes, implementation=...), group_sizes, ...) (the
first half of an expert SwiGLU). Where grouped_matmul's forward kernel can apply the activation in its epilogue
(`fuses_gate_up_activation`: jax_ep's kernels on 256-column tiles without pair tails, and the activation kernels'
blocks fit), one kernel writes gate_up (kept for the backward) and h, rounding the gate and the up to their dtype
before the activation as a separate pass would read them; h past the groups is then zero (with
`zero_past_groups=False`, as grouped_matmul's: on `rows_read_past_groups()` rows, the kernel writing no more). Its
VJP is the two steps' VJPs on the same kernels.

    y = expert_swiglu(rows, w_gate_up, w_down, group_sizes, implementation=...)

is grouped_matmul(grouped_gate_up_silu_mul(rows, w_gate_up, ...), w_down, ...) (an expert SwiGLU, as
jax_ep.flax.experts.grouped_swiglu runs it). Where the forward fuses and the down projection's dx can also apply
the activation's gradient (`fuses_gate_up_activation_grad`: its tiles 128 columns without pair tails), one custom
VJP spans both matmuls, and that dx kernel writes the cotangent of gate_up from the dh it computes (rounded to its
dtype first, as the separate pass would read it): no dh in memory and no gradient pass. Past the groups it is what
the "pallas" gradient above is (zero on `rows_read_past_groups()` rows, unspecified after). The gradient's formula
is the separate pass's, compiled by Mosaic GPU instead of Triton. Both fused kernels take the sigmoid as
`_epilogue_sigmoid` on approximate transcendentals (within a few float32 ulps): h and the gradient may differ from
the separate passes' in the last bit of their dtype.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_ep._cotangents import typed_like
from jax_ep.grouped_matmul import (
    IMPLEMENTATIONS,
    block_config,
    check_grouped_matmul_args,
    clamp_group_sizes,
    fuses_gate_up_activation,
    fuses_gate_up_activation_grad,
    grouped_matmul,
    grouped_matmul_pullback,
    grouped_op,
    groups_end,
    pallas_grouped_op,
    problem_shape,
    resolve_implementation,
    rows_read_past_groups,
    zeroed_rows_end,
)

# Rows x columns (of the gate's F, and the same of the up's) of one program of the kernels: up to 16 x 256
# bfloat16, 8 KB of each input per program, enough loads in flight for an elementwise pass at the copy's
# bandwidth. The blocks tile the arrays exactly: blocks reaching past F (256 columns of F=1408 and of F=200, on an
# H200 with jax 0.11.2) gave wrong values at the start of the next rows, as stores past F left unmasked would.
MAX_BLOCK_ROWS = 16
MIN_BLOCK_ROWS = 8
MAX_BLOCK_COLS = 256
MIN_BLOCK_COLS = 64


def kernel_blocks(num_rows: int, cols: int) -> tuple[int, int] | None:
    """(rows, columns) of the kernels' blocks for gate_up [num_rows, 2 * cols]: the largest powers of two up to
    MAX_BLOCK_ROWS x MAX_BLOCK_COLS that divide num_rows and cols; None (the XLA path) where those would be below
    MIN_BLOCK_ROWS x MIN_BLOCK_COLS."""
    rows, block_cols = math.gcd(num_rows, MAX_BLOCK_ROWS), math.gcd(cols, MAX_BLOCK_COLS)  # (powers of two)
    return (rows, block_cols) if rows >= MIN_BLOCK_ROWS and block_cols >= MIN_BLOCK_COLS else None


RESOLVED_IMPLEMENTATIONS = tuple(i for i in IMPLEMENTATIONS if i != "auto")


def silu_mul_in_groups(gate_up: jax.Array, group_sizes: jax.Array, implementation: str) -> jax.Array:
    """h [M, F] from gate_up [M, 2F] (module docstring); group_sizes int32 [G]; implementation: that of the
    grouped_matmul that gave gate_up, resolved ("pallas", "jax_pallas" or "ragged_dot"). Differentiable in
    gate_up."""
    if implementation not in RESOLVED_IMPLEMENTATIONS:
        raise ValueError(f"jax_ep: implementation must be one of {RESOLVED_IMPLEMENTATIONS} (grouped_matmul's, "
                         f"resolved), got {implementation!r}")
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"jax_ep: gate_up must be [M, 2F] (an even number of columns), got {gate_up.shape}")
    end = groups_end(group_sizes, gate_up.shape[0])
    kernels = implementation == "pallas" and kernel_blocks(gate_up.shape[0], gate_up.shape[1] // 2) is not None
    return _silu_mul(gate_up, end, kernels)


def _gate_and_up_f32(gate_up):
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return gate, up


def _forward_math(gate, up, sigmoid=jax.nn.sigmoid):
    return gate * sigmoid(gate) * up


def _backward_math(gate, up, dh, sigmoid=jax.nn.sigmoid):
    s = sigmoid(gate)
    return dh * up * s * (1 + gate * (1 - s)), dh * gate * s


def _epilogue_sigmoid(x):
    """sigmoid(x) = 1 / (1 + exp(-x)) as rsqrt(1 + exp(-x))^2, for the rows kernel's epilogues, which compile their
    activation with approximate transcendentals (ex2.approx, rsqrt.approx: about 2^-22 relative error each, far
    below bf16's 2^-8): a few instructions a value where an IEEE exp and division take about twenty, while the
    tensor cores wait for the epilogue. Limits as sigmoid's: 0 at -inf (rsqrt(inf) = 0), 1 at +inf."""
    r = jax.lax.rsqrt(1 + jnp.exp(-x))
    return r * r


# The fused kernels' activation and its gradient (`ragged_rows_matmul`'s gate_up_activation and
# gate_up_activation_grad).
_epilogue_forward_math = functools.partial(_forward_math, sigmoid=_epilogue_sigmoid)
_epilogue_backward_math = functools.partial(_backward_math, sigmoid=_epilogue_sigmoid)


def _rows_before(end, num_rows):
    return (jnp.arange(num_rows) < end)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _silu_mul(gate_up, end, kernels: bool):
    if kernels:
        return forward_kernel(gate_up, end[None])
    h = _forward_math(*_gate_and_up_f32(gate_up))
    return jnp.where(_rows_before(end, gate_up.shape[0]), h, 0).astype(gate_up.dtype)


def _silu_mul_fwd(gate_up, end, kernels):
    return _silu_mul(gate_up, end, kernels), (gate_up, end)


def _silu_mul_bwd(kernels, residuals, dh):
    gate_up, end = residuals
    if kernels:
        return typed_like(backward_kernel(gate_up, dh, end[None], rows_read_past_groups()), gate_up), None
    d_gate, d_up = _backward_math(*_gate_and_up_f32(gate_up), dh.astype(jnp.float32))
    d_gate_up = jnp.concatenate([d_gate, d_up], axis=-1)
    return jnp.where(_rows_before(end, gate_up.shape[0]), d_gate_up, 0).astype(gate_up.dtype), None


_silu_mul.defvjp(_silu_mul_fwd, _silu_mul_bwd)


def grouped_gate_up_silu_mul(rows: jax.Array, w_gate_up: jax.Array, group_sizes: jax.Array, *,
                             implementation: str = "auto", zero_past_groups: bool = True) -> jax.Array:
    """h [M, F] = silu_mul_in_groups(grouped_matmul(rows, w_gate_up, group_sizes, implementation=implementation,
    zero_past_groups=zero_past_groups)) (module docstring), in one kernel where that applies. rows [M, D],
    w_gate_up [G, D, 2F], group_sizes int32 [G], checked as grouped_matmul checks them. Differentiable in rows and
    w_gate_up."""
    check_grouped_matmul_args(rows, w_gate_up, group_sizes, implementation)
    implementation = resolve_implementation(rows, w_gate_up, implementation)
    (num_rows, d), (groups, _, n) = rows.shape, w_gate_up.shape
    if not (fuses_gate_up_activation(implementation, num_rows, d, n, groups)
            and kernel_blocks(num_rows, n // 2) is not None):
        gate_up = grouped_matmul(rows, w_gate_up, group_sizes, implementation=implementation,
                                 zero_past_groups=zero_past_groups)
        return silu_mul_in_groups(gate_up, group_sizes, implementation)
    group_sizes = clamp_group_sizes(group_sizes, num_rows)
    return _fused_gate_up_silu_mul(rows, w_gate_up, group_sizes, groups_end(group_sizes, num_rows),
                                   bool(zero_past_groups))


def _fused_forward(rows, w_gate_up, group_sizes, zero_past_groups):
    """(gate_up, h) of one fused kernel (grouped_matmul's forward, "pallas", the table's configuration)."""
    (num_rows, d), (groups, _, n) = rows.shape, w_gate_up.shape
    config = block_config("pallas", "fwd", num_rows, d, n, groups)
    gate_up, h = pallas_grouped_op("fwd", "pallas", rows, w_gate_up, group_sizes, config,
                                   zero_rows_end=zeroed_rows_end(group_sizes, num_rows, zero_past_groups),
                                   gate_up_activation=_epilogue_forward_math)
    return typed_like(gate_up, rows, w_gate_up, group_sizes), typed_like(h, rows, w_gate_up, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_gate_up_silu_mul(rows, w_gate_up, group_sizes, end, zero_past_groups):
    return _fused_forward(rows, w_gate_up, group_sizes, zero_past_groups)[1]


def _fused_gate_up_silu_mul_fwd(rows, w_gate_up, group_sizes, end, zero_past_groups):
    gate_up, h = _fused_forward(rows, w_gate_up, group_sizes, zero_past_groups)
    return h, (rows, w_gate_up, group_sizes, end, gate_up)


def _fused_gate_up_silu_mul_bwd(zero_past_groups, residuals, dh):
    rows, w_gate_up, group_sizes, end, gate_up = residuals
    d_gate_up, _ = _silu_mul_bwd(True, (gate_up, end), dh)  # the two steps' activation gradient, on its kernel
    # group_sizes and end are integer-valued: no cotangents.
    return (*grouped_matmul_pullback(rows, w_gate_up, group_sizes, d_gate_up, "pallas",
                                     zero_past_groups=zero_past_groups), None, None)


_fused_gate_up_silu_mul.defvjp(_fused_gate_up_silu_mul_fwd, _fused_gate_up_silu_mul_bwd)


def expert_swiglu(rows: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array, *,
                  implementation: str = "auto", zero_past_groups: bool = True) -> jax.Array:
    """grouped_matmul(grouped_gate_up_silu_mul(rows, w_gate_up, group_sizes), w_down, group_sizes) (module
    docstring), each on `implementation` and with `zero_past_groups` (grouped_matmul's: False leaves the rows of y
    and of the gradient of rows past the groups unspecified but for the first rows_read_past_groups(), and jax_ep's
    kernels do not write them). Where the forward fuses the activation and the down projection's dx can apply its
    gradient (`fuses_gate_up_activation_grad`), the VJP's dx of the down projection writes the cotangent of gate_up
    itself, from the dh it computes (rounded to its dtype first, as the separate pass would read it), instead of dh
    for a separate pass. rows [M, D], w_gate_up [G, D, 2F], w_down [G, F, D], group_sizes int32 [G].
    Differentiable in rows and both weights."""
    check_grouped_matmul_args(rows, w_gate_up, group_sizes, implementation)
    resolved = resolve_implementation(rows, w_gate_up, implementation)
    (num_rows, d), (groups, _, n) = rows.shape, w_gate_up.shape
    if not (fuses_gate_up_activation(resolved, num_rows, d, n, groups)
            and fuses_gate_up_activation_grad(resolved, num_rows, n // 2, w_down.shape[-1], groups)):
        # Each projection resolves `implementation` for its own shapes ("auto" may take different ones).
        h = grouped_gate_up_silu_mul(rows, w_gate_up, group_sizes, implementation=implementation,
                                     zero_past_groups=zero_past_groups)
        return grouped_matmul(h, w_down, group_sizes, implementation=implementation,
                              zero_past_groups=zero_past_groups)
    # w_down is checked as grouped_matmul(h, w_down, ...) would check it, h being [M, F] in rows' dtype.
    check_grouped_matmul_args(jax.ShapeDtypeStruct((num_rows, n // 2), rows.dtype), w_down, group_sizes,
                              implementation)
    return _fused_swiglu(rows, w_gate_up, w_down, clamp_group_sizes(group_sizes, num_rows), bool(zero_past_groups))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_swiglu(rows, w_gate_up, w_down, group_sizes, zero_past_groups):
    return _fused_swiglu_fwd(rows, w_gate_up, w_down, group_sizes, zero_past_groups)[0]


def _fused_swiglu_fwd(rows, w_gate_up, w_down, group_sizes, zero_past_groups):
    gate_up, h = _fused_forward(rows, w_gate_up, group_sizes, zero_past_groups)
    y = grouped_op("fwd", "pallas", h, w_down, group_sizes, problem_shape(h, w_down),
                   zero_rows_end=zeroed_rows_end(group_sizes, rows.shape[0], zero_past_groups))
    return typed_like(y, rows, w_gate_up, w_down, group_sizes), (rows, w_gate_up, w_down, group_sizes, gate_up, h)


def _fused_swiglu_bwd(zero_past_groups, residuals, dy):
    rows, w_gate_up, w_down, group_sizes, gate_up, h = residuals
    problem = problem_shape(h, w_down)
    d_w_down = typed_like(grouped_op("dw", "pallas", h, dy, group_sizes, problem), w_down)
    # Zero on the rows past the groups that grouped_matmul's dw reads; unwritten after them.
    d_gate_up = pallas_grouped_op("dx", "pallas", dy, w_down, group_sizes, block_config("pallas", "dx", *problem),
                                  zero_rows_end=zeroed_rows_end(group_sizes, rows.shape[0], False),
                                  gate_up=gate_up, gate_up_activation_grad=_epilogue_backward_math)
    d_rows, d_w_gate_up = grouped_matmul_pullback(rows, w_gate_up, group_sizes, typed_like(d_gate_up, gate_up),
                                                  "pallas", zero_past_groups=zero_past_groups)
    return d_rows, d_w_gate_up, d_w_down, None  # group_sizes is integer-valued: no cotangent


_fused_swiglu.defvjp(_fused_swiglu_fwd, _fused_swiglu_bwd)


def _grid_and_specs(num_rows: int, cols: int):
    """The kernels' block rows, grid (row blocks, column blocks of F) and the block specs of the gate and the up
    in gate_up viewed as [M, 2, F] (a free reshape), of h [M, F], and of d gate_up [M, 2, F]."""
    from jax.experimental import pallas as pl

    blocks = kernel_blocks(num_rows, cols)
    if blocks is None:
        raise ValueError(f"jax_ep: the activation kernels need gate_up's rows a multiple of {MIN_BLOCK_ROWS} and F "
                         f"of {MIN_BLOCK_COLS}, got [{num_rows}, 2 * {cols}]")
    block_rows, block_cols = blocks
    grid = (num_rows // block_rows, cols // block_cols)
    half = [pl.BlockSpec((block_rows, None, block_cols), lambda i, j, part=part: (i, part, j)) for part in (0, 1)]
    rows_spec = pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j))
    pair_spec = pl.BlockSpec((block_rows, 2, block_cols), lambda i, j: (i, 0, j))
    scalar_spec = pl.BlockSpec((1,), lambda i, j: (0,))
    return block_rows, grid, half, rows_spec, pair_spec, scalar_spec


def _varying_together(*arrays):
    """`arrays` each varying over the union of the shard_map axes they vary over: under shard_map's check_vma a
    pallas_call's out_shape says how its result varies (`_like`), and its operands must agree."""
    return [typed_like(a, *arrays) for a in arrays]


def _like(a, shape):
    """The out_shape of a kernel result of `shape` in a's dtype, varying as a does."""
    return jax.ShapeDtypeStruct(shape, a.dtype, manual_axis_type=jax.typeof(a).manual_axis_type)


def forward_kernel(gate_up: jax.Array, end: jax.Array, interpret: bool = False) -> jax.Array:
    """h [M, F] on the rows before end[0] (int32 [1]); unwritten after the last block holding such a row."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    num_rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    block_rows, grid, (gate_spec, up_spec), rows_spec, _, scalar_spec = _grid_and_specs(num_rows, cols)
    gate_up, end = _varying_together(gate_up, end)

    def kernel(end_ref, gate_ref, up_ref, h_ref):
        @pl.when(pl.program_id(0) * block_rows < end_ref[0])
        def _():
            h = _forward_math(gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32))
            h_ref[...] = h.astype(h_ref.dtype)

    pairs = gate_up.reshape(num_rows, 2, cols)
    return pl.pallas_call(
        kernel, out_shape=_like(gate_up, (num_rows, cols)), grid=grid,
        in_specs=[scalar_spec, gate_spec, up_spec], out_specs=rows_spec,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="jax_ep_silu_mul_in_groups")(end, pairs, pairs)


def backward_kernel(gate_up: jax.Array, dh: jax.Array, end: jax.Array, zero_rows: int,
                    interpret: bool = False) -> jax.Array:
    """d gate_up [M, 2F] on the rows before end[0], zero on the next zero_rows rows (and on the rest of their
    blocks), unwritten after them."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    num_rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    block_rows, grid, (gate_spec, up_spec), rows_spec, pair_spec, scalar_spec = _grid_and_specs(num_rows, cols)
    gate_up, dh, end = _varying_together(gate_up, dh, end)

    def kernel(end_ref, gate_ref, up_ref, dh_ref, d_ref):
        first_row = pl.program_id(0) * block_rows

        @pl.when(first_row < end_ref[0] + zero_rows)
        def _():
            d_gate, d_up = _backward_math(gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32),
                                          dh_ref[...].astype(jnp.float32))
            in_groups = (first_row + jax.lax.broadcasted_iota(jnp.int32, d_gate.shape, 0)) < end_ref[0]
            d_ref[:, 0, :] = jnp.where(in_groups, d_gate, 0).astype(d_ref.dtype)
            d_ref[:, 1, :] = jnp.where(in_groups, d_up, 0).astype(d_ref.dtype)

    pairs = gate_up.reshape(num_rows, 2, cols)
    d_pairs = pl.pallas_call(
        kernel, out_shape=_like(gate_up, (num_rows, 2, cols)), grid=grid,
        in_specs=[scalar_spec, gate_spec, up_spec, rows_spec], out_specs=pair_spec,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="jax_ep_silu_mul_in_groups_grad")(end, pairs, pairs, dh)
    return d_pairs.reshape(num_rows, 2 * cols)
