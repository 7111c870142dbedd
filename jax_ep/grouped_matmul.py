"""`grouped_matmul`: the per-expert matmul of a MoE block over rows sorted by expert, with its VJP.

    y = grouped_matmul(x, w, group_sizes)      # x [M, K], w [G, K, N], group_sizes int32 [G] -> y [M, N]

Rows 0 .. group_sizes[0]-1 of x belong to group 0, the next group_sizes[1] rows to group 1, and so on;
y[r] = x[r] @ w[g] for a row r of group g, accumulated in float32 and returned in x's dtype. Rows past
sum(group_sizes) get zeros (and a zero dx), and jax_ep's Pallas kernels spend no matmul work on them; with
`zero_past_groups=False` only the first `rows_read_past_groups()` of them, the rest unspecified, which jax_ep's
kernels leave unwritten.
Group sizes are clamped like `jax.lax.ragged_dot` treats them: a negative size counts as 0, and groups
are cut at row M (a group reaching past row M keeps only its rows before M; later groups are empty and
get a zero dw). The VJP: dx = grouped_matmul of dy with each w[g] transposed; dw[g] = x_g^T dy_g (zeros
for an empty group); group_sizes gets no cotangent. On the Pallas paths the cotangent's rows past
sum(group_sizes) must be finite: dw's kernels read a few of them with the last group and multiply them by 0.
Rows of x past sum(group_sizes) may hold anything (non-finite values too): no output depends on them.

Implementations (`implementation=`):

* "pallas": jax_ep's Pallas Mosaic GPU kernels (`_grouped_matmul_kernels`): tiles aligned to the groups,
  so that many groups cost little more than few. Hopper (sm_90) GPUs, bfloat16/float16.
* "jax_pallas": JAX's own Pallas Mosaic GPU kernels (`ragged_dot_mgpu.ragged_dot` for the forward pass
  and dx, `transposed_ragged_dot_mgpu.transposed_ragged_dot` for dw), kept for comparison. Their tiles
  lie on a fixed 128-row grid, and a tile that a group boundary crosses is computed once per group.
* "ragged_dot": `jax.lax.ragged_dot` / `ragged_dot_general` (any platform and dtype; XLA expands it into
  a dense dot per group on GPUs, which is slow with many groups).
* "auto" (default): "pallas" where it can run (`pallas_unsupported_reason` is None), else "ragged_dot".

Asking for "pallas" or "jax_pallas" where they cannot run raises ValueError saying why.

Block configurations: `BLOCK_CONFIG_TABLE` below, keyed by kernel family, operation (fwd, dx, dw) and
ranges of the problem's (M, K, N, G); `python -m jax_ep.bench grouped_matmul --sweep` prints rules for it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep._checks import is_int
from jax_ep._cotangents import typed_like

IMPLEMENTATIONS = ("auto", "pallas", "jax_pallas", "ragged_dot")
PALLAS_KERNELS = ("pallas", "jax_pallas")
OPS = ("fwd", "dx", "dw")
PALLAS_DTYPES = (jnp.bfloat16, jnp.float16)
# The "pallas" kernels load rows in blocks that start at multiples of this many rows (TMA copies into Mosaic GPU's
# 8-row tiled shared-memory layout), so a group starting elsewhere has its first tile and its first dw step begin
# on rows of the group before. jax_ep.flax.MoE lays its experts' groups out at multiples of it (the dispatch's
# expert_alignment).
GROUP_ROW_ALIGNMENT = 8


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The tiling of one Pallas grouped-matmul launch.

    block_m: output rows per tile (JAX's kernels; jax_ep's take 128: two warpgroups of 64 rows). For dw, the
      rows of dw[g] (K) per tile (jax_ep's: 128 or 256).
    block_n: output columns per tile.
    block_k: contracted elements per pipeline step (for dw: rows of x and dy).
    num_stages: pipeline depth, i.e. steps in flight (JAX's max_concurrent_steps).
    grid_tile_width: column blocks per stripe of the tile order (JAX's grid_block_n); wider stripes read
      lhs rows fewer times from HBM, narrower ones keep fewer weight columns in L2.
    clustered: (jax_ep's fwd and dx) tiles run in 2-CTA clusters, a group's tiles two by two, each pair loading
      every weight block once by TMA multicast (`ragged_rows_matmul`); for many experts, whose weights stream
      from HBM.
    fused_tails: (clustered, block_n a multiple of 256) a group's last tile of at most 64 rows, where its tiles are
      odd in number, is computed by the group's last pair in the same pass over the weights, each of the pair's
      four compute warpgroups on a quarter of the columns (`paired_row_tile_schedule(fuse_tails=True)`), instead
      of by a tile that reloads the group's weights on its own (from HBM, with many experts).
    """
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    grid_tile_width: int = 4
    clustered: bool = False
    fused_tails: bool = False


@dataclasses.dataclass(frozen=True)
class BlockConfigRule:
    """`config` applies to `op` ("fwd", "dx" or "dw") of `kernels` ("pallas" or "jax_pallas") for the
    grouped_matmul problems x [M, K], w [G, K, N] with each of M, K, N, G in its inclusive range. dx and dw
    are keyed by the forward problem's shape too."""
    kernels: str
    op: str
    m: tuple[int, int]
    k: tuple[int, int]
    n: tuple[int, int]
    groups: tuple[int, int]
    config: BlockConfig

    def matches(self, kernels: str, op: str, m: int, k: int, n: int, groups: int) -> bool:
        ranges = ((self.m, m), (self.k, k), (self.n, n), (self.groups, groups))
        return (self.kernels, self.op) == (kernels, op) and all(lo <= v <= hi for (lo, hi), v in ranges)


# Where no rule matches. 128x128x64 tiles, 4 stages: the best of a sweep of JAX's kernels on one H200 at
# M=24576, D=2048, F=1408. Stripes of 4 column blocks: with 1, the lhs would be read from HBM once per
# column block, more traffic than the matmul's time allows at these shapes.
DEFAULT_BLOCK_CONFIG = BlockConfig(block_m=128, block_n=128, block_k=64, num_stages=4, grid_tile_width=4)

# The tuned block configurations: the first rule that matches and fits the shape wins. Chosen on one H200
# (jax 0.11.2) at the MoE block's expert projections, M=24576 rows in 64 groups of random sizes, x @ [2048,
# 2816] (gate and up) and [1408, 2048] (down) weights, each kernel timed alone (docs/perf-log.md has the
# figures): 256-column tiles (a warpgroup's wgmma 64 x 256, half the shared-memory reads of the lhs per FLOP of
# two 128-column tiles) where they divide the output's columns, for fwd, dx and dw alike (dw's short tiles, a
# group's rows / block_k steps each, gain from fewer, larger tiles too). Where 256 columns do not divide: 256
# rows of dw[g], else deeper prefetch; fwd and dx 128 columns in wider stripes, dx with 5 stages. Three stages
# are fastest with 256-column tiles at these shapes (two are 15 % slower). Other shapes keep the default until measured.
# M in the rules spans the rows of jax_ep.flax.MoE's expert-major layout at EP1 to EP8 (its capacity, R * T * K rows
# plus the experts' padding, of which the groups fill about 1/R): rows past the groups cost the kernels no matmul
# work, so the rows the groups hold, not M, decide the tiles. (Before 2026-11-28 the ranges ended at the one-rank
# M, and the block at EP2 ran on the default tiles.)
_BLOCK_ROWS_RANGE = (16384, 1 << 21)
_MANY_GROUPS = dict(m=_BLOCK_ROWS_RANGE, groups=(32, 128))
_EXPERT_PROJECTIONS = dict(k=(1024, 4096), n=(1024, 4096), **_MANY_GROUPS)
# A DeepSeek-V3-like rank holding many experts (256 at D=7168, F=2048; M=32768): 256-column tiles for dw (a
# third faster than 128); fwd and dx in 2-CTA clusters on 256-column tiles (15-21 % faster than unclustered;
# the down projection's dx in stripes of 8, the rest of 16), as for V3's slices below (docs/perf-log.md).
_MANY_EXPERTS = dict(m=_BLOCK_ROWS_RANGE, groups=(129, 512), k=(1024, 8192), n=(1024, 8192))
# V3's slices per rank at EP2 and EP4 (128 and 64 experts at D=7168, F=2048; M=32768, routed group sizes; one
# H200, each kernel alone; docs/perf-log.md, 2026-11-28): the down projection (N=7168) on 256-column tiles; the
# gate and up projections' dw (K=7168) in stripes of 2 (15 %), the down projection's dw in stripes of 8. Their
# fwd and dx run in 2-CTA clusters on 256-column tiles (each weight block fetched once per pair of row tiles: 10-20 %
# faster than the best unclustered tiles at 64, 128 and 256 experts), in stripes of 16, the down projection's dx in
# stripes of 8 (2-3 % faster there). 32 experts (V3 at EP8) take 64's rules, measured there too: each the fastest
# of the sweep or within 3 % of it. (Their groups are _MANY_GROUPS'.)
# moe-a's slices at EP4 and EP8 (16 and 8 experts per rank, 1536 and 3072 rows each; M=24576, routed group sizes;
# one H200, each kernel alone; docs/perf-log.md, 2026-11-28, fourth session), where the default tiles ran: fwd and
# dx in 2-CTA clusters on 256-column tiles (the gate and up projection's fwd in stripes of 16, the rest of 8), dx
# with 128-column output tiles in stripes of 16 where 256 do not divide (5 stages: _DX_128_WHOLE_ROWS), dw on 256
# columns with 4 stages in stripes of 2: 1-19 % faster than the default tiles per kernel, 10-13 % over the six
# kernels of the SwiGLU.
_FEW_GROUPS = dict(m=_BLOCK_ROWS_RANGE, groups=(8, 31), k=(1024, 4096), n=(1024, 4096))
_WIDE_MODEL = (4097, 8192)  # D of V3-like models: the down projection's N, the gate and up projections' K
_PROJECTION = (1024, 4096)  # F and 2F of those models: the other dimension
# 256-column tiles in stripes of 8: dw; the forward of moe-a's down projection (15 % faster than in stripes of 16
# with routed group sizes).
_WIDE_STRIPES_8 = BlockConfig(block_n=256, num_stages=3, grid_tile_width=8)
_WIDE_ROWS = BlockConfig(block_n=256, num_stages=3, grid_tile_width=16)  # fwd and dx
_CLUSTERED_ROWS = dataclasses.replace(_WIDE_ROWS, clustered=True)
# dx on 128-column tiles where 256 do not divide (moe-a's down projection, F=1408: 11 column blocks), 5 stages in
# stripes of 16, i.e. a row tile's every column block in turn. With the SwiGLU's gradient fused (as the block runs
# it): 2-7 % faster than the earlier 5 stages in stripes of 8 (64 and 32 groups) and 4 in stripes of 16 (16 groups);
# plain dx 1 % slower to 5 % faster (one H200, routed sizes, each kernel alone; docs/perf-log.md, 2026-11-29).
_DX_128_WHOLE_ROWS = BlockConfig(num_stages=5, grid_tile_width=16)
_CLUSTERED_STRIPES_8 = dataclasses.replace(_WIDE_STRIPES_8, clustered=True)
# V3's slice at EP2 (128 experts of ~256 rows, about half with a last tile of 8-48 rows): fwd and dx with fused pair
# tails, 4-8 % faster per kernel (at 64 experts, 512 rows each, 3-6 % slower: docs/perf-log.md, 2026-11-29).
_FEW_ROWS_PER_GROUP = dict(m=_BLOCK_ROWS_RANGE, groups=(65, 128))
_FUSED_TAILS_ROWS = dataclasses.replace(_CLUSTERED_ROWS, fused_tails=True)
BLOCK_CONFIG_TABLE: tuple[BlockConfigRule, ...] = (
    BlockConfigRule("pallas", "dw", **_MANY_EXPERTS, config=_WIDE_STRIPES_8),
    BlockConfigRule("pallas", "dx", **{**_MANY_EXPERTS, "k": _PROJECTION, "n": _WIDE_MODEL},
                    config=_CLUSTERED_STRIPES_8),
    BlockConfigRule("pallas", "fwd", **_MANY_EXPERTS, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "dx", **_MANY_EXPERTS, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "fwd", **_FEW_ROWS_PER_GROUP, k=_WIDE_MODEL, n=_PROJECTION, config=_FUSED_TAILS_ROWS),
    BlockConfigRule("pallas", "fwd", **_FEW_ROWS_PER_GROUP, k=_PROJECTION, n=_WIDE_MODEL, config=_FUSED_TAILS_ROWS),
    BlockConfigRule("pallas", "dx", **_FEW_ROWS_PER_GROUP, k=_WIDE_MODEL, n=_PROJECTION, config=_FUSED_TAILS_ROWS),
    BlockConfigRule("pallas", "dx", **_FEW_ROWS_PER_GROUP, k=_PROJECTION, n=_WIDE_MODEL,
                    config=dataclasses.replace(_CLUSTERED_STRIPES_8, fused_tails=True)),
    BlockConfigRule("pallas", "dw", **_MANY_GROUPS, k=_WIDE_MODEL, n=_PROJECTION,
                    config=BlockConfig(block_n=256, num_stages=3, grid_tile_width=2)),
    BlockConfigRule("pallas", "dw", **_MANY_GROUPS, k=_PROJECTION, n=_WIDE_MODEL, config=_WIDE_STRIPES_8),
    BlockConfigRule("pallas", "dx", **_MANY_GROUPS, k=_PROJECTION, n=_WIDE_MODEL, config=_CLUSTERED_STRIPES_8),
    BlockConfigRule("pallas", "fwd", **_MANY_GROUPS, k=_PROJECTION, n=_WIDE_MODEL, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "fwd", **_MANY_GROUPS, k=_WIDE_MODEL, n=_PROJECTION, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "dx", **_MANY_GROUPS, k=_WIDE_MODEL, n=_PROJECTION, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "dw", **_EXPERT_PROJECTIONS, config=_WIDE_STRIPES_8),
    BlockConfigRule("pallas", "dw", **_EXPERT_PROJECTIONS,
                    config=BlockConfig(block_m=256, block_n=128, num_stages=3, grid_tile_width=8)),
    BlockConfigRule("pallas", "dw", **_EXPERT_PROJECTIONS,
                    config=BlockConfig(block_n=128, num_stages=6, grid_tile_width=1)),
    # moe-a's gate and up projection (K=2048 < N=2816): clustered, 7 % faster than unclustered; its down
    # projection (K=1408) was 20 % slower clustered, and keeps stripes of 8.
    BlockConfigRule("pallas", "fwd", **{**_EXPERT_PROJECTIONS, "k": (2048, 4096)}, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "fwd", **_EXPERT_PROJECTIONS, config=_WIDE_STRIPES_8),
    BlockConfigRule("pallas", "fwd", **_EXPERT_PROJECTIONS, config=BlockConfig(grid_tile_width=8)),
    BlockConfigRule("pallas", "dx", **_EXPERT_PROJECTIONS, config=_WIDE_ROWS),
    BlockConfigRule("pallas", "dx", **_EXPERT_PROJECTIONS, config=_DX_128_WHOLE_ROWS),
    BlockConfigRule("pallas", "fwd", **{**_FEW_GROUPS, "k": (2048, 4096)}, config=_CLUSTERED_ROWS),
    BlockConfigRule("pallas", "fwd", **_FEW_GROUPS, config=_CLUSTERED_STRIPES_8),
    BlockConfigRule("pallas", "dx", **_FEW_GROUPS, config=_CLUSTERED_STRIPES_8),
    BlockConfigRule("pallas", "dx", **_FEW_GROUPS, config=_DX_128_WHOLE_ROWS),
    BlockConfigRule("pallas", "dw", **_FEW_GROUPS, config=BlockConfig(block_n=256, num_stages=4, grid_tile_width=2)),
)


def rows_read_past_groups() -> int:
    """The most rows past a group's end that the dw kernels read of their rhs (and multiply by zero): block_k - 1
    of the table's largest block_k. A cotangent past sum(group_sizes) must be finite on that many rows."""
    return max(config.block_k for config in (DEFAULT_BLOCK_CONFIG, *(rule.config for rule in BLOCK_CONFIG_TABLE))) - 1


def block_config(kernels: str, op: str, m: int, k: int, n: int, groups: int) -> BlockConfig:
    """The block configuration of `op` for the grouped_matmul problem x [m, k], w [groups, k, n]: the first
    rule of BLOCK_CONFIG_TABLE that matches and whose tiles fit the shape, else DEFAULT_BLOCK_CONFIG."""
    for rule in BLOCK_CONFIG_TABLE:
        if rule.matches(kernels, op, m, k, n, groups) and not config_unsupported_reason(kernels, op, rule.config,
                                                                                         m, k, n):
            return rule.config
    return DEFAULT_BLOCK_CONFIG


# Keywords the JAX kernels are called with; their absence (a different JAX) makes "jax_pallas" unavailable.
_JAX_RAGGED_DOT_KEYWORDS = frozenset(
    {"group_sizes", "block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n", "transpose_rhs"})
_JAX_TRANSPOSED_RAGGED_DOT_KEYWORDS = _JAX_RAGGED_DOT_KEYWORDS - {"transpose_rhs"}


@functools.cache
def _pallas_modules() -> types.SimpleNamespace:
    """The Pallas kernel modules, imported on first use (so that `import jax_ep` never needs them), with
    the reason each family cannot be used here (None if it can)."""
    modules = types.SimpleNamespace(ours=None, jax_ragged_dot=None, jax_transposed_ragged_dot=None,
                                    reasons={})
    try:
        from jax_ep import _grouped_matmul_kernels
        modules.ours = _grouped_matmul_kernels
        modules.reasons["pallas"] = None
    except Exception as e:  # noqa: BLE001 (any failure to import an optional backend means "not here")
        modules.reasons["pallas"] = f"the Pallas Mosaic GPU API failed to import: {e!r}"
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
        missing = (_JAX_RAGGED_DOT_KEYWORDS - inspect.signature(ragged_dot_mgpu.ragged_dot).parameters.keys()
                   | _JAX_TRANSPOSED_RAGGED_DOT_KEYWORDS
                   - inspect.signature(transposed_ragged_dot_mgpu.transposed_ragged_dot).parameters.keys())
        if missing:
            modules.reasons["jax_pallas"] = (f"this JAX's Pallas ragged-dot kernels lack the keyword arguments "
                                             f"{sorted(missing)}")
        else:
            modules.jax_ragged_dot = ragged_dot_mgpu.ragged_dot
            modules.jax_transposed_ragged_dot = transposed_ragged_dot_mgpu.transposed_ragged_dot
            modules.reasons["jax_pallas"] = None
    except Exception as e:  # noqa: BLE001
        modules.reasons["jax_pallas"] = f"JAX's Pallas ragged-dot kernels failed to import: {e!r}"
    return modules


def _hopper_unsupported_reason() -> str | None:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"the default device is {device.platform}, not a CUDA GPU"
    capability = str(getattr(device, "compute_capability", "unknown"))
    if not capability.startswith("9."):
        return f"the GPU has compute capability {capability}; the kernels use Hopper's wgmma (9.x)"
    return None


def _op_shape(op: str, m: int, k: int, n: int) -> tuple[int, int, int]:
    """(output rows, output columns, contracted size) of one op of the problem x [m, k], w [G, k, n]; for
    dw the output rows are those of one dw[g] and the contracted size is m."""
    return {"fwd": (m, n, k), "dx": (m, k, n), "dw": (k, n, m)}[op]


def config_unsupported_reason(kernels: str, op: str, config: BlockConfig, m: int, k: int, n: int) -> str | None:
    """Why `config` does not fit `op` of the problem x [m, k], w [G, k, n] on `kernels`, or None. (Shared
    memory is not checked: a config that overflows it fails when the kernel is lowered.)"""
    rows, cols, contracted = _op_shape(op, m, k, n)
    divisors = [("output columns", cols, config.block_n)]
    if op == "dw":
        divisors.append(("rows of dw[g]", rows, config.block_m))
    else:
        divisors.append(("contracted size", contracted, config.block_k))
    for what, size, block in divisors:
        if size % block:
            return f"{op}: {what} {size} is not a multiple of the block size {block} ({config})"
    # jax_ep's kernels load at least 128 rows of lhs (dw: its rows are contracted, any block_m takes 128).
    min_rows = 128 if op == "dw" else config.block_m
    if m < min_rows:
        return f"{op}: M={m} is below the {min_rows} rows the kernels load at least"
    if config.clustered and (kernels != "pallas" or op == "dw"):
        return f"{op}: only jax_ep's fwd and dx kernels run clustered, not {kernels}'s {op} ({config})"
    if config.fused_tails and (not config.clustered or config.block_n % 256):
        return f"{op}: fused tails need clustered tiles of a multiple of 256 columns ({config})"
    block_m_choices = (128, 256) if op == "dw" else (128,)
    if kernels == "pallas" and (config.block_m not in block_m_choices or config.block_n % 64
                                or config.block_k % 64 or config.block_n > 256):
        return (f"{op}: jax_ep's kernels take block_m in {block_m_choices}, block_n a multiple of 64 up to 256 "
                f"and block_k a multiple of 64, not {config}")
    return None


def pallas_unsupported_reason(x_shape, w_shape, dtype, kernels: str = "pallas") -> str | None:
    """Why the Pallas `kernels` ("pallas" or "jax_pallas") cannot compute grouped_matmul for x of x_shape
    [M, K] and w of w_shape [G, K, N] in `dtype` (forward and both gradients) on the default device, or
    None if they can."""
    reason = _pallas_modules().reasons[kernels] or _hopper_unsupported_reason()
    if reason:
        return reason
    if jnp.dtype(dtype) not in PALLAS_DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float16"
    (m, k), (groups, _, n) = x_shape, w_shape
    for op in OPS:
        config = block_config(kernels, op, m, k, n, groups)
        if reason := config_unsupported_reason(kernels, op, config, m, k, n):
            return reason
    return None


def fuses_gate_up_activation(implementation: str, m: int, k: int, n: int, groups: int) -> bool:
    """Whether the forward of x [m, k] @ w [groups, k, n] (n = 2F: a gate's F columns, then an up's) can also
    apply an elementwise gate and up activation in its epilogue (`pallas_grouped_op(gate_up_activation=)`): on
    jax_ep's kernels, where the table's tiles are 256 columns (a warpgroup then holds 128 of the gate's columns and
    the up's same ones) without pair tails."""
    if implementation != "pallas" or _pallas_modules().ours is None:
        return False
    config = block_config(implementation, "fwd", m, k, n, groups)  # (a config the table gives fits the shape)
    return config.block_n == 2 * _pallas_modules().ours.GATE_UP_HALF_COLS and not config.fused_tails


def fuses_gate_up_activation_grad(implementation: str, m: int, k: int, n: int, groups: int) -> bool:
    """Whether dx of x [m, k] @ w [groups, k, n], where x = h is an activation of gate_up [m, 2k]'s halves (an
    expert SwiGLU's down projection), can also apply the activation's gradient in its epilogue and return the
    cotangent of gate_up (`pallas_grouped_op(gate_up_activation_grad=)`): on jax_ep's kernels, where the table's dx
    tiles are 128 columns without pair tails and fit beside the gate and up blocks in shared memory."""
    if implementation != "pallas" or _pallas_modules().ours is None:
        return False
    config = block_config(implementation, "dx", m, k, n, groups)
    return (config_unsupported_reason(implementation, "dx", config, m, k, n) is None
            and _pallas_modules().ours.activation_grad_unsupported_reason(
                config.block_n, config.block_k, config.num_stages, jnp.bfloat16, config.fused_tails) is None)


def _num_sms(budget: int | None = None) -> int:
    """CTAs of a persistent kernel: one per SM of the device, or `budget` of them where it is lower."""
    device_sms = jax.devices()[0].core_count
    return device_sms if budget is None else min(budget, device_sms)


def pallas_grouped_op(op: str, kernels: str, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                      config: BlockConfig, num_sms: int | None = None, zero_rows_end: jax.Array | None = None,
                      **epilogue):
    """One grouped product on the Pallas `kernels`, with `config`, for group_sizes already clamped
    (non-negative, summing to at most M):

    * "fwd": lhs x [M, K], rhs w [G, K, N] -> [M, N]
    * "dx":  lhs dy [M, N], rhs w [G, K, N] -> [M, K] (dy_g @ w[g]^T)
    * "dw":  lhs x [M, K], rhs dy [M, N] -> [G, K, N] (x_g^T @ dy_g)

    Rows past sum(group_sizes) of the fwd and dx outputs are zero: all of them, or where `zero_rows_end` (int32 [],
    from `zeroed_rows_end`) is given, those before it, the rows after it unspecified (jax_ep's kernels leave them
    unwritten; JAX's zero them all). `num_sms`: the SM budget of jax_ep's kernels (grouped_matmul's). The
    benchmark's sweep calls this. `epilogue`: keywords of jax_ep's rows kernel (`ragged_rows_matmul`) for fwd and
    dx on "pallas": gate_up_activation (fwd, where `fuses_gate_up_activation` says so) gives (out,
    gate_up_activation(gate, up)) from one kernel; gate_up_activation_grad with gate_up [M, 2K] (dx, where
    `fuses_gate_up_activation_grad` says so) gives the cotangent of gate_up for dx's result dh."""
    if epilogue and (kernels != "pallas" or op == "dw"):
        raise ValueError(f"{sorted(epilogue)}: jax_ep's rows kernel only (fwd and dx on \"pallas\"), not {kernels}'s "
                         f"{op}")
    if zero_rows_end is not None and op == "dw":
        raise ValueError("zero_rows_end: fwd and dx only (dw has no rows past the groups)")
    modules = _pallas_modules()
    num_rows = lhs.shape[0]
    if num_rows % GROUP_ROW_ALIGNMENT:
        # Mosaic GPU (under jax_ep's kernels and JAX's) describes a TMA copy's global array in its 8-row tiles, so it
        # refuses a row count that is not a multiple of 8: the rows go in zero-padded to one (past the groups, so
        # nothing reads them into a result) and the row outputs come back cut to M, at the cost of a copy of the row
        # operands.
        def padded(a):
            return jnp.pad(a, [(0, -num_rows % GROUP_ROW_ALIGNMENT)] + [(0, 0)] * (a.ndim - 1))

        epilogue = {name: padded(value) if isinstance(value, jax.Array) and value.ndim and value.shape[0] == num_rows
                    else value for name, value in epilogue.items()}
        out = pallas_grouped_op(op, kernels, padded(lhs), padded(rhs) if op == "dw" else rhs, group_sizes, config,
                                num_sms, zero_rows_end, **epilogue)
        return out if op == "dw" else jax.tree.map(lambda a: a[:num_rows], out)
    if kernels == "pallas":
        sms = _num_sms(num_sms)
        # 2-CTA clusters take an even number of SMs within the budget; a budget of one SM runs unclustered.
        clustered = config.clustered and sms >= 2
        kernel_args = dict(block_n=config.block_n, block_k=config.block_k, num_stages=config.num_stages,
                           grid_tile_width=config.grid_tile_width, num_sms=sms - sms % 2 if clustered else sms)
        if op == "dw":
            return modules.ours.ragged_contraction_matmul(lhs, rhs, group_sizes, block_rows=config.block_m,
                                                          **kernel_args)
        schedule = (modules.ours.paired_row_tile_schedule(group_sizes, lhs.shape[0], fuse_tails=config.fused_tails,
                                                          zero_rows_end=zero_rows_end) if clustered else
                    modules.ours.row_tile_schedule(group_sizes, lhs.shape[0], zero_rows_end=zero_rows_end))
        return modules.ours.ragged_rows_matmul(lhs, rhs, *schedule, transpose_rhs=op == "dx", clustered=clustered,
                                               **epilogue, **kernel_args)
    kernel_args = dict(group_sizes=group_sizes, block_m=config.block_m, block_n=config.block_n,
                       block_k=config.block_k, max_concurrent_steps=config.num_stages,
                       grid_block_n=config.grid_tile_width)
    if op == "dw":
        return modules.jax_transposed_ragged_dot(lhs, rhs, **kernel_args)
    out = modules.jax_ragged_dot(lhs, rhs, transpose_rhs=op == "dx", **kernel_args)
    # JAX's kernel leaves the rows past the last group unwritten.
    row_in_a_group = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(row_in_a_group[:, None], out, jnp.zeros((), out.dtype))


def zeroed_rows_end(group_sizes: jax.Array, num_rows: int, zero_past_groups: bool) -> jax.Array | None:
    """Where a grouped product's rows past the groups stop being zeroed (`pallas_grouped_op`'s zero_rows_end): None
    (all of them) with zero_past_groups, else rows_read_past_groups() rows past the groups' end (groups_end), the
    rows that the dw kernels read of a cotangent and multiply by zero, so that an output that becomes one
    stays finite there. group_sizes as grouped_matmul clamps them."""
    return None if zero_past_groups else groups_end(group_sizes, num_rows) + rows_read_past_groups()


def clamp_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Negative sizes to 0, and groups cut at row num_rows."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), num_rows)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def groups_end(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """int32 []: the row where the groups of an [num_rows, ...] operand end, their sizes clamped as grouped_matmul
    clamps them (negative sizes 0, groups cut at row num_rows)."""
    return jnp.minimum(jnp.sum(jnp.maximum(group_sizes, 0)), num_rows).astype(jnp.int32)


def _rows_in_groups(a, group_sizes):
    """a [M, ...] with its rows past the groups' end (groups_end) zeroed."""
    end = groups_end(group_sizes, a.shape[0])
    return jnp.where((jnp.arange(a.shape[0]) < end).reshape(-1, *(1,) * (a.ndim - 1)), a, jnp.zeros((), a.dtype))


_DX_DIMENSIONS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_DW_DIMENSIONS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def grouped_op(op: str, implementation: str, lhs, rhs, group_sizes, problem_shape,
               num_sms: int | None = None, zero_rows_end: jax.Array | None = None) -> jax.Array:
    """`op` of `pallas_grouped_op` ("fwd", "dx" or "dw"; its operands and zero_rows_end) on `implementation`
    ("pallas", "jax_pallas" or "ragged_dot", which zeroes every row past the groups), with the table's
    configuration for the forward problem_shape (M, K, N, G); group_sizes already clamped. The pieces of
    grouped_matmul's forward and VJP; `bench grouped_matmul --ops` times each alone."""
    if implementation == "ragged_dot":
        # XLA may expand ragged_dot into masked dense products, where a non-finite row past the groups (the cuda
        # expert-major dispatch leaves those rows unwritten) would reach the result as 0 * inf: zeroed first.
        lhs = _rows_in_groups(lhs, group_sizes)
        if op == "fwd":
            out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        else:
            dimensions = _DX_DIMENSIONS if op == "dx" else _DW_DIMENSIONS
            if op == "dw":
                rhs = _rows_in_groups(rhs, group_sizes)
            out = lax.ragged_dot_general(lhs, rhs, group_sizes, dimensions, preferred_element_type=jnp.float32)
        return out.astype(lhs.dtype)
    return pallas_grouped_op(op, implementation, lhs, rhs, group_sizes,
                             block_config(implementation, op, *problem_shape), num_sms, zero_rows_end)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_matmul(x, w, group_sizes, implementation, num_sms, zero_past_groups):
    y = grouped_op("fwd", implementation, x, w, group_sizes, problem_shape(x, w), num_sms,
                   zeroed_rows_end(group_sizes, x.shape[0], zero_past_groups))
    return typed_like(y, x, w, group_sizes)


def _grouped_matmul_fwd(x, w, group_sizes, implementation, num_sms, zero_past_groups):
    return _grouped_matmul(x, w, group_sizes, implementation, num_sms, zero_past_groups), (x, w, group_sizes)


def grouped_matmul_pullback(x, w, group_sizes, dy, implementation: str, num_sms: int | None = None,
                            zero_past_groups: bool = True):
    """(dx, dw): the VJP of grouped_matmul(x, w, group_sizes, zero_past_groups=...) at cotangent dy, on
    `implementation` (resolved), for group_sizes already clamped (clamp_group_sizes); each typed like its primal
    inside shard_map."""
    shape = problem_shape(x, w)
    dx = grouped_op("dx", implementation, dy, w, group_sizes, shape, num_sms,
                    zeroed_rows_end(group_sizes, x.shape[0], zero_past_groups))
    dw = grouped_op("dw", implementation, x, dy, group_sizes, shape, num_sms)
    return typed_like(dx, x), typed_like(dw, w)


def _grouped_matmul_bwd(implementation, num_sms, zero_past_groups, residuals, dy):
    x, w, group_sizes = residuals
    return (*grouped_matmul_pullback(x, w, group_sizes, dy, implementation, num_sms, zero_past_groups),
            None)  # group_sizes is integer-valued: no cotangent


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def problem_shape(x, w) -> tuple[int, int, int, int]:
    """(M, K, N, G) of the grouped_matmul problem x [M, K], w [G, K, N]: what `block_config` is keyed by."""
    (m, k), (groups, _, n) = x.shape, w.shape
    return m, k, n, groups


def check_grouped_matmul_args(x, w, group_sizes, implementation: str, num_sms=None):
    """ValueError or TypeError, naming the argument, where grouped_matmul(x, w, group_sizes, ...) cannot take it."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"jax_ep.grouped_matmul: implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if num_sms is not None and not (is_int(num_sms) and num_sms >= 1):
        raise ValueError(f"jax_ep.grouped_matmul: num_sms must be a positive integer or None, got {num_sms!r}")
    if x.ndim != 2:
        raise ValueError(f"jax_ep.grouped_matmul: x must be 2-D [M, K], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jax_ep.grouped_matmul: x must have a floating dtype, got {x.dtype}")
    if w.ndim != 3:
        raise ValueError(f"jax_ep.grouped_matmul: w must be 3-D [G, K, N], got shape {w.shape}")
    if w.dtype != x.dtype:
        raise TypeError(f"jax_ep.grouped_matmul: w must have x's dtype {x.dtype}, got {w.dtype}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"jax_ep.grouped_matmul: w's K (shape {w.shape}, axis 1) must equal x's K "
                         f"(shape {x.shape}, axis 1)")
    if w.shape[0] < 1:
        raise ValueError(f"jax_ep.grouped_matmul: w must have at least one group, got shape {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"jax_ep.grouped_matmul: group_sizes must have shape (G,) = ({w.shape[0]},), "
                         f"got {group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"jax_ep.grouped_matmul: group_sizes must be int32, got {group_sizes.dtype}")


def resolve_implementation(x, w, implementation: str = "auto") -> str:
    """The implementation grouped_matmul(x, w, ..., implementation=implementation) runs: "auto" resolved,
    and "pallas"/"jax_pallas" checked (ValueError if they cannot run here)."""
    if implementation == "ragged_dot":
        return implementation
    kernels = "pallas" if implementation == "auto" else implementation
    reason = pallas_unsupported_reason(x.shape, w.shape, x.dtype, kernels)
    if reason is None:
        return kernels
    if implementation == "auto":
        return "ragged_dot"
    raise ValueError(f"jax_ep.grouped_matmul: implementation={implementation!r} cannot run here: {reason}")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str = "auto",
                   num_sms: int | None = None, zero_past_groups: bool = True) -> jax.Array:
    """y[r] = x[r] @ w[g] for each row r of group g; zeros past sum(group_sizes). See the module docstring.

    Args:
      x: [M, K], a floating dtype (bfloat16 or float16 for the Pallas kernels).
      w: [G, K, N], x's dtype.
      group_sizes: int32 [G], the rows of each group, in order from row 0.
      implementation: "auto", "pallas", "jax_pallas" or "ragged_dot".
      num_sms: the SMs jax_ep's persistent kernels ("pallas") may occupy, forward and backward (None: every SM
        of the device; more than the device has: every SM). Fewer leave SMs to a kernel running at the same
        time on another stream, such as a dispatch or combine. The other implementations have no SM budget
        and run as they would without it.
      zero_past_groups: False: the rows of y and of the gradient of x past sum(group_sizes) are zero on the first
        `rows_read_past_groups()` of them (so that either can be a cotangent of another grouped_matmul) and
        unspecified after them, where jax_ep's kernels leave them unwritten: their stores then follow the rows
        the groups hold, not M. For a caller that reads only its groups' rows (the MoE block, whose
        expert-major capacity is by default about R times the rows its groups fill).

    Returns:
      [M, N] in x's dtype (float32 accumulation). Differentiable in x and w.
    """
    check_grouped_matmul_args(x, w, group_sizes, implementation, num_sms)
    chosen = resolve_implementation(x, w, implementation)
    return _grouped_matmul(x, w, clamp_group_sizes(group_sizes, x.shape[0]), chosen,
                           None if num_sms is None else int(num_sms), bool(zero_past_groups))
