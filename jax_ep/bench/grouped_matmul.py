"""grouped_matmul: `jax_ep.grouped_matmul` in an expert SwiGLU. `python -m jax_ep.bench grouped_matmul [--groups 16 64]
[--m 24576 --d 2048 --f 1408] [--sweep] [--json PATH]`, or at MoE shapes by name: `--shapes moe-a v3 [--tokens 4096]
[--experts N ...]`.

Times the forward and backward pass of an expert SwiGLU block over M rows sorted by expert,

    gate, up = split(grouped_matmul(x, W_gate_up)); h = silu(gate) * up; y = grouped_matmul(h, W_down)
    y, and the pullback of a cotangent of y to x, W_gate_up [G, D, 2F] and W_down [G, F, D]
    (jax_ep.bench.swiglu.swiglu_forward_backward: y returned, as a layer returns it),

for each implementation ("pallas": jax_ep's kernels, "jax_pallas": JAX's, and "ragged_dot" at 16 groups or
fewer, or everywhere with --ragged-dot, since it is slow with many groups), with random group sizes (a
multinomial split of M with Dirichlet(1) weights, seeded) and with "aligned" sizes (every group a multiple
of 128 rows). A dense chain of the same matmuls ([M, D] x [D, 2F], [M, F] x [F, D], same backward) is the
roofline proxy (jax_ep.bench.swiglu). FLOPs: 3 x 2·M·(D·2F + F·D) (forward, dx and dw of both matmuls; useful
work only). Beside each figure, its roofline (jax_ep.bench.swiglu): the larger of the FLOPs at the dense chain's
rate and the expert weights' bytes, 3 x (G·D·2F + G·F·D) x 2 (read by the forward and by dx, written by dW), at the
HBM bandwidth of a copy timed first in the same run; the dense chain's own is that of one group.

The sizes come from --m, --d, --f and --groups (each G timed), or from --shapes (jax_ep.bench.swiglu.SHAPES, as
`bench moe` takes them): M = --tokens × K, the rows one rank gets at R=1, and G = E, or each of --experts instead.

Each figure is the median over --runs timed runs of --calls back-to-back calls each (after a warm-up),
rotating through --input-sets input sets so that consecutive calls never read the same data. Each input set has
group sizes of its own; their tensors (x, the cotangent, the weights) are made per group count, as many as fit a
memory budget (at least one, the other sets reusing them; `tensor_sets_within`), and freed before the next group
count. The budget: --memory-budget-gib, or MEMORY_BUDGET_FRACTION of the device memory free at that point
(memory_stats: bytes_limit - bytes_in_use), or DEFAULT_MEMORY_BUDGET where the device does not report it. Where
the tensors are larger than the L2 cache by far (v3's 256 experts: 22 GB a set), one set reads no less from HBM
than several. An implementation that runs out of memory anyway is reported as skipped.

--sweep instead times each grouped product alone (fwd, dx and dw of both matmuls) for every block
configuration of a small grid (`SWEEP_GRID`) and prints the best per shape as `BlockConfigRule`s to paste
into `jax_ep.grouped_matmul.BLOCK_CONFIG_TABLE`.

--ops instead times each grouped product alone, with the table's configuration, beside XLA's dense dot of the same
shape (one group's weights), for three layouts of the rows: "routed" (uniform routing counts rounded up to 8 rows,
as jax_ep.flax.MoE lays its groups out), "even" (M/G rows each: no group's last tile is partial) and "one" (every
row in group 0: the weights of one expert, which stay in L2). Beside each: its roofline, the larger of its FLOPs at
the dense dot's rate and the expert weights it reads or writes at the HBM bandwidth. routed against even is what
the groups' last tiles cost, even against one what streaming G experts' weights from HBM costs.

On a machine without a Hopper GPU only "ragged_dot" and the dense chain run (try --m 256 --d 128 --f 128, or
--shapes tiny --tokens 64).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.bench import harness, swiglu
from jax_ep.bench.swiglu import (
    DTYPE,
    SHAPES,
    SHAPES_TOKENS,
    Roofline,
    dense_swiglu_ms,
    expert_normal,
    expert_weight_bytes,
    hbm_gbps,
    hbm_text,
    make_inputs,
    normal,
    roofline,
    roofline_fields,
    roofline_text,
    shapes_help,
    swiglu_flops,
    swiglu_forward_backward,
)
from jax_ep.grouped_matmul import (
    GROUP_ROW_ALIGNMENT,
    OPS,
    PALLAS_KERNELS,
    BlockConfig,
    BlockConfigRule,
    block_config,
    config_unsupported_reason,
    grouped_matmul,
    grouped_op,
    pallas_grouped_op,
    pallas_unsupported_reason,
)

ALIGNMENT = 128  # rows: the "aligned" case's group sizes are multiples of this
# The problem without --shapes, where --m, --d, --f and --groups are not given.
DEFAULT_SIZES = dict(m=24576, d=2048, f=1408, groups=[16, 64])
# --sweep's block configurations per kernel family (those that do not fit a shape are skipped).
SWEEP_GRID = {
    "pallas": dict(block_m=(128,), block_n=(128, 256), block_k=(64,), num_stages=(3, 4, 5),
                   grid_tile_width=(1, 4, 8, 16)),
    "jax_pallas": dict(block_m=(64, 128), block_n=(128, 256), block_k=(64,), num_stages=(4,),
                       grid_tile_width=(1, 4, 8)),
}


class Problem(NamedTuple):
    """A SwiGLU to time at each of `groups`: M rows of D, hidden size F; `shape` names the SHAPES entry it comes
    from (None: --m/--d/--f/--groups)."""
    shape: str | None
    m: int
    d: int
    f: int
    groups: tuple[int, ...]


def problems(args) -> list[Problem]:
    """The problems that --shapes (with --tokens and --experts) or --m/--d/--f/--groups describe."""
    sizes = {name: getattr(args, name) for name in DEFAULT_SIZES if getattr(args, name) is not None}
    if args.shapes:
        if sizes:
            raise SystemExit(f"grouped_matmul: --shapes gives M, D, F and G; leave out "
                             f"{', '.join('--' + name for name in sizes)}")
        tokens = args.tokens or SHAPES_TOKENS
        return [Problem(name, tokens * SHAPES[name].topk, SHAPES[name].d_model, SHAPES[name].d_ff,
                        tuple(args.experts or [SHAPES[name].experts])) for name in args.shapes]
    if args.tokens is not None or args.experts:
        raise SystemExit("grouped_matmul: --tokens and --experts go with --shapes")
    sizes = {**DEFAULT_SIZES, **sizes}
    return [Problem(None, sizes["m"], sizes["d"], sizes["f"], tuple(sizes["groups"]))]


def random_group_sizes(rng: np.random.Generator, num_rows: int, groups: int, aligned: bool) -> np.ndarray:
    """A multinomial split of num_rows into `groups` sizes with Dirichlet(1) weights; with `aligned`, of the
    num_rows // ALIGNMENT blocks of ALIGNMENT rows (the remainder going to the last group)."""
    weights = rng.dirichlet(np.ones(groups))
    if not aligned:
        return rng.multinomial(num_rows, weights).astype(np.int32)
    sizes = rng.multinomial(num_rows // ALIGNMENT, weights) * ALIGNMENT
    sizes[-1] += num_rows % ALIGNMENT
    return sizes.astype(np.int32)


@functools.partial(jax.jit, static_argnames="implementation")
def grouped_swiglu_forward_backward(x, w_gate_up, w_down, cotangent, group_sizes, implementation):
    matmul = functools.partial(grouped_matmul, group_sizes=group_sizes, implementation=implementation)
    return swiglu_forward_backward(x, w_gate_up, w_down, cotangent, matmul)


# ---- memory -----------------------------------------------------------------------------------------------------

DEFAULT_MEMORY_BUDGET = 16 * 2 ** 30  # bytes, where the device does not report its memory (a CPU)
# Of the device memory free when a group count's tensors are made: room for what the estimate leaves out (XLA's
# workspace beyond the row temporaries, fragmentation of its pool).
MEMORY_BUDGET_FRACTION = 0.9


def input_set_bytes(m: int, d: int, f: int, groups: int) -> int:
    """The tensors of one input set, bf16: x and the cotangent [M, D], W_gate_up [G, D, 2F] and W_down [G, F, D]."""
    return 2 * (2 * m * d + groups * d * 2 * f + groups * f * d)


def call_bytes(m: int, d: int, f: int, groups: int) -> int:
    """What one call allocates beside its inputs: its outputs, bf16 (y and dx [M, D], dW_gate_up [G, D, 2F],
    dW_down [G, F, D]), and its row temporaries, at most float32 [M, 2F] three times (the gate and up activations,
    their gradient, and the product h [M, F] with its gradient) and [M, D] twice (y and its cotangent's product)."""
    return 2 * (2 * m * d + groups * d * 2 * f + groups * f * d) + 4 * m * (3 * 2 * f + 2 * d)


def tensor_sets_within(budget: int, requested: int, m: int, d: int, f: int, groups: int) -> int:
    """How many input sets' tensors fit `budget` bytes beside two calls' allocations (a call's outputs stay alive
    until the next call has been issued): at most `requested`, at least 1 (which may not fit)."""
    fitting = (budget - 2 * call_bytes(m, d, f, groups)) // input_set_bytes(m, d, f, groups)
    return max(1, min(requested, fitting))


def memory_budget(args, device) -> int:
    """Bytes the input sets' tensors and two calls may take on `device` (see the module's docstring)."""
    if args.memory_budget_gib is not None:
        return int(args.memory_budget_gib * 2 ** 30)
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return DEFAULT_MEMORY_BUDGET
    return int(MEMORY_BUDGET_FRACTION * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def unsupported_reason(implementation: str, m: int, d: int, f: int, groups: int) -> str | None:
    """Why `implementation` cannot run both matmuls of the block here, or None."""
    if implementation == "ragged_dot":
        return None
    for k, n in ((d, 2 * f), (f, d)):
        if reason := pallas_unsupported_reason((m, k), (groups, k, n), DTYPE, implementation):
            return reason
    return None


def run_block_benchmark(problem: Problem, args, report, gbps: float) -> None:
    """Every figure of `problem`, each with its roofline at `gbps` GB/s of HBM bandwidth."""
    m, d, f = problem.m, problem.d, problem.f
    at = dict(shape=problem.shape, m=m, d=d, f=f)  # every record's
    flops = swiglu_flops(m, d, f)
    dense_ms = dense_swiglu_ms(m, d, f, runs=args.runs, calls=args.calls, input_sets=args.input_sets, seed=args.seed)
    dense_tflops = flops / dense_ms / 1e9

    def figure(ms: float, groups: int) -> dict:
        weight_bytes = expert_weight_bytes(groups, d, f)
        return dict(ms=ms, tflops=flops / ms / 1e9, ratio_to_dense=dense_ms / ms,
                    **roofline_fields(ms, roofline(flops, dense_tflops, weight_bytes, gbps), weight_bytes, gbps))

    report(dict(at, case="dense", implementation="dense chain", groups=None, **figure(dense_ms, 1)))
    for groups in problem.groups:
        budget = memory_budget(args, jax.devices()[0])
        memory = dict(memory_budget_bytes=budget,
                      tensor_sets=tensor_sets_within(budget, args.input_sets, m, d, f, groups))
        peak = memory["tensor_sets"] * input_set_bytes(m, d, f, groups) + 2 * call_bytes(m, d, f, groups)
        print(f"G={groups}: the tensors of {memory['tensor_sets']} of the {args.input_sets} input sets in memory, "
              f"estimated peak {peak / 2**30:.3g} GiB, budget {budget / 2**30:.3g} GiB"
              + (" (over it: this may run out of memory)" if peak > budget else ""))
        tensors = [make_inputs(args.seed + i, m, d, f, groups) for i in range(memory["tensor_sets"])]
        rng = np.random.default_rng(args.seed + groups)
        for case in ("random", "aligned"):
            input_sets = [(*tensors[i % len(tensors)],
                           jnp.asarray(random_group_sizes(rng, m, groups, aligned=case == "aligned")))
                          for i in range(args.input_sets)]
            for implementation in (*PALLAS_KERNELS, "ragged_dot"):
                if implementation == "ragged_dot" and (case == "aligned" or (groups > 16 and not args.ragged_dot)):
                    continue
                what = dict(at, case=case, implementation=implementation, groups=groups)
                if reason := unsupported_reason(implementation, m, d, f, groups):
                    report(dict(what, skipped=reason))
                    continue
                fn = functools.partial(grouped_swiglu_forward_backward, implementation=implementation)
                try:
                    ms = harness.median_ms(fn, input_sets, args.runs, args.calls)
                except jax.errors.JaxRuntimeError as e:
                    if "RESOURCE_EXHAUSTED" not in str(e):
                        raise
                    report(dict(what, skipped=f"out of memory: {str(e).splitlines()[0][:200]}", **memory))
                    continue
                report(dict(what, **figure(ms, groups), **memory))
        del tensors, input_sets  # before the next group count's are made


def sweep_configs(kernels: str):
    grid = SWEEP_GRID[kernels]
    for values in itertools.product(*grid.values()):
        yield BlockConfig(**dict(zip(grid, values)))


def op_operands(op: str, x, w, dy):
    return {"fwd": (x, w), "dx": (dy, w), "dw": (x, dy)}[op]


def run_sweep(problem: Problem, args, report) -> list[str]:
    """Times every fitting config of SWEEP_GRID for each grouped product; returns the best as rules."""
    m, d, f = problem.m, problem.d, problem.f
    rules = []
    for groups, (k, n), kernels in itertools.product(problem.groups, ((d, 2 * f), (f, d)), args.sweep_kernels):
        if reason := pallas_unsupported_reason((m, k), (groups, k, n), DTYPE, kernels):
            report(dict(sweep=True, kernels=kernels, groups=groups, k=k, n=n, skipped=reason))
            continue
        keys = jax.random.split(jax.random.key(args.seed), 3)
        x, w, dy = normal(keys[0], (m, k)), expert_normal(keys[1], (groups, k, n), k ** -0.5), normal(keys[2], (m, n))
        rng = np.random.default_rng(args.seed + groups)
        sizes = [jnp.asarray(random_group_sizes(rng, m, groups, False)) for _ in range(args.input_sets)]
        for op in OPS:
            default = block_config(kernels, op, m, k, n, groups)
            timings = {}
            for config in sweep_configs(kernels):
                if config_unsupported_reason(kernels, op, config, m, k, n):
                    continue
                fn = jax.jit(functools.partial(pallas_grouped_op, op, kernels, config=config))
                try:
                    timings[config] = harness.median_ms(fn, [(*op_operands(op, x, w, dy), s) for s in sizes],
                                                runs=5, calls=5, warmup=1)
                except Exception as e:  # noqa: BLE001 (e.g. a config that overflows shared memory)
                    report(dict(sweep=True, kernels=kernels, op=op, groups=groups, k=k, n=n,
                                config=dataclasses.asdict(config), skipped=str(e).splitlines()[0][:200]))
            if not timings:
                continue
            best = min(timings, key=timings.get)
            op_flops = 2 * m * k * n
            report(dict(sweep=True, kernels=kernels, op=op, groups=groups, m=m, k=k, n=n,
                        best=dataclasses.asdict(best), best_ms=timings[best], best_tflops=op_flops / timings[best] / 1e9,
                        default_ms=timings.get(default), tried=len(timings)))
            rule = BlockConfigRule(kernels, op, (m, m), (k, k), (n, n), (groups, groups), best)
            rules.append(f"    {rule!r},  # {timings[best]:.3f} ms, {op_flops / timings[best] / 1e9:.0f} TFLOP/s")
    return rules


OPS_LAYOUTS = ("routed", "even", "one")
ROUTED_ALIGNMENT = GROUP_ROW_ALIGNMENT  # rows: jax_ep.flax.MoE's default expert_alignment


def layout_group_sizes(layout: str, rng: np.random.Generator, num_rows: int, groups: int) -> np.ndarray:
    """--ops's group sizes (see the module's docstring), summing to at most num_rows."""
    if layout == "one":
        return np.array([num_rows] + [0] * (groups - 1), np.int32)
    if layout == "even":
        return np.full(groups, num_rows // groups, np.int32)
    counts = rng.multinomial(max(num_rows - (ROUTED_ALIGNMENT - 1) * groups, 0), np.full(groups, 1 / groups))
    sizes = -(-counts // ROUTED_ALIGNMENT) * ROUTED_ALIGNMENT
    return np.diff(np.minimum(np.cumsum(sizes), num_rows), prepend=0).astype(np.int32)


def op_dense_dot(op: str):
    """XLA's dense dot of `op`'s shape, on `op_operands`' operands with the weights' first group."""
    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    return jax.jit({"fwd": lambda x, w: dot(x, w[0]), "dx": lambda dy, w: dot(dy, w[0].T),
                    "dw": lambda x, dy: dot(x.T, dy)}[op])


def run_ops(problem: Problem, args, report, gbps: float) -> None:
    """Each grouped product alone, per group count and layout, beside the dense dot of its shape."""
    m, d, f = problem.m, problem.d, problem.f
    for groups, (k, n) in itertools.product(problem.groups, ((d, 2 * f), (f, d))):
        keys = jax.random.split(jax.random.key(args.seed), 3)
        x, w, dy = normal(keys[0], (m, k)), expert_normal(keys[1], (groups, k, n), k ** -0.5), normal(keys[2], (m, n))
        rng = np.random.default_rng(args.seed + groups)
        sizes = {layout: jnp.asarray(layout_group_sizes(layout, rng, m, groups)) for layout in OPS_LAYOUTS}
        implementation = "ragged_dot" if unsupported_reason("pallas", m, d, f, groups) else "pallas"
        for op in OPS:
            operands = op_operands(op, x, w, dy)
            flops = 2 * m * k * n
            weight_bytes = groups * k * n * jnp.dtype(DTYPE).itemsize  # read by fwd and dx, written by dw
            dense_ms = harness.median_ms(op_dense_dot(op), [operands], args.runs, args.calls)
            problem_shape = (m, k, n, groups)
            at = dict(ops=True, shape=problem.shape, op=op, m=m, k=k, n=n, groups=groups,
                      implementation=implementation, dense_ms=dense_ms)
            for layout in OPS_LAYOUTS:
                fn = jax.jit(functools.partial(grouped_op, op, implementation, problem_shape=problem_shape))
                ms = harness.median_ms(fn, [(*operands, sizes[layout])], args.runs, args.calls)
                bound = roofline(flops, flops / dense_ms / 1e9, weight_bytes, gbps)
                report(dict(at, layout=layout, ms=ms, ratio_to_dense=ms / dense_ms,
                            **roofline_fields(ms, bound, weight_bytes, gbps)))
        del x, w, dy


def _print_record(record) -> None:
    if record.get("ops"):
        bound = Roofline(record["roofline_compute_ms"], record["roofline_memory_ms"])
        print(f"G={record['groups']:<4} {record['op']:3s} K={record['k']:<5} N={record['n']:<5} {record['layout']:6s} "
              f"{record['implementation']}: {record['ms']:8.3f} ms, {record['ratio_to_dense']:.2f}x the dense dot "
              f"({record['dense_ms']:.3f} ms); {record['ratio_to_roofline']:.2f}x the {roofline_text(bound)}")
    elif record.get("sweep"):
        where = f"{record['kernels']:10s} G={record['groups']:<3} K={record['k']:<5} N={record['n']:<5}"
        if "skipped" in record:
            print(f"sweep {where} {record.get('op', '')}: skipped ({record['skipped']})")
        else:
            default = record["default_ms"]
            print(f"sweep {where} {record['op']:3s}: best {record['best_ms']:.3f} ms ({record['best_tflops']:.0f} "
                  f"TFLOP/s, default {'-' if default is None else f'{default:.3f} ms'}, {record['tried']} configs) "
                  f"{record['best']}")
    elif "skipped" in record:
        print(f"G={record['groups']:<3} {record['case']:8s} {record['implementation']:11s} skipped: {record['skipped']}")
    else:
        groups = "" if record["groups"] is None else f"G={record['groups']}"
        bound = Roofline(record["roofline_compute_ms"], record["roofline_memory_ms"])
        print(f"{groups:5s} {record['case']:8s} {record['implementation']:11s} {record['ms']:9.3f} ms "
              f"{record['tflops']:7.1f} TFLOP/s  {record['ratio_to_dense']:.2f}x dense's speed; "
              f"{record['ratio_to_roofline']:.2f}x the {roofline_text(bound)}")


# Options that size the problem: at their defaults the mode refuses to run without GPUs (harness).
GPU_SIZES = ("m", "d", "f", "groups", "shapes", "tokens", "experts")
GPU_SHAPES = swiglu.GPU_SHAPES  # naming them keeps a run at GPU sizes


def add_arguments(parser) -> None:
    # Their defaults are DEFAULT_SIZES, taken where --shapes is not given (None here tells a given option apart).
    parser.add_argument("--groups", type=int, nargs="+", help=f"default {' '.join(map(str, DEFAULT_SIZES['groups']))}")
    parser.add_argument("--m", type=int,
                        help=f"rows (tokens x top-k routed to this rank; default {DEFAULT_SIZES['m']})")
    parser.add_argument("--d", type=int, help=f"model dimension (default {DEFAULT_SIZES['d']})")
    parser.add_argument("--f", type=int, help=f"expert hidden dimension (default {DEFAULT_SIZES['f']})")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES,
                        help=f"MoE shapes by name, instead of --m/--d/--f/--groups: {shapes_help()}")
    parser.add_argument("--tokens", type=int,
                        help=f"with --shapes: tokens per rank (default {SHAPES_TOKENS}); M = tokens x K")
    parser.add_argument("--experts", type=int, nargs="+",
                        help="with --shapes: the group counts to time instead of each shape's E")
    parser.add_argument("--sweep", action="store_true", help="time block configurations instead (see above)")
    parser.add_argument("--ops", action="store_true",
                        help="time each grouped product alone beside the dense dot of its shape instead (see above)")
    parser.add_argument("--sweep-kernels", nargs="+", choices=PALLAS_KERNELS, default=["pallas"],
                        help="with --sweep: the kernel families to sweep")
    parser.add_argument("--ragged-dot", action="store_true", help="time ragged_dot at more than 16 groups too")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per figure (the median is reported)")
    parser.add_argument("--calls", type=int, default=5, help="back-to-back calls per timed run")
    parser.add_argument("--input-sets", type=int, default=3,
                        help="input sets the calls rotate through, each with group sizes of its own; the tensors of "
                             "as many as fit the memory budget, the others reusing them (see above)")
    parser.add_argument("--memory-budget-gib", type=float,
                        help="GiB that the input sets' tensors and two calls' outputs and temporaries may take "
                             f"(default: {100 * MEMORY_BUDGET_FRACTION:.0f}%% of the device memory free, or "
                             f"{DEFAULT_MEMORY_BUDGET / 2**30:.0f} GiB where the device does not report it)")
    parser.add_argument("--seed", type=int, default=0)
    harness.add_output_arguments(parser)


def run(args) -> dict:
    device = jax.devices()[0]
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}, {jnp.dtype(DTYPE).name}"
          + ("; --sweep: each grouped product alone" if args.sweep else ""))
    records = []

    def report(record):
        records.append(record)
        _print_record(record)
        sys.stdout.flush()

    header = dict(device=device.device_kind, jax=jax.__version__, dtype=jnp.dtype(DTYPE).name, runs=args.runs,
                  calls=args.calls)
    if args.sweep and args.ops:
        raise SystemExit("grouped_matmul: --sweep and --ops are two modes; give one")
    if not args.sweep:
        header["hbm_gbps"], header["hbm_copy_bytes"] = hbm_gbps(args.runs, args.calls)
        print(hbm_text(header["hbm_gbps"], header["hbm_copy_bytes"]))
    rules = []
    for problem in problems(args):
        print(("" if problem.shape is None else f"{problem.shape}: ") + f"M={problem.m} D={problem.d} F={problem.f} "
              f"G={' '.join(map(str, problem.groups))}; SwiGLU forward+backward = "
              f"{swiglu_flops(problem.m, problem.d, problem.f) / 1e12:.3f} TFLOP")
        if args.sweep:
            rules += run_sweep(problem, args, report)
        elif args.ops:
            run_ops(problem, args, report, header["hbm_gbps"])
        else:
            run_block_benchmark(problem, args, report, header["hbm_gbps"])
    if rules:
        print("\n# Best configurations, for jax_ep.grouped_matmul.BLOCK_CONFIG_TABLE:")
        print("\n".join(rules))
    return dict(header, records=records)
