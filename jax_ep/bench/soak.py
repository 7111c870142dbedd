"""soak: many jitted dispatch + combine steps on one Buffer, for leaks and repeatability.

One step is one call of a jitted program: normal dispatch of the tokens, then combine of the received rows (the
Buffer's backend: the cuda kernels where they were built and the devices are GPUs, else the xla backend), with the
same inputs every time. Printed per process: device memory in use (JAX's memory_stats of this process's devices)
and host resident memory (VmRSS) after the warm-up and after --steps steps, and their growth; and whether the first
--bitwise-steps steps' outputs all equal the first step's bit for bit (compared on the device: one flag carried
from step to step, read once at the end). --processes N runs one process per GPU (--allow-shared-gpu where ranks
share a GPU: correctness only, as every mode labels it).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep.bench import harness

WARMUP_STEPS = 20  # compile, and let allocators reach their working set before the first reading


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048, help="default %(default)s")
    parser.add_argument("--topk", type=int, default=6, help="default %(default)s")
    parser.add_argument("--experts", type=int, default=64, help="default %(default)s")
    parser.add_argument("--steps", type=int, default=10_000, help="steps after the warm-up (default %(default)s)")
    parser.add_argument("--bitwise-steps", type=int, default=1_000,
                        help="steps whose outputs are compared with the first step's (default %(default)s)")
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


def run(args) -> dict:
    mesh = harness.ep_mesh(args)
    num_ranks = mesh.devices.size
    _, topk_idx, x, _ = harness.routed_tokens(mesh, args)
    rng = np.random.default_rng(1)
    weights = harness.global_array(mesh, rng.random((num_ranks * args.tokens, args.topk), dtype=np.float32))
    buffer = jax_ep.Buffer(mesh, "ep", num_experts=args.experts)

    def body(x, topk_idx, weights):
        d = jax_ep.dispatch(buffer, x, topk_idx, weights)
        out = jax_ep.combine(buffer, d.recv_x, d.handle, topk_weights=d.recv_topk_weights)
        return out.x, out.topk_weights

    step = harness.spmd(mesh, body)
    same = harness.spmd(mesh, lambda a, b, flag: flag & jnp.all(a == b)[None])

    first = jax.block_until_ready(step(x, topk_idx, weights))
    equal = harness.global_array(mesh, np.ones(num_ranks, bool))
    for _ in range(WARMUP_STEPS):
        out = step(x, topk_idx, weights)
        jax.block_until_ready((same(out[0], first[0], equal), same(out[1], first[1], equal)))
    start_device, start_host = _device_bytes_in_use(mesh), _host_rss_bytes()
    out = first
    for i in range(args.steps):
        out = step(x, topk_idx, weights)
        if i < args.bitwise_steps:
            equal = same(out[0], first[0], same(out[1], first[1], equal))
    jax.block_until_ready(out)
    end_device, end_host = _device_bytes_in_use(mesh), _host_rss_bytes()
    bitwise = all(bool(np.all(np.asarray(shard.data))) for shard in equal.addressable_shards)
    record = dict(backend=buffer.backend, num_ranks=num_ranks, process_model=harness.process_model(args),
                  tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts, steps=args.steps,
                  device_bytes=[start_device, end_device], host_rss_bytes=[start_host, end_host],
                  bitwise_steps=min(args.bitwise_steps, args.steps), bitwise_identical=bitwise)
    print(f"[soak] process {jax.process_index()}: {num_ranks} ranks ({record['process_model']}, {buffer.backend} "
          f"backend), T={args.tokens} H={args.hidden} K={args.topk} E={args.experts}: {args.steps} steps of "
          f"dispatch + combine after {WARMUP_STEPS} warm-up steps", flush=True)
    print(f"[soak] process {jax.process_index()}: device memory in use {start_device / 2**20:.1f} -> "
          f"{end_device / 2**20:.1f} MiB ({(end_device - start_device) / 2**20:+.1f}); host resident "
          f"{start_host / 2**20:.1f} -> {end_host / 2**20:.1f} MiB ({(end_host - start_host) / 2**20:+.1f})", flush=True)
    print(f"[soak] process {jax.process_index()}: the first {record['bitwise_steps']} steps' outputs equal the "
          f"first step's bit for bit: {bitwise}", flush=True)
    buffer.destroy()
    return record
