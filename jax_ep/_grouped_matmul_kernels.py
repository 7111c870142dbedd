"""jax_ep's Pallas Mosaic GPU kernels for `grouped_matmul` on Hopper (sm_90).

Two warp-specialized, persistent kernels (one CTA per SM, three warpgroups: two compute, one issuing TMA
loads), one per kind of grouped product:

* `ragged_rows_matmul`: out[r] = lhs[r] @ B_g for every row r of group g (the forward pass, and dx with the
  weights transposed). Output tiles are 128 rows x `block_n` columns, but unlike a fixed grid of 128-row
  tiles they start at their group's first row (rounded down to a multiple of 8, see ROW_ALIGNMENT), so no
  tile holds rows of two groups beyond those 7 and none is computed twice. The two compute warpgroups own
  64 rows each; in a group's last tile a warpgroup whose 64 rows are all past the group's end skips its
  matmuls, so a tail of at most 64 rows costs half a tile. Tiles past the last group write the zero rows
  (up to the schedule's zero_rows_end), and the tile count follows the group sizes: rows past sum(group_sizes)
  cost no matmul work. The tile
  schedule is a small int32 table computed on the device from group_sizes (`row_tile_schedule`).
* `ragged_contraction_matmul`: out[g] = lhs[rows of g]^T @ rhs[rows of g] (dw). Output tiles are
  (group, 128 or 256 rows of K, `block_n` columns); each sums over its group's rows in steps of `block_k` rows,
  from the group's first row (rounded down to a multiple of 8), so only a group's first and last steps hold
  rows of other groups: those rows of the lhs block are zeroed in shared memory before the matmul.

With `clustered=True` the rows kernel runs in 2-CTA clusters over `paired_row_tile_schedule`'s pairs of tiles: the
two tiles of one group share each weight block, which the two CTAs load half each and multicast to both. With
many experts the weights stream from HBM, and one SM's loads of them run at a bounded rate (2026-11-28, H100 and
H200: the weight traffic moved per second grew with the number of tiles reading distinct weight blocks at once,
not with the pipeline's depth); sharing the loads of a block between two SMs is meant to double that rate. With
pair tails (`paired_row_tile_schedule(fuse_tails=True)`) a group's short odd last tile is computed by its last
pair from the weight blocks that pair loads anyway, instead of by a tile that streams them from HBM again. With
`gate_up_activation` the rows kernel also applies an elementwise activation to a gate's and an up's columns (an
expert SwiGLU's first matmul) and stores its result beside them (in 64-column pieces: the gate's, the up's and the
result's halves), saving the pass that would read them back. With `gate_up_activation_grad` (dx of the down
projection that consumes that activation) it applies the activation's gradient to its dh and the tile's gate and up
blocks (loaded by TMA at the tile's start) and stores the cotangent of gate_up instead of dh. A kernel with either
is compiled with Mosaic GPU's approximate transcendentals (`approx_math`), which only the activation uses.

Shapes the kernels take: lhs/rhs in bfloat16 or float16 (one dtype), float32 accumulation; the contracted
dimension a multiple of `block_k` (rows kernel), output columns a multiple of `block_n`, K a multiple of
`block_rows` (contraction kernel), at least 128 rows. `grouped_matmul` checks these before it picks these kernels.

Loads may run past the end of lhs/rhs (a tile's 128 rows from its group's start, a group's last `block_k`
rows): TMA fills rows outside the array with zeros, and rows inside it that belong to another group never
reach an output row (rows kernel) or are zeroed first (contraction kernel).

Both kernels run one pipeline per SM over all of its tiles (`_run_pipeline`): the memory warpgroup loads the
next tile's first steps while the compute warpgroups finish the current one and store it (in pieces, through two
shared-memory buffers where a tile has an even count of pieces and they fit, one piece being written while the
one before is stored; see STORE_COLS). A stage is released only after its wgmma
has completed (wgmma_wait(0)): with two compute warpgroups one keeps the tensor cores busy while the other
waits, and no stage is reloaded while a matmul may still read it.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# A wgmma instruction computes 64 rows; each compute warpgroup owns one such slab of an output tile.
ROWS_PER_WARPGROUP = 64
NUM_COMPUTE_WARPGROUPS = 2
BLOCK_ROWS = ROWS_PER_WARPGROUP * NUM_COMPUTE_WARPGROUPS
# Mosaic GPU loads a block into the tiled (8-row) shared memory layout wgmma reads with TMA copies whose
# first row must be a multiple of 8, so tiles and contraction steps start at multiples of 8 rows. (Callers see it
# as jax_ep.grouped_matmul.GROUP_ROW_ALIGNMENT: that module imports this one when first used, and jax_ep has no
# import cycles, so this one cannot import it; a test checks they agree.)
ROW_ALIGNMENT = 8
# A warpgroup stores its part of an output tile through shared memory in pieces of 64 rows x
# gcd(block_n, STORE_COLS) columns, in two buffers where a tile has an even count of pieces and they fit beside
# the stages (one piece is written while the one before is stored), else in one: pieces start the stores earlier
# than a whole-tile buffer, and two let the next piece's writes overlap the store (faster on an H200 at the MoE
# block's gate and up projection; docs/perf-log.md).
STORE_COLS = 128
# Shared memory a CTA may use on sm_90 (227 KiB), less 1 KiB for the barriers and Mosaic GPU's own.
SMEM_BYTES = 227 * 1024 - 1024
# The warpgroup issuing TMA loads needs few registers; the rest go to the two accumulating warpgroups.
MEMORY_WARPGROUP_REGISTERS = 40
# The register file holds 512 registers per thread of one warpgroup; the compute warpgroups share what the memory
# warpgroup leaves, in multiples of 8 (as JAX's warp-specialized pipeline splits them).
COMPUTE_WARPGROUP_REGISTERS = (512 - MEMORY_WARPGROUP_REGISTERS) // NUM_COMPUTE_WARPGROUPS // 8 * 8
_WARPGROUP_AXIS = "wg"
_SM_AXIS = "sm"  # the persistent grid's axis: SMs, or SM pairs with clustered=True
_CLUSTER_AXIS = "cluster"  # the CTA of a 2-CTA cluster (rows kernel, clustered=True)
CLUSTER_SIZE = 2
_FILL_TILE = -1  # tile_group value of a tile that writes zero rows
# With gate_up_activation, an output column block is this many of the gate's columns and the up's same ones.
GATE_UP_HALF_COLS = 128


def _zero_rows_range_end(group_ends, num_rows: int, zero_rows_end):
    """Where the zero tiles' rows end: zero_rows_end (int32 []) clamped to [the groups' end, num_rows], or num_rows
    where it is None."""
    if zero_rows_end is None:
        return jnp.asarray(num_rows, group_ends.dtype)
    return jnp.clip(jnp.asarray(zero_rows_end, group_ends.dtype), group_ends[-1], num_rows)


def row_tile_schedule(group_sizes: jax.Array, num_rows: int,
                      zero_rows_end: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tiles of `ragged_rows_matmul` for `group_sizes` (non-negative, summing to at most num_rows).

    Returns three int32 vectors of one static length (an upper bound on the number of tiles for any sizes
    of this many groups): tile_group (the group whose weights the tile uses, or -1 for a tile that writes
    zero rows past the last group), tile_first_row and tile_end_row (the rows [first, end) the tile writes;
    first == end for unused entries at the end). Group tiles come first, in group order. A tile covers the
    BLOCK_ROWS rows from its first row rounded down to a multiple of 8 (TMA loads into the tiled shared
    memory layout start at multiples of 8 rows), so a group's first tile may read up to 7 rows of the
    previous group, which it does not write. Zero tiles cover [sum(group_sizes), zero_rows_end) (num_rows where
    it is None): the rows after it are left unwritten, so that a kernel's stores past the groups need not follow
    num_rows (the expert-major capacity, which is by default about R times the rows the groups fill)."""
    num_groups = group_sizes.shape[0]
    # Each group adds at most one partial tile, plus 7 rows of alignment; so does the zero-row range.
    max_tiles = (num_rows + (num_groups + 1) * (BLOCK_ROWS - 1 + ROW_ALIGNMENT - 1)) // BLOCK_ROWS
    group_ends = jnp.cumsum(group_sizes)
    # The zero rows past the last group are one more "group" here, whose tiles get group -1.
    range_ends = jnp.append(group_ends, _zero_rows_range_end(group_ends, num_rows, zero_rows_end))
    range_starts = jnp.append(group_ends - group_sizes, group_ends[-1])
    aligned_starts = range_starts - range_starts % ROW_ALIGNMENT
    tiles_per_range = jnp.where(range_ends > range_starts,
                                (range_ends - aligned_starts + BLOCK_ROWS - 1) // BLOCK_ROWS, 0)
    range_tile_ends = jnp.cumsum(tiles_per_range)
    tile = jnp.arange(max_tiles, dtype=jnp.int32)
    # The range of tile t is the first whose tiles end after t; num_groups + 1 marks an unused entry.
    # compare_all: one fused comparison of the few hundred tiles with the G + 1 range ends. The default binary
    # search is an XLA while loop, whose condition the GPU hands back to the host at every step.
    tile_range = jnp.searchsorted(range_tile_ends, tile, side="right", method="compare_all")
    r = jnp.minimum(tile_range, num_groups)
    tile_start = aligned_starts[r] + (tile - (range_tile_ends[r] - tiles_per_range[r])) * BLOCK_ROWS
    first_row = jnp.maximum(tile_start, range_starts[r])
    end_row = jnp.where(tile_range <= num_groups, jnp.minimum(tile_start + BLOCK_ROWS, range_ends[r]), first_row)
    tile_group = jnp.where(r < num_groups, r, _FILL_TILE)
    return tile_group.astype(jnp.int32), first_row.astype(jnp.int32), end_row.astype(jnp.int32)


def paired_row_tile_schedule(group_sizes: jax.Array, num_rows: int, fuse_tails: bool = False,
                             zero_rows_end: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """`row_tile_schedule`'s tiles, in pairs for `ragged_rows_matmul(clustered=True)` (tiles 2p and 2p + 1 run
    in one 2-CTA cluster): each group's tiles two at a time in order (one weight block per pair, multicast), then,
    where a group has an odd number of tiles, its last tile beside the next such group's last tile (each loading
    its own weights; that pair comes right after the first group's pairs, so both tiles run near the other tiles
    of their groups, whose weight blocks are then in L2). The zero-row tiles past the groups (up to
    zero_rows_end, as there) pair up the same way. Same three int32 vectors, of an even static length; unused
    entries (first == end, group -1) fill the end and the place of a last lone tile's missing partner.

    fuse_tails: a group whose tiles are odd in number (3 or more) and whose last tile holds at most
    ROWS_PER_WARPGROUP rows has no lone tile: its last pair computes those rows too, in the same pass over the
    weights (`ragged_rows_matmul`'s pair tails). Two int32 vectors more, one entry per pair: pair_tail_first and
    pair_tail_end, the rows [first, end) of that tail (first a multiple of ROW_ALIGNMENT; first == end where a
    pair has none). Without it a lone tile reloads its group's weights apart from the pair that loaded them, and
    with many experts (a few tiles each) they come from HBM a second time."""
    num_groups = group_sizes.shape[0]
    max_tiles = (num_rows + (num_groups + 1) * (BLOCK_ROWS - 1 + ROW_ALIGNMENT - 1)) // BLOCK_ROWS
    max_pairs = (max_tiles + 1) // 2 + 1
    group_ends = jnp.cumsum(group_sizes)
    # As in row_tile_schedule, the zero rows past the last group are one more range, whose tiles get group -1.
    range_ends = jnp.append(group_ends, _zero_rows_range_end(group_ends, num_rows, zero_rows_end))
    range_starts = jnp.append(group_ends - group_sizes, group_ends[-1])
    aligned_starts = range_starts - range_starts % ROW_ALIGNMENT
    all_tiles = jnp.where(range_ends > range_starts, (range_ends - aligned_starts + BLOCK_ROWS - 1) // BLOCK_ROWS, 0)
    # The groups whose last tile becomes their last pair's tail (not the zero rows' range, which has no weights).
    fused = (jnp.arange(num_groups + 1) < num_groups) & (all_tiles >= 3) & (all_tiles % 2 == 1) & (
        range_ends - aligned_starts - (all_tiles - 1) * BLOCK_ROWS <= ROWS_PER_WARPGROUP) & fuse_tails
    tiles = all_tiles - fused  # the tiles run as tiles: in pairs, or lone
    full_pairs, lone = tiles // 2, tiles % 2
    lone_through = jnp.cumsum(lone)  # lone tiles of ranges 0..r
    lone_before = lone_through - lone
    leads_a_lone_pair = lone * (lone_before % 2 == 0)
    pairs = full_pairs + leads_a_lone_pair  # the pairs placed at range r
    pair_ends = jnp.cumsum(pairs)
    pair = jnp.arange(max_pairs, dtype=jnp.int32)
    # compare_all: one fused comparison, not XLA's while loop (see row_tile_schedule).
    r = jnp.minimum(jnp.searchsorted(pair_ends, pair, side="right", method="compare_all"), num_groups)
    used = pair < pair_ends[-1]
    j = pair - (pair_ends[r] - pairs[r])
    full = j < full_pairs[r]
    # The range holding the next lone tile after r's.
    partner = jnp.minimum(jnp.searchsorted(lone_through, lone_before[r] + 2, side="left", method="compare_all"),
                          num_groups)
    second_used = used & (full | (lone_through[-1] >= lone_before[r] + 2))

    def tile(range_index, tile_index, valid):
        start = aligned_starts[range_index] + tile_index * BLOCK_ROWS
        first = jnp.where(valid, jnp.maximum(start, range_starts[range_index]), 0)
        end = jnp.where(valid, jnp.minimum(start + BLOCK_ROWS, range_ends[range_index]), 0)
        group = jnp.where(valid & (range_index < num_groups), range_index, _FILL_TILE)
        return group, first, end

    first_tiles = tile(r, jnp.where(full, 2 * j, tiles[r] - 1), used)
    second_tiles = tile(jnp.where(full, r, partner), jnp.where(full, 2 * j + 1, tiles[partner] - 1), second_used)
    schedule = tuple(jnp.stack([a, b], axis=1).reshape(-1).astype(jnp.int32)
                     for a, b in zip(first_tiles, second_tiles))
    if not fuse_tails:
        return schedule
    has_tail = used & full & fused[r] & (j == full_pairs[r] - 1)
    tail_first = jnp.where(has_tail, aligned_starts[r] + tiles[r] * BLOCK_ROWS, 0).astype(jnp.int32)
    return (*schedule, tail_first, jnp.where(has_tail, range_ends[r], 0).astype(jnp.int32))


def _operand_transforms(block_minor: int, dtype) -> tuple:
    """The shared-memory tiling and swizzle wgmma reads an operand block with, from its minor dimension."""
    swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle)


def _check_operands(lhs, rhs, block_n: int, block_k: int, num_stages: int):
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"operands must both be bfloat16 or float16, got {lhs.dtype} and {rhs.dtype}")
    if lhs.shape[0] < BLOCK_ROWS:
        raise ValueError(f"lhs needs at least {BLOCK_ROWS} rows, got {lhs.shape[0]}")
    if block_n % 64 or block_k % 64 or not 64 <= block_n <= 256:
        raise ValueError(f"block_n must be 64, 128, 192 or 256 and block_k a multiple of 64, got {block_n}, "
                         f"{block_k}")
    if num_stages < 2:
        raise ValueError(f"num_stages must be at least 2, got {num_stages}")


def _striped_order(index, num_row_blocks: int, num_col_blocks: int, stripe_width: int):
    """The (row block, column block) of the index-th work item of a persistent kernel.

    Column blocks are taken stripe_width at a time; within a stripe the column blocks of one row block are
    consecutive (the SMs working at the same time read the same rows) and row blocks run forwards in even
    stripes and backwards in odd ones (a stripe starts on the rows the previous one read last, still in L2).
    A narrower last stripe takes the column blocks left over; its arithmetic is only emitted when there is
    one, so no division by zero is ever traced."""
    num_full_stripes = num_col_blocks // stripe_width
    full_stripes_work = num_full_stripes * stripe_width * num_row_blocks

    def position_in_stripe(offset, stripe, width):
        row_block = offset // width
        row_block = jnp.where(stripe % 2 == 0, row_block, num_row_blocks - 1 - row_block)
        return row_block, stripe * stripe_width + offset % width

    stripe = index // (stripe_width * num_row_blocks)
    row_block, col_block = position_in_stripe(index - stripe * stripe_width * num_row_blocks, stripe, stripe_width)
    last_width = num_col_blocks % stripe_width
    if last_width:
        last_row_block, last_col_block = position_in_stripe(index - full_stripes_work, num_full_stripes, last_width)
        in_last_stripe = index >= full_stripes_work
        row_block = jnp.where(in_last_stripe, last_row_block, row_block)
        col_block = jnp.where(in_last_stripe, last_col_block, col_block)
    return row_block, col_block


def _kernel(body, out_type, num_sms: int, clustered: bool = False, approx_math: bool = False):
    """A persistent kernel of num_sms CTAs (clustered: num_sms // 2 clusters of two); approx_math: Mosaic GPU's
    approximate exp, rsqrt and the like (the only transcendentals are an epilogue's activation)."""
    cluster = dict(cluster=(CLUSTER_SIZE,), cluster_names=(_CLUSTER_AXIS,)) if clustered else {}
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_sms // CLUSTER_SIZE,) if clustered else (num_sms,),
        grid_names=(_SM_AXIS,),
        **cluster,
        num_threads=NUM_COMPUTE_WARPGROUPS + 1,
        thread_name=_WARPGROUP_AXIS,
        compiler_params=plgpu.CompilerParams(approx_math=approx_math,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def _stage_ring(num_stages: int, lhs_block, rhs_block, clustered: bool = False, tail_block=None,
                rhs_parts: int = 1) -> dict:
    """Shared memory of the pipeline both kernels run (`_run_pipeline`): num_stages stages of an lhs and an
    rhs block (plgpu.SMEM allocations of one stage each; with tail_block, a pair tail's lhs rows too), a barrier
    per stage that its copies completed (one for the lhs block, rhs_parts for the rhs block and one for a tail
    block: `_load_steps`), and one that both
    compute warpgroups have released it: of both CTAs of the cluster where clustered (a multicast copy writes the
    stage in both, so neither CTA reloads it before the other released it)."""
    def stages(block):
        return plgpu.SMEM((num_stages, *block.shape), block.dtype, transforms=block.transforms)

    tail = {} if tail_block is None else dict(tail_smem=stages(tail_block))
    return dict(lhs_smem=stages(lhs_block), rhs_smem=stages(rhs_block), **tail,
                loaded=plgpu.Barrier(num_arrivals=1 + rhs_parts + len(tail), num_barriers=num_stages),
                consumed=plgpu.ClusterBarrier(collective_axes=(_CLUSTER_AXIS,), num_arrivals=NUM_COMPUTE_WARPGROUPS,
                                              num_barriers=num_stages) if clustered else
                plgpu.Barrier(num_arrivals=NUM_COMPUTE_WARPGROUPS, num_barriers=num_stages))


def _stages_bytes(num_stages: int, *blocks) -> int:
    """Shared memory of num_stages stages of `blocks` (plgpu.SMEM allocations of one stage each)."""
    return num_stages * sum(math.prod(block.shape) * jnp.dtype(block.dtype).itemsize for block in blocks)


def _load_steps(num_steps, step, num_stages: int, ring: dict, lhs_at, rhs_at, multicast_rhs=None, tail_at=None,
                has_tail=None):
    """The memory warpgroup's part of a tile: loads its num_steps steps (the blocks lhs_at(i), rhs_at(i)
    of step i) into the stages of the SM's steps step, step + 1, ...; returns the SM's next step. rhs_at(i) may
    also be a tuple of blocks, each copied into its part of the stage's rhs block (whose leading dimension then
    indexes the parts: a TMA copy needs a contiguous destination, and a column slice of a tiled block is not). Where
    multicast_rhs (a traced bool, the same in both CTAs of a cluster) holds, the two CTAs load the rhs block
    together, each half of it, into both CTAs' stages (TMA multicast). With a tail block in the ring, also the
    block tail_at(i) where has_tail (a traced bool) holds; where it does not, the stage's last arrival comes
    without a copy."""
    def load_step(step_in_tile, step):
        stage = lax.rem(step, num_stages)

        @pl.when(step >= num_stages)
        def _wait_for_release():
            plgpu.barrier_wait(ring["consumed"].at[stage])

        plgpu.copy_gmem_to_smem(lhs_at(step_in_tile), ring["lhs_smem"].at[stage], ring["loaded"].at[stage])
        rhs_blocks = rhs_at(step_in_tile)
        rhs_blocks = rhs_blocks if isinstance(rhs_blocks, tuple) else (rhs_blocks,)
        rhs_smem = ring["rhs_smem"].at[stage]
        for part, block in enumerate(rhs_blocks):
            destination = rhs_smem if len(rhs_blocks) == 1 else rhs_smem.at[part]
            rhs_copy = functools.partial(plgpu.copy_gmem_to_smem, block, destination, ring["loaded"].at[stage])
            if multicast_rhs is None:
                rhs_copy()
            else:
                pl.when(multicast_rhs)(lambda rhs_copy=rhs_copy: rhs_copy(collective_axes=_CLUSTER_AXIS))
                pl.when(jnp.logical_not(multicast_rhs))(rhs_copy)
        if tail_at is not None:
            pl.when(has_tail)(lambda: plgpu.copy_gmem_to_smem(tail_at(step_in_tile), ring["tail_smem"].at[stage],
                                                               ring["loaded"].at[stage]))
            pl.when(jnp.logical_not(has_tail))(lambda: plgpu.barrier_arrive(ring["loaded"].at[stage]))
        return step + 1

    return lax.fori_loop(0, num_steps, load_step, step)


def _mma_steps(num_steps, step, accs, num_stages: int, ring: dict, mma):
    """A compute warpgroup's part of a tile: for each of its num_steps steps, waits for the stage of the SM's
    step, calls mma(step_in_tile, stage, accs) (stage: the ring's shared-memory blocks of that step, by name;
    accs: the accumulator refs) and releases the stage once the matmul is done (the other warpgroup keeps the
    tensor cores busy meanwhile). Returns the SM's next step."""
    def mma_step(step_in_tile, step_and_accs):
        step, accs = step_and_accs
        stage = lax.rem(step, num_stages)
        plgpu.barrier_wait(ring["loaded"].at[stage])
        mma(step_in_tile, {name: ref.at[stage] for name, ref in ring.items() if name.endswith("_smem")}, accs)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(ring["consumed"].at[stage])
        return step + 1, accs

    # The accumulators (registers) travel as the loop's carry, as in JAX's warp-specialized pipeline.
    step, _ = lax.fori_loop(0, num_steps, mma_step, (step, accs))
    return step


def _run_pipeline(num_tiles: int, load_tile, compute_tile, num_stages: int, ring: dict) -> None:
    """Runs each SM's share of num_tiles tiles (interleaved over the SMs) in both roles, each with its share of
    the registers: load_tile(index, step) in the memory warpgroup, compute_tile(index, step) in the compute
    warpgroups, both returning the SM's step after the index-th tile's steps.

    The pipeline is one stream of steps over all of an SM's tiles, not one per tile: the memory warpgroup
    loads the next tile's first steps while the compute warpgroups finish and store the current one. Both
    roles walk the SM's tiles in the same order and count the same steps, so step s of the SM uses stage
    s % num_stages, which is reloaded once both compute warpgroups have released its previous use. (Each
    barrier wait flips the waiting thread's phase: every thread waits once per use of a stage.) The memory
    warpgroup ends waiting for the last stages' releases, so that no barrier is left with a phase nobody
    waited for."""
    def over_my_tiles(tile_fn):
        @plgpu.nd_loop((num_tiles,), collective_axes=_SM_AXIS, init_carry=jnp.int32(0))
        def steps_done(loop_info, carry):
            return tile_fn(loop_info.index[0], carry)

        return steps_done

    def compute():
        plgpu.set_max_registers(COMPUTE_WARPGROUP_REGISTERS, action="increase")
        over_my_tiles(compute_tile)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores' reads of shared memory

    def memory():
        plgpu.set_max_registers(MEMORY_WARPGROUP_REGISTERS, action="decrease")
        num_steps = over_my_tiles(load_tile)

        def wait_for_release(step, carry):
            plgpu.barrier_wait(ring["consumed"].at[lax.rem(step, num_stages)])
            return carry

        lax.fori_loop(jnp.maximum(num_steps - num_stages, 0), num_steps, wait_for_release, None)

    lax.cond(lax.axis_index(_WARPGROUP_AXIS) < NUM_COMPUTE_WARPGROUPS, compute, memory)


def _store_buffers(warpgroup_rows: int, block_n: int, dtype, stages_bytes: int, swizzled: bool,
                   max_piece_cols: int = STORE_COLS):
    """The shared memory each compute warpgroup stores its warpgroup_rows x block_n part of a tile through, in
    pieces of 64 rows x gcd(block_n, max_piece_cols) columns (see STORE_COLS): two buffers where a tile has an
    even count of pieces and they fit beside the pipeline's stages (stages_bytes), else one. Swizzled buffers
    take a store only at their first row."""
    piece_cols = math.gcd(block_n, max_piece_cols)
    num_pieces = warpgroup_rows // ROWS_PER_WARPGROUP * (block_n // piece_cols)
    buffer_bytes = NUM_COMPUTE_WARPGROUPS * ROWS_PER_WARPGROUP * piece_cols * jnp.dtype(dtype).itemsize
    num_buffers = 2 if num_pieces % 2 == 0 and stages_bytes + 2 * buffer_bytes <= SMEM_BYTES else 1
    return plgpu.SMEM((NUM_COMPUTE_WARPGROUPS, num_buffers, ROWS_PER_WARPGROUP, piece_cols), dtype,
                      transforms=_operand_transforms(piece_cols, dtype) if swizzled else ())


def _store_in_pieces(arrays: tuple, buffers, store_piece) -> None:
    """Stores a warpgroup's part of a tile, `arrays` (one or more, stored one after the other), through its buffers
    (its part of a `_store_buffers` allocation): piece i (64 rows x the buffers' columns, row-major order within
    an array) is written to buffer i % num_buffers, then store_piece(buffer, array_index, piece_row, piece_col)
    issues its copies to global memory
    (commit_group=False), one bulk group per piece. A buffer was last read by the store num_buffers pieces
    before (in this tile or the previous one, as tiles have a multiple of num_buffers pieces; a pair tail's
    store in between is awaited by `ragged_rows_matmul` itself), so only that store's read is awaited."""
    num_buffers, _, piece_cols = buffers.shape
    pieces = [(a, r, c) for a, array in enumerate(arrays) for r in range(0, array.shape[0], ROWS_PER_WARPGROUP)
              for c in range(0, array.shape[1], piece_cols)]
    assert len(pieces) % num_buffers == 0, (len(pieces), num_buffers)
    for i, (a, piece_row, piece_col) in enumerate(pieces):
        buffer = buffers.at[i % num_buffers]
        plgpu.wait_smem_to_gmem(num_buffers - 1, wait_read_only=True)
        buffer[...] = arrays[a][piece_row:piece_row + ROWS_PER_WARPGROUP, piece_col:piece_col + piece_cols]
        plgpu.commit_smem()
        store_piece(buffer, a, piece_row, piece_col)
        plgpu.commit_smem_to_gmem_group()


def _store_rows(buffer, gmem_rows, begin, count) -> None:
    """Issues the TMA stores of rows [begin, begin + count) of `buffer` (begin + count <= ROWS_PER_WARPGROUP;
    both traced) to gmem_rows(offset, size), the global rows of buffer rows [offset, offset + size): one store
    per set bit of count (64, 32, ..., 1 rows), as a buffer that is not swizzled can start a store at any row.
    (commit_group=False: the caller commits them as one bulk group.)"""
    offset = begin
    size = ROWS_PER_WARPGROUP
    while size:
        @pl.when((count & size) != 0)
        def _(offset=offset, size=size):
            plgpu.copy_smem_to_gmem(buffer.at[pl.ds(offset, size)], gmem_rows(offset, size), commit_group=False)

        offset += count & size
        size //= 2


def _activation_grad_smem(block_n: int, dtype):
    """With gate_up_activation_grad: each compute warpgroup's rows of a tile's gate block and up block, loaded at
    the tile's start and overwritten by its d_gate and d_up, which are stored from there."""
    return plgpu.SMEM((NUM_COMPUTE_WARPGROUPS, 2, ROWS_PER_WARPGROUP, block_n), dtype)


def activation_grad_unsupported_reason(block_n: int, block_k: int, num_stages: int, dtype, tails: bool) -> str | None:
    """Why `ragged_rows_matmul` cannot take gate_up_activation_grad with these tiles, or None: it needs
    block_n = GATE_UP_HALF_COLS, no pair tails, and its stages beside the gate and up blocks in shared memory."""
    if block_n != GATE_UP_HALF_COLS or tails:
        return f"needs block_n={GATE_UP_HALF_COLS} and no pair tails, got block_n={block_n}, tails={tails}"
    smem = _stages_bytes(num_stages, plgpu.SMEM((BLOCK_ROWS, block_k), dtype), plgpu.SMEM((block_n, block_k), dtype),
                         ) + _stages_bytes(1, _activation_grad_smem(block_n, dtype))
    if smem > SMEM_BYTES:
        return f"{num_stages} stages and the gate and up blocks need {smem} bytes of shared memory, over {SMEM_BYTES}"
    return None


def ragged_rows_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array, tile_first_row: jax.Array,
                       tile_end_row: jax.Array, pair_tail_first: jax.Array | None = None,
                       pair_tail_end: jax.Array | None = None, *, transpose_rhs: bool, block_n: int, block_k: int,
                       num_stages: int, grid_tile_width: int, num_sms: int, clustered: bool = False,
                       gate_up_activation=None, gate_up: jax.Array | None = None,
                       gate_up_activation_grad=None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """out[r] = lhs[r] @ rhs[g] (or rhs[g]^T with transpose_rhs) for the rows r each tile of group g writes
    in the schedule from `row_tile_schedule`; zero tiles write zeros.

    lhs [M, K]; rhs [G, K, N] ([G, N, K] with transpose_rhs); returns [M, N] in lhs's dtype. The schedule
    writes each row at most once: every one of the M rows, or those before its zero_rows_end (the rows after it
    are left as the allocation held them).

    clustered: the schedule is `paired_row_tile_schedule`'s, and tiles 2p and 2p + 1 run together in a 2-CTA
    cluster (num_sms even): where both are tiles of one group, each CTA loads half of every weight block and
    multicasts it to both, so that a weight block streamed from HBM costs each SM half the loads; otherwise each
    loads its own. The two CTAs step through their pair together (a CTA whose tile has no rows loads and skips
    its matmuls while the other computes).

    pair_tail_first, pair_tail_end (clustered, from `paired_row_tile_schedule(fuse_tails=True)`; block_n a
    multiple of 256): pair p also writes its tail rows [pair_tail_first[p], pair_tail_end[p]) (at most
    ROWS_PER_WARPGROUP, of the pair's group), from the weight blocks already in its stages: each CTA loads the
    tail's lhs rows beside its own, and each of the cluster's four compute warpgroups multiplies them by its
    quarter of the block's columns into a second, 64 x block_n / 4 accumulator.

    gate_up_activation (not transpose_rhs, no pair tails, block_n = 2 * GATE_UP_HALF_COLS): rhs [G, K, 2F] holds a
    gate's F columns, then an up's, and the kernel also applies h = gate_up_activation(gate, up) (float32 in and
    out, elementwise) to the tile in its epilogue. Column block j of the output is the gate's columns
    [j * 128, j * 128 + 128) and the up's same columns (two rhs blocks in each stage, two wgmmas a step into two
    accumulators), so each warpgroup holds a row's gate and up values together. gate and up are the outputs rounded
    to lhs's dtype (what a separate pass over out would read). Returns (out [M, 2F], h [M, F]), both in lhs's
    dtype; h of a zero tile is gate_up_activation(0, 0).

    gate_up_activation_grad with gate_up [M, 2N] (no pair tails, block_n = GATE_UP_HALF_COLS): the product is dh,
    the cotangent of an activation h = act(gate, up) of gate_up's halves, and the kernel returns d_gate_up [M, 2N]
    instead: (d_gate, d_up) = gate_up_activation_grad(gate, up, dh) (float32 in and out, elementwise) of each
    tile's dh rounded to lhs's dtype (what a separate pass would read) and the same rows and columns of the gate
    and of the up. Each compute warpgroup loads its 64 rows of both at the tile's start (TMA, beside the tile's
    steps) into the shared memory its results are then stored from. Zero tiles load nothing and store zeros."""
    _check_operands(lhs, rhs, block_n, block_k, num_stages)
    if clustered and (tile_group.shape[0] % CLUSTER_SIZE or num_sms % CLUSTER_SIZE):
        raise ValueError(f"clustered: the schedule needs an even number of tiles and num_sms must be even, got "
                         f"{tile_group.shape[0]} tiles and num_sms={num_sms}")
    tails = pair_tail_first is not None
    activation = gate_up_activation is not None
    activation_grad = gate_up_activation_grad is not None
    if activation_grad != (gate_up is not None) or (activation_grad and activation):
        raise ValueError(f"gate_up_activation_grad needs gate_up (and gate_up needs it), and not gate_up_activation, "
                         f"got gate_up={None if gate_up is None else gate_up.shape}, "
                         f"gate_up_activation={activation}")
    if activation_grad and (reason := activation_grad_unsupported_reason(block_n, block_k, num_stages, lhs.dtype,
                                                                         tails)):
        raise ValueError(f"gate_up_activation_grad: {reason}")
    if activation and (transpose_rhs or tails or block_n != 2 * GATE_UP_HALF_COLS):
        raise ValueError(f"gate_up_activation needs transpose_rhs=False, no pair tails and block_n="
                         f"{2 * GATE_UP_HALF_COLS}, got transpose_rhs={transpose_rhs}, tails={tails}, "
                         f"block_n={block_n}")
    tail_quarters = CLUSTER_SIZE * NUM_COMPUTE_WARPGROUPS  # the compute warpgroups of a cluster
    if tails and (not clustered or block_n % (64 * tail_quarters) or pair_tail_end is None):
        raise ValueError(f"pair tails need clustered=True, both pair_tail_first and pair_tail_end, and block_n a "
                         f"multiple of {64 * tail_quarters}, got clustered={clustered}, block_n={block_n}")
    num_rows, contracted = lhs.shape
    if transpose_rhs:
        _, out_cols, rhs_contracted = rhs.shape
    else:
        _, rhs_contracted, out_cols = rhs.shape
    if rhs_contracted != contracted or contracted % block_k or out_cols % block_n:
        raise ValueError(f"lhs {lhs.shape} and rhs {rhs.shape} (transpose_rhs={transpose_rhs}) need a shared "
                         f"contracted dimension divisible by block_k={block_k} and output columns divisible "
                         f"by block_n={block_n}")
    dtype = lhs.dtype
    num_tiles = tile_group.shape[0]
    col_blocks = out_cols // block_n
    steps_per_tile = contracted // block_k
    tail_cols = block_n // tail_quarters
    lhs_block = plgpu.SMEM((BLOCK_ROWS, block_k), dtype, transforms=_operand_transforms(block_k, dtype))
    tail_block = (plgpu.SMEM((ROWS_PER_WARPGROUP, block_k), dtype, transforms=_operand_transforms(block_k, dtype))
                  if tails else None)
    if transpose_rhs:
        rhs_block = plgpu.SMEM((block_n, block_k), dtype, transforms=_operand_transforms(block_k, dtype))
    elif activation:  # the gate's block, then the up's
        rhs_block = plgpu.SMEM((2, block_k, GATE_UP_HALF_COLS), dtype,
                               transforms=_operand_transforms(GATE_UP_HALF_COLS, dtype))
    else:
        rhs_block = plgpu.SMEM((block_k, block_n), dtype, transforms=_operand_transforms(block_n, dtype))
    stages_bytes = _stages_bytes(num_stages, lhs_block, rhs_block, *([tail_block] if tails else []))
    half_cols = out_cols // 2  # F, with gate_up_activation
    if activation_grad and (gate_up.shape != (num_rows, 2 * out_cols) or gate_up.dtype != dtype):
        raise ValueError(f"gate_up must be [M, 2N] = [{num_rows}, {2 * out_cols}] in {dtype}, got {gate_up.shape} "
                         f"in {gate_up.dtype}")

    def body(tile_group_gmem, tile_first_row_gmem, tile_end_row_gmem, *refs):
        tail_first_gmem, tail_end_gmem = refs[:2] if tails else (None, None)
        refs = refs[2 if tails else 0:]
        gate_up_gmem, refs = (refs[0], refs[1:]) if activation_grad else (None, refs)
        lhs_gmem, rhs_gmem, out_gmem, *h_gmem = refs

        def computes(tile):
            return (tile_end_row_gmem[tile] > tile_first_row_gmem[tile]) & (tile_group_gmem[tile] != _FILL_TILE)

        def tile_at(index):
            """The index-th (tile, column block): its group (0 for a zero tile or an unused entry, whose loads
            are never used), first and end rows, first row rounded down to 8, number of steps (0 for a zero
            tile or an unused entry, unless clustered beside a tile with steps), columns, whether it computes,
            (clustered) whether the cluster multicasts its rhs blocks, and (with tails) the pair's tail rows."""
            if not clustered:
                tile, col_block = _striped_order(index, num_tiles, col_blocks, grid_tile_width)
                partner = None
            else:
                pair, col_block = _striped_order(index, num_tiles // CLUSTER_SIZE, col_blocks, grid_tile_width)
                cta = lax.axis_index(_CLUSTER_AXIS)
                tile, partner = CLUSTER_SIZE * pair + cta, CLUSTER_SIZE * pair + 1 - cta
            group = tile_group_gmem[tile]
            first_row = tile_first_row_gmem[tile]
            end_row = tile_end_row_gmem[tile]
            tile_start = pl.multiple_of(first_row - first_row % ROW_ALIGNMENT, ROW_ALIGNMENT)
            mine = computes(tile)
            if partner is None:
                return (group, first_row, end_row, tile_start, jnp.where(mine, steps_per_tile, 0), col_block, mine,
                        None, None)
            theirs = computes(partner)
            multicast = mine & theirs & (group == tile_group_gmem[partner])
            num_steps = jnp.where(mine | theirs, steps_per_tile, 0)
            # A CTA that computes nothing loads its partner's weights (L2 hits beside the partner's loads).
            load_group = jnp.maximum(jnp.where(mine, group, tile_group_gmem[partner]), 0)
            tail = (pl.multiple_of(tail_first_gmem[pair], ROW_ALIGNMENT), tail_end_gmem[pair]) if tails else None
            return load_group, first_row, end_row, tile_start, num_steps, col_block, mine, multicast, tail

        @functools.partial(
            pl.run_scoped,
            # With tails, a tile is stored in pieces of a tail's width, and a tail is one more piece. With the
            # activation, the gate's, the up's and h's blocks in halves: six pieces, an even count for two buffers.
            out_smem=_activation_grad_smem(block_n, dtype) if activation_grad else _store_buffers(
                ROWS_PER_WARPGROUP, block_n + (GATE_UP_HALF_COLS if activation else 0), dtype, stages_bytes,
                swizzled=False, max_piece_cols=(tail_cols if tails else GATE_UP_HALF_COLS // 2 if activation
                                                else STORE_COLS)),
            collective_axes=_WARPGROUP_AXIS,
            **(dict(operands_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_COMPUTE_WARPGROUPS))
               if activation_grad else {}),
            **_stage_ring(num_stages, lhs_block, rhs_block, clustered, tail_block, rhs_parts=2 if activation else 1),
        )
        def scope(out_smem, operands_loaded=None, **ring):
            wg = lax.axis_index(_WARPGROUP_AXIS)

            def load_tile(index, step):
                group, _, _, tile_start, num_steps, col_block, _, multicast, tail = tile_at(index)
                cols = pl.ds(col_block * block_n, block_n)
                tile_rows = pl.ds(tile_start, BLOCK_ROWS)

                def rhs_at(i):
                    contracted_block = pl.ds(i * block_k, block_k)
                    if transpose_rhs:
                        return rhs_gmem.at[group, cols, contracted_block]
                    if activation:  # the gate's columns of block col_block, and the up's
                        return tuple(rhs_gmem.at[group, contracted_block,
                                                 pl.ds(first + col_block * GATE_UP_HALF_COLS, GATE_UP_HALF_COLS)]
                                     for first in (0, half_cols))
                    return rhs_gmem.at[group, contracted_block, cols]

                tail_loads = {}
                if tails:
                    tail_first, tail_end = tail
                    tail_loads = dict(has_tail=tail_end > tail_first, tail_at=lambda i: lhs_gmem.at[
                        pl.ds(tail_first, ROWS_PER_WARPGROUP), pl.ds(i * block_k, block_k)])
                return _load_steps(num_steps, step, num_stages, ring,
                                   lambda i: lhs_gmem.at[tile_rows, pl.ds(i * block_k, block_k)], rhs_at, multicast,
                                   **tail_loads)

            def compute_tile(index, step):
                _, first_row, end_row, tile_start, num_steps, col_block, computing, _, tail = tile_at(index)
                # This warpgroup's slab of the tile, and the part of it the tile writes.
                my_start = tile_start + wg * ROWS_PER_WARPGROUP
                my_begin = jnp.clip(first_row - my_start, 0, ROWS_PER_WARPGROUP)
                my_end = jnp.clip(end_row - my_start, 0, ROWS_PER_WARPGROUP)
                my_rows = my_end - my_begin
                if tails:
                    tail_first, tail_end = tail
                    has_tail = tail_end > tail_first
                    # This warpgroup's quarter of the tile's columns in the pair's tail.
                    quarter = lax.axis_index(_CLUSTER_AXIS) * NUM_COMPUTE_WARPGROUPS + wg

                def store_piece(buffer, _, piece_row, piece_col):
                    del piece_row  # a warpgroup's part of a tile is one piece high
                    store_block = pl.ds(col_block * block_n + piece_col, buffer.shape[-1])
                    _store_rows(buffer, lambda offset, size: out_gmem.at[pl.ds(my_start + offset, size), store_block],
                                my_begin, my_rows)

                def store_gate_up_piece(buffer, array_index, piece_row, piece_col):
                    """Pieces of the gate's columns (array 0), of the up's (1) and of h (2)."""
                    del piece_row
                    gmem, first_col = ((out_gmem, 0), (out_gmem, half_cols), (h_gmem[0], 0))[array_index]
                    store_block = pl.ds(first_col + col_block * GATE_UP_HALF_COLS + piece_col, buffer.shape[-1])
                    _store_rows(buffer, lambda offset, size: gmem.at[pl.ds(my_start + offset, size), store_block],
                                my_begin, my_rows)

                def mma(_, stage, accs):
                    acc_ref, second_acc_ref = accs
                    rhs_smem = stage["rhs_smem"]

                    if activation:  # the gate's columns into acc_ref, the up's into the second accumulator
                        @pl.when((my_rows > 0) & computing)
                        def _():
                            lhs_slab = stage["lhs_smem"].at[pl.ds(wg * ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP)]
                            plgpu.wgmma(acc_ref, lhs_slab, rhs_smem.at[0])
                            plgpu.wgmma(second_acc_ref, lhs_slab, rhs_smem.at[1])
                        return

                    if tails:
                        # Issued before the tile's own wgmma, whose time then hides this one's latency (issued after
                        # it, the tail's wgmma added about as much to every step of the pair whatever its width).
                        for q in range(tail_quarters):  # static column slices of the swizzled rhs block
                            @pl.when(has_tail & (quarter == q))
                            def _(q=q):
                                part = pl.ds(q * tail_cols, tail_cols)
                                rhs_operand = (rhs_smem.at[part].transpose((1, 0)) if transpose_rhs else
                                               rhs_smem.at[:, part])
                                plgpu.wgmma(second_acc_ref, stage["tail_smem"], rhs_operand)

                    # In a group's last tile, a warpgroup whose rows are all past the group's end skips; so does a
                    # zero tile or an unused entry stepping beside its cluster partner (its stages hold no weights).
                    @pl.when((my_rows > 0) & computing)
                    def _():
                        rhs_operand = rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem
                        plgpu.wgmma(acc_ref, stage["lhs_smem"].at[pl.ds(wg * ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP)],
                                    rhs_operand)

                def store_tail(second_acc_ref):
                    # Through the tile's first buffer, once the tile's stores have read it; and read by its own store
                    # before the next tile writes that buffer (_store_in_pieces awaits the buffer's last store only).
                    buffer = out_smem.at[wg, 0]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    buffer[...] = second_acc_ref[...].astype(dtype)
                    plgpu.commit_smem()
                    store_block = pl.ds(col_block * block_n + quarter * tail_cols, tail_cols)
                    _store_rows(buffer, lambda offset, size: out_gmem.at[pl.ds(tail_first + offset, size), store_block],
                                0, tail_end - tail_first)
                    plgpu.commit_smem_to_gmem_group()
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                # A zero tile computes nothing: it stores the accumulator's initial zeros.
                accumulators = dict(acc_ref=plgpu.ACC((ROWS_PER_WARPGROUP, block_n), jnp.float32))
                if tails:
                    # The tail's; with the activation, the up's.
                    accumulators["second_acc_ref"] = plgpu.ACC((ROWS_PER_WARPGROUP, tail_cols), jnp.float32)
                if activation:  # the gate's and the up's
                    accumulators = {name: plgpu.ACC((ROWS_PER_WARPGROUP, GATE_UP_HALF_COLS), jnp.float32)
                                    for name in ("acc_ref", "second_acc_ref")}

                def gate_up_cols(part):
                    """The tile's columns of the gate (part 0) or the up (1) in gate_up, and in d_gate_up."""
                    return pl.ds((0, out_cols)[part] + col_block * block_n, block_n)

                def load_gate_and_up():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read these buffers
                    for part in (0, 1):
                        my_block = gate_up_gmem.at[pl.ds(my_start, ROWS_PER_WARPGROUP), gate_up_cols(part)]
                        plgpu.copy_gmem_to_smem(my_block, out_smem.at[wg, part], operands_loaded.at[wg])

                def store_activation_grad(acc_ref):
                    @pl.when(computing)
                    def _():
                        dh = acc_ref[...].astype(dtype).astype(jnp.float32)
                        plgpu.barrier_wait(operands_loaded.at[wg])
                        gate, up = (out_smem.at[wg, part][...].astype(jnp.float32) for part in (0, 1))
                        grads = gate_up_activation_grad(gate, up, dh)
                        plgpu.commit_smem()  # (with a warpgroup barrier) every thread has read its gate and up
                        for part, grad in enumerate(grads):
                            out_smem.at[wg, part][...] = grad.astype(dtype)

                    @pl.when(jnp.logical_not(computing))
                    def _():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (no load awaited it)
                        for part in (0, 1):
                            out_smem.at[wg, part][...] = jnp.zeros(out_smem.shape[-2:], dtype)

                    plgpu.commit_smem()
                    for part in (0, 1):
                        _store_rows(out_smem.at[wg, part],
                                    lambda offset, size, part=part: out_gmem.at[pl.ds(my_start + offset, size),
                                                                                 gate_up_cols(part)],
                                    my_begin, my_rows)
                    plgpu.commit_smem_to_gmem_group()

                @functools.partial(pl.run_scoped, **accumulators)
                def step_after_tile(acc_ref, second_acc_ref=None):
                    if activation_grad:
                        pl.when((my_rows > 0) & computing)(load_gate_and_up)
                    step_after = _mma_steps(num_steps, step, (acc_ref, second_acc_ref), num_stages, ring, mma)

                    @pl.when(my_rows > 0)
                    def _():
                        if activation_grad:
                            store_activation_grad(acc_ref)
                            return
                        if not activation:
                            _store_in_pieces((acc_ref[...].astype(dtype),), out_smem.at[wg], store_piece)
                            return
                        gate, up = acc_ref[...].astype(dtype), second_acc_ref[...].astype(dtype)
                        h = gate_up_activation(gate.astype(jnp.float32), up.astype(jnp.float32)).astype(dtype)
                        _store_in_pieces((gate, up, h), out_smem.at[wg], store_gate_up_piece)

                    if tails:
                        pl.when(has_tail)(lambda: store_tail(second_acc_ref))
                    return step_after

                return step_after_tile

            _run_pipeline((num_tiles // CLUSTER_SIZE if clustered else num_tiles) * col_blocks, load_tile,
                          compute_tile, num_stages, ring)

    tail_schedule = (pair_tail_first, pair_tail_end) if tails else ()
    out_type = jax.ShapeDtypeStruct((num_rows, 2 * out_cols if activation_grad else out_cols), dtype)
    if activation:
        out_type = (out_type, jax.ShapeDtypeStruct((num_rows, half_cols), dtype))
    kernel = _kernel(body, out_type, num_sms, clustered, approx_math=activation or activation_grad)
    return kernel(tile_group, tile_first_row, tile_end_row, *tail_schedule, *([gate_up] if activation_grad else []),
                  lhs, rhs)


def ragged_contraction_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_n: int,
                              block_k: int, num_stages: int, grid_tile_width: int, num_sms: int,
                              block_rows: int = BLOCK_ROWS) -> jax.Array:
    """out[g] = lhs[rows of g]^T @ rhs[rows of g], the rows of group g being the group_sizes[g] rows after
    those of groups 0..g-1 (group_sizes non-negative, summing to at most M).

    lhs [M, K]; rhs [M, N]; returns [G, K, N] in lhs's dtype, zeros for empty groups. A group's steps start
    at its first row rounded down to a multiple of 8 and end up to block_k - 1 rows past its last row; the
    rows outside the group are zeroed in lhs's block before use. rhs's are not, so rows of rhs past
    sum(group_sizes) must be finite (0 * inf is nan).

    Output tiles are block_rows (128 or 256) rows of K by block_n columns, each compute warpgroup owning
    half of the rows. A group's tiles are only its rows / block_k steps long (about 6 for 384 rows): the kernel
    gains most from `_run_pipeline` loading the next tile while the current one finishes."""
    _check_operands(lhs, rhs, block_n, block_k, num_stages)
    num_rows, out_rows = lhs.shape
    rhs_rows, out_cols = rhs.shape
    if block_rows not in (BLOCK_ROWS, 2 * BLOCK_ROWS):
        raise ValueError(f"block_rows must be {BLOCK_ROWS} or {2 * BLOCK_ROWS}, got {block_rows}")
    if rhs_rows != num_rows or out_rows % block_rows or out_cols % block_n:
        raise ValueError(f"lhs {lhs.shape} and rhs {rhs.shape} need the same rows, lhs columns divisible by "
                         f"block_rows={block_rows} and rhs columns divisible by block_n={block_n}")
    rows_per_warpgroup = block_rows // NUM_COMPUTE_WARPGROUPS
    dtype = lhs.dtype
    num_groups = group_sizes.shape[0]
    row_blocks = out_rows // block_rows
    col_blocks = out_cols // block_n
    num_tiles = num_groups * row_blocks * col_blocks
    group_ends = jnp.cumsum(group_sizes)
    lhs_block = plgpu.SMEM((block_k, block_rows), dtype, transforms=_operand_transforms(block_rows, dtype))
    rhs_block = plgpu.SMEM((block_k, block_n), dtype, transforms=_operand_transforms(block_n, dtype))

    def body(group_ends_gmem, group_sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        def tile_at(index):
            """The index-th tile: its group's first and end rows, the first step's row (the first rounded down
            to 8) and its number of steps (0 for an empty group); its group, row block and column block. A
            group's tiles are consecutive, so the SMs working at the same time read the same rows."""
            group = index // (row_blocks * col_blocks)
            row_block, col_block = _striped_order(index % (row_blocks * col_blocks), row_blocks, col_blocks,
                                                  grid_tile_width)
            end = group_ends_gmem[group]
            start = end - group_sizes_gmem[group]
            aligned_start = pl.multiple_of(start - start % ROW_ALIGNMENT, ROW_ALIGNMENT)
            num_steps = jnp.where(end > start, (end - aligned_start + block_k - 1) // block_k, 0)
            return start, end, aligned_start, num_steps, group, row_block, col_block

        @functools.partial(
            pl.run_scoped,
            out_smem=_store_buffers(rows_per_warpgroup, block_n, dtype, _stages_bytes(num_stages, lhs_block, rhs_block),
                                    swizzled=True),
            collective_axes=_WARPGROUP_AXIS,
            **_stage_ring(num_stages, lhs_block, rhs_block),
        )
        def scope(out_smem, **ring):
            wg = lax.axis_index(_WARPGROUP_AXIS)

            def load_tile(index, step):
                _, _, aligned_start, num_steps, _, row_block, col_block = tile_at(index)

                def rows(i):
                    return pl.ds(aligned_start + i * block_k, block_k)

                return _load_steps(num_steps, step, num_stages, ring,
                                   lambda i: lhs_gmem.at[rows(i), pl.ds(row_block * block_rows, block_rows)],
                                   lambda i: rhs_gmem.at[rows(i), pl.ds(col_block * block_n, block_n)])

            def compute_tile(index, step):
                start, end, aligned_start, num_steps, group, row_block, col_block = tile_at(index)
                my_first_out_row = row_block * block_rows + wg * rows_per_warpgroup

                def mma(step_in_tile, stage, acc_ref):
                    # This warpgroup's K columns of the lhs block: its slab of output rows.
                    my_lhs = stage["lhs_smem"].at[:, pl.ds(wg * rows_per_warpgroup, rows_per_warpgroup)]
                    # The block's rows [begin, stop) are the group's; only the first and last steps have others.
                    step_start = aligned_start + step_in_tile * block_k
                    begin = start - step_start
                    stop = end - step_start

                    @pl.when((begin > 0) | (stop < block_k))
                    def _zero_rows_of_other_groups():
                        row = lax.broadcasted_iota(jnp.int32, (block_k, rows_per_warpgroup), 0)
                        keep = (row >= begin) & (row < stop)
                        my_lhs[...] = jnp.where(keep, my_lhs[...], jnp.zeros((), dtype))
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, my_lhs.transpose((1, 0)), stage["rhs_smem"])

                def store_piece(buffer, _, piece_row, piece_col):
                    plgpu.copy_smem_to_gmem(buffer, out_gmem.at[
                        group, pl.ds(my_first_out_row + piece_row, ROWS_PER_WARPGROUP),
                        pl.ds(col_block * block_n + piece_col, buffer.shape[-1])], commit_group=False)

                # An empty group has no steps: its tiles store the accumulator's initial zeros.
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((rows_per_warpgroup, block_n), jnp.float32))
                def step_after_tile(acc_ref):
                    step_after = _mma_steps(num_steps, step, acc_ref, num_stages, ring, mma)
                    _store_in_pieces((acc_ref[...].astype(dtype),), out_smem.at[wg], store_piece)
                    return step_after

                return step_after_tile

            _run_pipeline(num_tiles, load_tile, compute_tile, num_stages, ring)

    return _kernel(body, jax.ShapeDtypeStruct((num_groups, out_rows, out_cols), dtype), num_sms)(
        group_ends.astype(jnp.int32), group_sizes.astype(jnp.int32), lhs, rhs)
