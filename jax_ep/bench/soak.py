"""soak: many jitted steps with the same inputs, for leaks and repeatability: dispatch + combine on one Buffer, or
with --block the Flax MoE block's training step.

One step is one call of a jitted program with the same inputs every time: normal dispatch of the tokens, then
combine of the received rows (the Buffer's backend: the cuda kernels where they were built and the devices are GPUs,
else the xla backend); or, with --block, jax_ep.flax.MoE's forward + backward at D=--hidden, F=--d-ff, E=--experts,
K=--topk (the gradients of every parameter and of x; --dispatcher, --num-chunks). Printed per process: device memory
in use (JAX's memory_stats of this process's devices) and host resident memory (VmRSS) after the warm-up and after
--steps steps, and their growth; and whether the first --bitwise-steps steps' outputs all equal the first step's bit
for bit (each rank compares its own shards on its device: a flag it carries from step to step, read once at the
end; a process other than 0 whose ranks saw a change fails, so that the launcher shows it). --processes N runs one
process per GPU (--allow-shared-gpu where ranks share a GPU: correctness only, as every mode labels it; not with
--block, whose step needs XLA's collectives across the ranks, and NCCL refuses two ranks on one GPU).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.bench import harness

WARMUP_STEPS = 20  # compile, and let allocators reach their working set before the first reading
# --block's options where not given (F of moe-a, whose D, E and K are --hidden's, --experts' and --topk's defaults).
BLOCK_DEFAULTS = dict(d_ff=1408, dispatcher="normal", num_chunks=1)


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048, help="default %(default)s")
    parser.add_argument("--topk", type=int, default=6, help="default %(default)s")
    parser.add_argument("--experts", type=int, default=64, help="default %(default)s")
    parser.add_argument("--steps", type=int, default=10_000, help="steps after the warm-up (default %(default)s)")
    parser.add_argument("--bitwise-steps", type=int, default=1_000,
                        help="steps whose outputs are compared with the first step's (default %(default)s)")
    parser.add_argument("--block", action="store_true",
                        help="soak jax_ep.flax.MoE's training step (forward + backward) instead of dispatch + combine")
    parser.add_argument("--d-ff", type=int, help=f"with --block: the experts' hidden size F (default "
                                                  f"{BLOCK_DEFAULTS['d_ff']})")
    parser.add_argument("--dispatcher", choices=("normal", "xla"),
                        help=f"with --block: the block's dispatcher (default {BLOCK_DEFAULTS['dispatcher']})")
    parser.add_argument("--num-chunks", type=int,
                        help=f"with --block: the block's num_chunks (default {BLOCK_DEFAULTS['num_chunks']})")
    harness.add_output_arguments(parser)


def _host_rss_bytes() -> int:
    """This process's resident set (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            return int(re.search(r"VmRSS:\s+(\d+) kB", status.read()).group(1)) * 1024
    except (OSError, AttributeError):
        return 0


def _device_bytes_in_use(mesh) -> int:
    """Bytes in use on this process's devices of the mesh, as JAX's allocator counts them (0 where it does not)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return sum((d.memory_stats() or {}).get("bytes_in_use", 0) for d in local)


def _dispatch_combine(mesh, args):
    """The dispatch + combine step, its inputs, its Buffer and what it is (for the printout and the record)."""
    num_ranks = mesh.devices.size
    _, topk_idx, x, _ = harness.routed_tokens(mesh, args)
    rng = np.random.default_rng(1)
    weights = harness.global_array(mesh, rng.random((num_ranks * args.tokens, args.topk), dtype=np.float32))
    buffer = jax_ep.Buffer(mesh, "ep", num_experts=args.experts)

    def body(x, topk_idx, weights):
        d = jax_ep.dispatch(buffer, x, topk_idx, weights)
        out = jax_ep.combine(buffer, d.recv_x, d.handle, topk_weights=d.recv_topk_weights)
        return out.x, out.topk_weights

    return harness.spmd(mesh, body), (x, topk_idx, weights), buffer, "dispatch + combine", {}


def _block(mesh, args):
    """The MoE block's training step, its inputs, its Buffer and what it is."""
    from flax import nnx  # flax is optional: the dispatch + combine soak runs without it

    from jax_ep.bench import moe as moe_mode
    from jax_ep.bench.swiglu import MoEShape

    options = {name: default if getattr(args, name) is None else getattr(args, name)
               for name, default in BLOCK_DEFAULTS.items()}
    shape = MoEShape(args.hidden, options["d_ff"], args.experts, args.topk)
    block = moe_mode.make_block(mesh, shape, options["dispatcher"], options["num_chunks"])
    x, cotangent = moe_mode.block_inputs(mesh, args.tokens, shape.d_model)
    what = (f"the MoE block's forward + backward at F={shape.d_ff} ({options['dispatcher']} dispatcher, "
            f"num_chunks={options['num_chunks']})")
    return moe_mode.block_step(block), (nnx.state(block), x, cotangent), block.buffer, what, options


def _bits(x: jax.Array) -> jax.Array:
    """x's bits, as unsigned integers of its width where it is a float (so that -0 differs from 0, and nan equals
    itself where its bits do)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}"))


def _comparison(mesh, first):
    """The first flags (one per rank, True) and a jitted still_equal(flags, out, first): each rank's flag and whether
    its shards of every leaf of out have first's bits. Each rank compares only its own shards, so the comparison runs
    no collective across the ranks: XLA's would be NCCL's, which refuses ranks that share a GPU."""
    ranks = P("ep")  # harness.global_array's sharding of the flags
    specs = jax.tree.map(lambda leaf: leaf.sharding.spec if isinstance(leaf.sharding, NamedSharding) else P(), first)

    def local(flag, out, first):
        leaves = zip(jax.tree.leaves(out), jax.tree.leaves(first))
        return flag & jnp.all(jnp.stack([jnp.all(_bits(a) == _bits(b)) for a, b in leaves]))

    still_equal = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(ranks, specs, specs), out_specs=ranks))
    return harness.global_array(mesh, np.ones(mesh.devices.size, bool)), still_equal


def shared_gpu_refusal(args) -> str | None:
    """Why this run cannot have ranks share a GPU (harness.run asks before it launches the processes), or None."""
    return f"--block's training step: {harness.NEEDS_NCCL}" if args.block else None


def run(args) -> dict:
    given = [f"--{name.replace('_', '-')}" for name in BLOCK_DEFAULTS if getattr(args, name) is not None]
    if given and not args.block:
        raise SystemExit(f"soak: {', '.join(given)}: only with --block")
    mesh = harness.ep_mesh(args)
    num_ranks = mesh.devices.size
    step, inputs, buffer, what, block_fields = (_block if args.block else _dispatch_combine)(mesh, args)
    with buffer:  # a cuda Buffer's memory lies outside XLA's pool: freed at the end
        first = jax.block_until_ready(step(*inputs))
        equal, still_equal = _comparison(mesh, first)
        out = first
        for _ in range(WARMUP_STEPS):
            out = step(*inputs)
            jax.block_until_ready(still_equal(equal, out, first))
        # Both readings are taken with the same arrays alive (the first step's outputs and one later step's), so that
        # an output as large as the block's weight gradients does not read as growth.
        start_device, start_host = _device_bytes_in_use(mesh), _host_rss_bytes()
        for i in range(args.steps):
            out = step(*inputs)
            if i < args.bitwise_steps:
                equal = still_equal(equal, out, first)
        jax.block_until_ready((out, equal))
        end_device, end_host = _device_bytes_in_use(mesh), _host_rss_bytes()
        bitwise = all(bool(np.asarray(shard.data).all()) for shard in equal.addressable_shards)
        backend = buffer.backend
    record = dict(mode="block" if args.block else "dispatch + combine", backend=backend, num_ranks=num_ranks,
                  process_model=harness.process_model(args), tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                  experts=args.experts, **block_fields, steps=args.steps, device_bytes=[start_device, end_device],
                  host_rss_bytes=[start_host, end_host], bitwise_steps=min(args.bitwise_steps, args.steps),
                  bitwise_identical=bitwise)
    print(f"[soak] process {jax.process_index()}: {num_ranks} ranks ({record['process_model']}, {backend} "
          f"backend), T={args.tokens} H={args.hidden} K={args.topk} E={args.experts}: {args.steps} steps of {what} "
          f"after {WARMUP_STEPS} warm-up steps", flush=True)
    print(f"[soak] process {jax.process_index()}: device memory in use {start_device / 2**20:.1f} -> "
          f"{end_device / 2**20:.1f} MiB ({(end_device - start_device) / 2**20:+.1f}); host resident "
          f"{start_host / 2**20:.1f} -> {end_host / 2**20:.1f} MiB ({(end_host - start_host) / 2**20:+.1f})", flush=True)
    print(f"[soak] process {jax.process_index()}: the first {record['bitwise_steps']} steps' outputs equal the "
          f"first step's bit for bit: {bitwise}", flush=True)
    if not bitwise and jax.process_index() != 0:
        # The launcher shows a worker's output only when it fails; process 0 prints its own ranks' answer.
        raise SystemExit(f"soak: process {jax.process_index()}: its ranks' outputs changed bits between steps")
    return record
