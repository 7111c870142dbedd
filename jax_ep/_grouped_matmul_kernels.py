"""jax_ep's Pallas Mosaic GPU kernels for `grouped_matmul` on Hopper (sm_90).

Two warp-specialized, persistent kernels (one CTA per SM, three warpgroups: two compute, one issuing TMA
loads), one per kind of grouped product:

* `ragged_rows_matmul`: out[r] = lhs[r] @ B_g for every row r of group g (the forward pass, and dx with the
  weights transposed). Output tiles are 128 rows x `block_n` columns, but unlike a fixed grid of 128-row
  tiles they start at their group's first row (rounded down to a multiple of 8, see ROW_ALIGNMENT), so no
  tile holds rows of two groups beyond those 7 and none is computed twice. The two compute warpgroups own
  64 rows each; in a group's last tile a warpgroup whose 64 rows are all past the group's end skips its
  matmuls, so a tail of at most 64 rows costs half a tile. Tiles past the last group write the zero rows,
  and the tile count follows the group sizes: rows past sum(group_sizes) cost no matmul work. The tile
  schedule is a small int32 table computed on the device from group_sizes (`row_tile_schedule`).
* `ragged_contraction_matmul`: out[g] = lhs[rows of g]^T @ rhs[rows of g] (dw). Output tiles are
  (group, 128 or 256 rows of K, `block_n` columns); each sums over its group's rows in steps of `block_k` rows,
  from the group's first row (rounded down to a multiple of 8), so only a group's first and last steps hold
  rows of other groups: those rows of the lhs block are zeroed in shared memory before the matmul.

Shapes the kernels take: lhs/rhs in bfloat16 or float16 (one dtype), float32 accumulation; the contracted
dimension a multiple of `block_k` (rows kernel), output columns a multiple of `block_n`, K a multiple of
`block_rows` (contraction kernel), at least 128 rows. `grouped_matmul` checks these before it picks these kernels.

Loads may run past the end of lhs/rhs (a tile's 128 rows from its group's start, a group's last `block_k`
rows): TMA fills rows outside the array with zeros, and rows inside it that belong to another group never
reach an output row (rows kernel) or are zeroed first (contraction kernel).

Both kernels release a pipeline stage only after its wgmma has completed (wgmma_wait(0)): with two compute
warpgroups one keeps the tensor cores busy while the other waits, and no stage is reloaded while a matmul
may still read it, including across tiles.
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
# first row must be a multiple of 8, so tiles and contraction steps start at multiples of 8 rows.
ROW_ALIGNMENT = 8
# A warpgroup stores its part of an output tile through shared memory in pieces of 64 rows x
# gcd(block_n, STORE_COLS) columns: a buffer for a whole 256-column tile takes 64 KiB from the pipeline's
# stages, and measured on an H200 the pieces make the 256-column kernels 2-5 % faster (the MoE block's gate and
# up projection, forward: 497 -> 470 us).
STORE_COLS = 128
# The warpgroup issuing TMA loads needs few registers; the rest go to the two accumulating warpgroups.
MEMORY_WARPGROUP_REGISTERS = 40
_WARPGROUP_AXIS = "wg"
_SM_AXIS = "sm"
_FILL_TILE = -1  # tile_group value of a tile that writes zero rows


def row_tile_schedule(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tiles of `ragged_rows_matmul` for `group_sizes` (non-negative, summing to at most num_rows).

    Returns three int32 vectors of one static length (an upper bound on the number of tiles for any sizes
    of this many groups): tile_group (the group whose weights the tile uses, or -1 for a tile that writes
    zero rows past the last group), tile_first_row and tile_end_row (the rows [first, end) the tile writes;
    first == end for unused entries at the end). Group tiles come first, in group order. A tile covers the
    BLOCK_ROWS rows from its first row rounded down to a multiple of 8 (TMA loads into the tiled shared
    memory layout start at multiples of 8 rows), so a group's first tile may read up to 7 rows of the
    previous group, which it does not write. Zero tiles cover [sum(group_sizes), num_rows)."""
    num_groups = group_sizes.shape[0]
    # Each group adds at most one partial tile, plus 7 rows of alignment; so does the zero-row range.
    max_tiles = (num_rows + (num_groups + 1) * (BLOCK_ROWS - 1 + ROW_ALIGNMENT - 1)) // BLOCK_ROWS
    group_ends = jnp.cumsum(group_sizes)
    # The zero rows past the last group are one more "group" here, whose tiles get group -1.
    range_ends = jnp.append(group_ends, num_rows)
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


def _kernel(body, out_type, num_sms: int):
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_sms,),
        grid_names=(_SM_AXIS,),
        num_threads=NUM_COMPUTE_WARPGROUPS + 1,
        thread_name=_WARPGROUP_AXIS,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def ragged_rows_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array, tile_first_row: jax.Array,
                       tile_end_row: jax.Array, *, transpose_rhs: bool, block_n: int, block_k: int,
                       num_stages: int, grid_tile_width: int, num_sms: int) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g] (or rhs[g]^T with transpose_rhs) for the rows r each tile of group g writes
    in the schedule from `row_tile_schedule`; zero tiles write zeros.

    lhs [M, K]; rhs [G, K, N] ([G, N, K] with transpose_rhs); returns [M, N] in lhs's dtype. The schedule
    writes every one of the M rows exactly once."""
    _check_operands(lhs, rhs, block_n, block_k, num_stages)
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
    store_cols = math.gcd(block_n, STORE_COLS)
    transforms = _operand_transforms(block_k, dtype)
    lhs_spec = plgpu.BlockSpec((BLOCK_ROWS, block_k), lambda k: (0, k), transforms=transforms,
                               memory_space=plgpu.SMEM)
    if transpose_rhs:
        rhs_spec = plgpu.BlockSpec((block_n, block_k), lambda k: (0, k), transforms=transforms,
                                   memory_space=plgpu.SMEM)
    else:
        rhs_spec = plgpu.BlockSpec((block_k, block_n), lambda k: (k, 0),
                                   transforms=_operand_transforms(block_n, dtype), memory_space=plgpu.SMEM)

    def make_pipeline(mma_step, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            mma_step,
            grid=(contracted // block_k,),
            memory_registers=MEMORY_WARPGROUP_REGISTERS,
            in_specs=[lhs_spec, rhs_spec],
            wg_axis=_WARPGROUP_AXIS,
            num_compute_wgs=NUM_COMPUTE_WARPGROUPS,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
        )

    def body(tile_group_gmem, tile_first_row_gmem, tile_end_row_gmem, lhs_gmem, rhs_gmem, out_gmem):
        unused = lambda *_, **__: None  # noqa: E731  (the buffers depend on the block specs only)

        # out_smem is not swizzled so that a store can start at any row: a warpgroup writes its rows of a
        # tile with one TMA store per set bit of their count (64, 32, ..., 1 rows), store_cols columns at a time.
        @functools.partial(
            pl.run_scoped,
            pipeline_buffers=make_pipeline(unused, unused).get_allocations(lhs_gmem, rhs_gmem.at[0]),
            out_smem=plgpu.SMEM((NUM_COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, store_cols), dtype),
            collective_axes=_WARPGROUP_AXIS,
        )
        def scope(pipeline_buffers, out_smem):
            wg = lax.axis_index(_WARPGROUP_AXIS)

            @plgpu.nd_loop((num_tiles * col_blocks,), collective_axes=_SM_AXIS)
            def tile_loop(loop_info):
                tile, col_block = _striped_order(loop_info.index[0], num_tiles, col_blocks, grid_tile_width)
                group = tile_group_gmem[tile]
                first_row = tile_first_row_gmem[tile]
                end_row = tile_end_row_gmem[tile]
                tile_start = pl.multiple_of(first_row - first_row % ROW_ALIGNMENT, ROW_ALIGNMENT)
                # This warpgroup's slab of the tile, and the part of it the tile writes.
                my_start = tile_start + wg * ROWS_PER_WARPGROUP
                my_begin = jnp.clip(first_row - my_start, 0, ROWS_PER_WARPGROUP)
                my_end = jnp.clip(end_row - my_start, 0, ROWS_PER_WARPGROUP)
                my_rows = my_end - my_begin
                cols = pl.ds(col_block * block_n, block_n)

                def store_my_rows(values):
                    my_smem = out_smem.at[wg]
                    for first_col in range(0, block_n, store_cols):
                        # The previous stores (this tile's last columns, or the previous tile's) read it.
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        my_smem[...] = values[:, first_col:first_col + store_cols]
                        plgpu.commit_smem()
                        store_block = pl.ds(col_block * block_n + first_col, store_cols)
                        offset = my_begin
                        size = ROWS_PER_WARPGROUP
                        while size:
                            @pl.when((my_rows & size) != 0)
                            def _(offset=offset, size=size):
                                plgpu.copy_smem_to_gmem(my_smem.at[pl.ds(offset, size)],
                                                        out_gmem.at[pl.ds(my_start + offset, size), store_block])

                            offset += my_rows & size
                            size //= 2

                @pl.when((end_row > first_row) & (group != _FILL_TILE))
                def _matmul_tile():
                    def mma_step(_, lhs_smem, rhs_smem, acc_ref):
                        @pl.when(my_rows > 0)
                        def _():
                            rhs_operand = plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem
                            plgpu.wgmma(acc_ref, lhs_smem.at[pl.ds(wg * ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP)],
                                        rhs_operand)
                        # Release the stage only once its matmul is done (the other warpgroup keeps the
                        # tensor cores busy meanwhile).
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    def compute_context(run_pipeline):
                        @functools.partial(pl.run_scoped,
                                           acc_ref=plgpu.ACC((ROWS_PER_WARPGROUP, block_n), jnp.float32))
                        def _(acc_ref):
                            run_pipeline(acc_ref)

                            @pl.when(my_rows > 0)
                            def _():
                                store_my_rows(acc_ref[...].astype(dtype))

                    rhs_block = rhs_gmem.at[group, cols, :] if transpose_rhs else rhs_gmem.at[group, :, cols]
                    make_pipeline(mma_step, compute_context)(
                        lhs_gmem.at[pl.ds(tile_start, BLOCK_ROWS), :], rhs_block, allocations=pipeline_buffers)

                @pl.when((group == _FILL_TILE) & (my_rows > 0) & (wg < NUM_COMPUTE_WARPGROUPS))
                def _zero_tile():
                    store_my_rows(jnp.zeros((ROWS_PER_WARPGROUP, block_n), dtype))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(body, jax.ShapeDtypeStruct((num_rows, out_cols), dtype), num_sms)(
        tile_group, tile_first_row, tile_end_row, lhs, rhs)


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
    half of the rows. A group's tiles are only its rows / block_k steps long, so filling the pipeline and
    storing the tile cost about as much as the matmuls; 256-row tiles halve that per FLOP."""
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
    group_ends = jnp.cumsum(group_sizes)
    lhs_spec = plgpu.BlockSpec((block_k, block_rows), lambda k: (k, 0),
                               transforms=_operand_transforms(block_rows, dtype), memory_space=plgpu.SMEM)
    rhs_spec = plgpu.BlockSpec((block_k, block_n), lambda k: (k, 0),
                               transforms=_operand_transforms(block_n, dtype), memory_space=plgpu.SMEM)
    # A warpgroup stores its rows_per_warpgroup x block_n tile in pieces of 64 rows x store_cols (see STORE_COLS).
    store_cols = math.gcd(block_n, STORE_COLS)
    out_transforms = _operand_transforms(store_cols, dtype)

    def make_pipeline(mma_step, compute_context, num_steps):
        return plgpu.emit_pipeline_warp_specialized(
            mma_step,
            grid=(num_steps,),
            memory_registers=MEMORY_WARPGROUP_REGISTERS,
            in_specs=[lhs_spec, rhs_spec],
            wg_axis=_WARPGROUP_AXIS,
            num_compute_wgs=NUM_COMPUTE_WARPGROUPS,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
        )

    def body(group_ends_gmem, group_sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        unused = lambda *_, **__: None  # noqa: E731  (the buffers depend on the block specs only)
        # A static grid of num_stages steps sizes the buffers as the per-group (traced) grids use them.
        buffers = make_pipeline(unused, unused, num_stages).get_allocations(lhs_gmem, rhs_gmem)

        @functools.partial(
            pl.run_scoped,
            pipeline_buffers=buffers,
            out_smem=plgpu.SMEM((NUM_COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, store_cols), dtype,
                                transforms=out_transforms),
            collective_axes=_WARPGROUP_AXIS,
        )
        def scope(pipeline_buffers, out_smem):
            wg = lax.axis_index(_WARPGROUP_AXIS)

            @plgpu.nd_loop((num_groups * row_blocks * col_blocks,), collective_axes=_SM_AXIS)
            def tile_loop(loop_info):
                # A group's tiles are consecutive, so the SMs working at the same time read the same rows.
                group = loop_info.index[0] // (row_blocks * col_blocks)
                row_block, col_block = _striped_order(loop_info.index[0] % (row_blocks * col_blocks),
                                                      row_blocks, col_blocks, grid_tile_width)
                size = group_sizes_gmem[group]
                end = group_ends_gmem[group]
                start = end - size
                aligned_start = pl.multiple_of(start - start % ROW_ALIGNMENT, ROW_ALIGNMENT)
                num_steps = (end - aligned_start + block_k - 1) // block_k
                my_first_out_row = row_block * block_rows + wg * rows_per_warpgroup
                cols = pl.ds(col_block * block_n, block_n)

                def store_my_tile(values):
                    my_smem = out_smem.at[wg]
                    for first_row in range(0, rows_per_warpgroup, ROWS_PER_WARPGROUP):
                        for first_col in range(0, block_n, store_cols):
                            # The previous store (this tile's previous piece, or the previous tile's) read it.
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            my_smem[...] = values[first_row:first_row + ROWS_PER_WARPGROUP,
                                                  first_col:first_col + store_cols]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(my_smem, out_gmem.at[
                                group, pl.ds(my_first_out_row + first_row, ROWS_PER_WARPGROUP),
                                pl.ds(col_block * block_n + first_col, store_cols)])

                @pl.when(size > 0)
                def _matmul_tile():
                    def mma_step(step, lhs_smem, rhs_smem, acc_ref):
                        # This warpgroup's K columns of the lhs block: its slab of output rows.
                        my_lhs = lhs_smem.at[:, pl.ds(wg * rows_per_warpgroup, rows_per_warpgroup)]
                        # The block's rows [begin, end) are the group's; only the first and last steps
                        # have others.
                        step_start = aligned_start + step[0] * block_k
                        begin = start - step_start
                        stop = end - step_start

                        @pl.when((begin > 0) | (stop < block_k))
                        def _zero_rows_of_other_groups():
                            row = lax.broadcasted_iota(jnp.int32, (block_k, rows_per_warpgroup), 0)
                            keep = (row >= begin) & (row < stop)
                            my_lhs[...] = jnp.where(keep, my_lhs[...], jnp.zeros((), dtype))
                            plgpu.commit_smem()

                        plgpu.wgmma(acc_ref, plgpu.transpose_ref(my_lhs, (1, 0)), rhs_smem)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    def compute_context(run_pipeline):
                        @functools.partial(pl.run_scoped,
                                           acc_ref=plgpu.ACC((rows_per_warpgroup, block_n), jnp.float32))
                        def _(acc_ref):
                            run_pipeline(acc_ref)
                            store_my_tile(acc_ref[...].astype(dtype))

                    group_rows = pl.ds(aligned_start, num_rows)  # only its first num_steps blocks are read
                    make_pipeline(mma_step, compute_context, num_steps)(
                        lhs_gmem.at[group_rows, pl.ds(row_block * block_rows, block_rows)],
                        rhs_gmem.at[group_rows, cols], allocations=pipeline_buffers)

                @pl.when((size == 0) & (wg < NUM_COMPUTE_WARPGROUPS))
                def _empty_group():
                    store_my_tile(jnp.zeros((rows_per_warpgroup, block_n), dtype))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(body, jax.ShapeDtypeStruct((num_groups, out_rows, out_cols), dtype), num_sms)(
        group_ends.astype(jnp.int32), group_sizes.astype(jnp.int32), lhs, rhs)
