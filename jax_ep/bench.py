"""Benchmarks: `python -m jax_ep.bench intranode [--sms 24 32 ...] [--processes N] [--json PATH]` and
`python -m jax_ep.bench low_latency [--backend auto] [--processes N] [--json PATH]`.

intranode: normal-mode dispatch (BF16 and the FP8 pair) and combine (BF16) over every local GPU of this
process, DeepEP's shape by default (T=4096, H=7168, K=8, E=256), for the `cuda` backend at each `--sms` value
and the pure-JAX baselines. Each op runs in jitted sequences of `--iters` and 2×`--iters` ops; time per op =
the difference of their wall times / iters after a warm-up, median over `--repeats` runs. Bandwidth is
counted as DeepEP counts it (docs/design.md): received rows × H × 2 bytes for BF16 (dispatch and combine),
× (1 + 4/128) / 2 of that for FP8, per rank, averaged over ranks.

low_latency: DeepEP's decode shape (T=128, H=7168, K=8, E=288): FP8 and BF16 low-latency dispatch and the
weighted BF16 combine of the Buffer's backend (`--backend`, which implementation ran is printed), timed the
same way; the send/receive split as the part of each op that independent compute between the halves hides;
then the pure-JAX baselines (the `xla` backend's low-latency ops, dense all_to_all, ragged_all_to_all) and
the speedup over the best of them. Bytes as DeepEP counts them per valid (token, expert) pair: H + H/128·4 +
16 (FP8 dispatch), 2H (BF16 dispatch, combine), on the sending rank, averaged over ranks.

internode: the internode normal mode (NVSHMEM between nodes, NVLink inside them; one process per GPU, so with
--processes), DeepEP's internode shape by default (T=4096, H=7168, K=8, E=256), on nodes of --ranks-per-node
GPUs (default: the GPUs of each host). Bandwidth as DeepEP's test_internode counts it, per rank, averaged over
ranks: "RDMA" = (token, destination node) pairs, the token's own node included, x row bytes; "NVL" = received
rows x row bytes (BF16: 2H, FP8: H (1 + 4/128)); combine the same as the dispatch it reverses. On one host
(e.g. 4 GPUs as 2 nodes x 2) the "RDMA" traffic is NVSHMEM over NVLink, not a network figure.

Process models (docs/design.md, "Process models"): by default one process drives every local GPU. With
`--processes N` this command is a launcher: it starts N copies of itself, process i owning GPU i mod G (G: the
host's GPUs, or `--gpus G`), joined through `jax.distributed` on localhost, which run the same measurements over
the global mesh (collectively: the same programs in the same order); process 0 prints and writes --json/--plot,
the others' output is shown only when they fail. More processes than GPUs means ranks share GPUs, whose timings
are not performance figures: the launcher refuses unless given `--allow-shared-gpu`, and then every line printed
starts with that warning and every JSON record carries it. With JAX_PLATFORMS=cpu each process owns one CPU
device and collectives go through gloo (for testing). Across hosts, run the launcher on every host with
`--nodes M --node-rank i --coordinator HOST:PORT` (host 0's address): host i starts processes i*N .. i*N+N-1 of
the M*N.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import cuda_backend, cuda_low_latency, environment, internode
from jax_ep.config import FP8_GROUP


def _process_model(args) -> str:
    return "one process per GPU" if args.processes else "one process, all GPUs"


def _mesh(args) -> Mesh:
    """The EP mesh: with --processes every device of the job (one per process), else this process's devices."""
    devices = jax.devices() if args.processes else jax.local_devices()[: args.ranks or None]
    if args.processes and len(devices) != args.processes * args.nodes:
        raise RuntimeError(f"--processes {args.processes} on {args.nodes} host(s): the job has {len(devices)} devices, "
                           "want one per process")
    return Mesh(np.array(devices), ("ep",))


def _global(mesh: Mesh, values: np.ndarray) -> jax.Array:
    """`values` (the whole [R*n, ...] input, identical in every process: same seed) as a global array, rows
    sharded over the EP axis; each process transfers only the rows of its own devices."""
    return jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("ep")), lambda index: values[index],
                                        dtype=values.dtype)


def _topk_idx(rng: np.random.Generator, num_ranks: int, num_tokens: int, num_topk: int, num_experts: int) -> np.ndarray:
    """DeepEP's test routing: the top-k of random scores, so every token has k distinct experts."""
    scores = rng.random((num_ranks * num_tokens, num_experts))
    return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def _spmd(mesh: Mesh, body):
    # check_vma off: the loop carries start as zeros, which are not varying over the EP axis.
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=False))


def _depend(tree, value):
    """`tree` with a run-time zero derived from `value` added to every integer leaf (the routing, small unlike
    the payloads), so consecutive ops can neither be merged (CSE), hoisted nor overlapped."""
    zero = jnp.asarray(value, jnp.float32) * 0
    return jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.integer) else a, tree)


def _touch(data, value):
    """`data` with a run-time zero derived from `value` added to one element of every floating array: a
    one-element in-place update, so a payload path that does not depend on the routing (an all_gather of x)
    cannot be computed once for a whole timed sequence."""
    zero = jnp.asarray(value, jnp.float32) * 0
    return jax.tree.map(lambda a: a.at[(0,) * a.ndim].add(zero.astype(a.dtype))
                        if jnp.issubdtype(a.dtype, jnp.floating) else a, data)


def _timed_loop(mesh, op, iters: int, unroll: bool = True, chain_data: bool = False):
    """jit(shard_map(...)) running `op(routing, *data)` `iters` times in a row, unrolled: an XLA while loop
    adds a host round trip per iteration, which is the loop's cost, not the op's (the ragged_all_to_all
    baseline keeps the loop: unrolled, XLA reserves collective memory for every call). One element of each
    op's output feeds the next op's routing (and with `chain_data` one element of every floating data
    array, see `_touch`). A custom call always writes all its outputs; for the pure-JAX
    baselines XLA may skip local work after the collective that the probe does not need (which only
    flatters them)."""

    def body(routing, *data):
        def step(_, carry):
            routing, data, total = carry
            out = op(routing, *data)
            probe = jax.tree.leaves(out)[0].ravel()[0].astype(jnp.float32)
            return _depend(routing, probe), _touch(data, probe) if chain_data else data, total + probe

        return jax.lax.fori_loop(0, iters, step, (routing, data, jnp.float32(0)), unroll=unroll)[2][None]

    return _spmd(mesh, body)


def _time_per_op(mesh, op, fn_args, args, unroll: bool = True, before_timing=None, chain_data: bool = False) -> float:
    """Seconds per op: (time of a sequence of 2n ops - time of n ops) / n, median over repeats. The fixed
    cost of launching a program on every device and waiting for it cancels out."""
    short, long = (_timed_loop(mesh, op, n, unroll, chain_data) for n in (args.iters, 2 * args.iters))
    for fn in (short, long):
        jax.block_until_ready(fn(*fn_args))  # compile and warm up
    if before_timing:
        before_timing()

    def wall(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        return time.perf_counter() - start

    return statistics.median((wall(long) - wall(short)) / args.iters for _ in range(args.repeats))


def _timed_with_kernels(mesh, op, fn_args, args, kernel_times) -> tuple[float, float]:
    """(in-jit seconds per op, bare kernel seconds per op) of a jax_ep kernel op; kernel_times(reset=False) gives
    [(calls, summed ns)] per GPU of this process (the kernels' own %globaltimer spans)."""
    seconds = _time_per_op(mesh, op, fn_args, args, before_timing=lambda: kernel_times(reset=True))
    return seconds, float(np.mean([ns / calls for calls, ns in kernel_times()])) * 1e-9


# ---- pure-JAX baselines (per rank, inside shard_map) ----------------------------------------------------------

def _ragged_routing(topk_idx, num_experts: int):
    """MaxText-style routing: one row per (token, k), sorted by expert, and the ragged_all_to_all sizes."""
    num_ranks, me = jax.lax.axis_size("ep"), jax.lax.axis_index("ep")
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    send_sizes = jnp.bincount(flat // (num_experts // num_ranks), length=num_ranks).astype(jnp.int32)
    sizes = jax.lax.all_gather(send_sizes, "ep")  # [source, destination]
    return dict(order=order, send_sizes=send_sizes, recv_sizes=sizes[:, me],
                input_offsets=jnp.cumsum(send_sizes) - send_sizes,  # where each destination's rows start here
                output_offsets=(jnp.cumsum(sizes, axis=0) - sizes)[me],  # where they land on each destination
                return_offsets=(jnp.cumsum(sizes, axis=1) - sizes)[:, me])  # where each source's rows started there


def _ragged_dispatch(topk_idx, x, *, num_experts):
    routing = _ragged_routing(topk_idx, num_experts)
    rows = topk_idx.size
    sent = jnp.take(x, routing["order"] // topk_idx.shape[1], axis=0)
    out = jnp.zeros((jax.lax.axis_size("ep") * rows, x.shape[1]), x.dtype)
    return jax.lax.ragged_all_to_all(sent, out, routing["input_offsets"], routing["send_sizes"],
                                     routing["output_offsets"], routing["recv_sizes"], axis_name="ep")


def _ragged_combine(routing, y):
    """Reverse exchange of the received rows, unsort, unweighted sum over k."""
    num_tokens_k = routing["order"].shape[0]
    recv_offsets = jnp.cumsum(routing["recv_sizes"]) - routing["recv_sizes"]
    back = jax.lax.ragged_all_to_all(y, jnp.zeros((num_tokens_k, y.shape[1]), y.dtype), recv_offsets,
                                     routing["recv_sizes"], routing["return_offsets"], routing["send_sizes"],
                                     axis_name="ep")
    unsorted = jnp.zeros_like(back).at[routing["order"]].set(back)
    num_topk = routing["num_topk"].shape[0]
    return jnp.sum(unsorted.reshape(-1, num_topk, y.shape[1]).astype(jnp.float32), axis=1).astype(y.dtype)


def _dense_dispatch(topk_idx, x, *, num_experts):
    """Every token to every rank that holds one of its experts, in a dense [R, T, H] all_to_all."""
    num_ranks = jax.lax.axis_size("ep")
    in_rank = jnp.any(topk_idx[:, :, None] // (num_experts // num_ranks) == jnp.arange(num_ranks), axis=1)
    send = jnp.where(in_rank.T[:, :, None], x[None], jnp.zeros((), x.dtype))
    return jax.lax.all_to_all(send, "ep", 0, 0)


def _dense_combine(in_rank, y):
    back = jax.lax.all_to_all(jnp.where(in_rank.T[:, :, None] >= 0, y, 0), "ep", 0, 0)
    out = jnp.zeros(back.shape[1:], jnp.float32)
    for r in range(back.shape[0]):
        out = out + back[r].astype(jnp.float32)
    return out.astype(y.dtype)


def _baseline_times(mesh, args, topk_idx, x, num_experts, fp8: bool = False, chain_data: bool = False,
                    ops=("dispatch", "combine")):
    """Yields (backend, op, payload, seconds per op) for the pure-JAX baselines of `ops` (MaxText-style
    ragged_all_to_all, dense all_to_all; with `fp8` also the dense dispatch of the FP8 pair), or
    (backend, op or None, payload or None, why it did not run)."""
    num_ranks, (num_tokens, hidden) = mesh.devices.size, (topk_idx.shape[0] // mesh.devices.size, x.shape[1])
    ragged = "jax ragged_all_to_all"
    if mesh.devices.flat[0].platform == "cpu":
        yield ragged, None, None, "not run (XLA:CPU has no ragged-all-to-all)"
    else:
        try:
            if "dispatch" in ops:
                yield ragged, "dispatch", "BF16", _time_per_op(
                    mesh, functools.partial(_ragged_dispatch, num_experts=num_experts), (topk_idx, x), args,
                    unroll=False, chain_data=chain_data)
            if "combine" in ops:
                routing = _spmd(mesh, lambda i: {**_ragged_routing(i, num_experts),
                                                 "num_topk": jnp.zeros((i.shape[1],), jnp.int32)})(topk_idx)
                y_ragged = _spmd(mesh, functools.partial(_ragged_dispatch, num_experts=num_experts))(topk_idx, x)
                yield ragged, "combine", "BF16", _time_per_op(mesh, _ragged_combine, (routing, y_ragged), args,
                                                              unroll=False, chain_data=chain_data)
        except Exception as e:  # noqa: BLE001 -- a baseline that XLA cannot run is reported, not fatal
            yield ragged, None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    dense = "jax all_to_all"
    if "dispatch" in ops:
        yield dense, "dispatch", "BF16", _time_per_op(
            mesh, functools.partial(_dense_dispatch, num_experts=num_experts), (topk_idx, x), args,
            chain_data=chain_data)
        if fp8:
            def dense_fp8(idx, data):
                e4m3, scales = jax_ep.per_token_cast_to_fp8(data)
                # The e4m3 bytes travel as uint8: the same bytes, and a type every collective library has.
                return tuple(_dense_dispatch(idx, leaf, num_experts=num_experts)
                             for leaf in (jax.lax.bitcast_convert_type(e4m3, jnp.uint8), scales))

            yield dense, "dispatch", "FP8", _time_per_op(mesh, dense_fp8, (topk_idx, x), args, chain_data=chain_data)
    if "combine" in ops:
        y_dense = _spmd(mesh, functools.partial(_dense_dispatch, num_experts=num_experts))(topk_idx, x).reshape(
            -1, hidden)
        in_rank = _spmd(mesh, lambda i: jnp.any(i[:, :, None] // (num_experts // num_ranks) == jnp.arange(num_ranks),
                                                axis=1).astype(jnp.int32) - 1)(topk_idx)
        yield dense, "combine", "BF16", _time_per_op(
            mesh, lambda r, y: _dense_combine(r, y.reshape(num_ranks, num_tokens, hidden)), (in_rank, y_dense), args,
            chain_data=chain_data)


def intranode(args) -> list[dict]:
    mesh = _mesh(args)
    devices, num_ranks = list(mesh.devices.flat), mesh.devices.size
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    rng = np.random.default_rng(0)
    topk_idx_host = _topk_idx(rng, num_ranks, T, K, E)
    topk_idx = _global(mesh, topk_idx_host)
    x = _global(mesh, rng.standard_normal((num_ranks * T, H), dtype=np.float32).astype(jnp.bfloat16))
    x_fp8 = _spmd(mesh, jax_ep.per_token_cast_to_fp8)(x)
    # Kernel times are per device of this process: with one process per GPU, process 0's GPU (which prints).
    kernel_device = "process 0's GPU" if args.processes else "mean over the GPUs"
    overrides = environment.overrides()  # what the cuda Buffers below resolve their Config to
    config = jax_ep.Config().with_overrides(overrides.combine, overrides.push_warps)
    push_warps = cuda_backend.combine_push_warps(config, spans_processes=bool(args.processes))
    combine_method = f"push ({push_warps} pushing warps per block)" if push_warps else "pull"
    print(f"[intranode] {num_ranks} ranks ({devices[0].device_kind}), {_process_model(args)}, T={T} H={H} K={K} "
          f"E={E}, {args.iters} ops per timed loop, median of {args.repeats}"
          + (f", kernel t: {kernel_device}, cuda combine: {combine_method}" if args.sms else ""), flush=True)
    records = []

    def report(backend, op, payload, sms, seconds, nbytes, kernel_seconds=None):
        record = dict(backend=backend, op=op, payload=payload, num_sms=sms, num_ranks=num_ranks, tokens=T, hidden=H,
                      topk=K, experts=E, process_model=_process_model(args), recv_rows=recv_rows,
                      t_us=seconds * 1e6, gbps=nbytes / seconds / 1e9, nvl_gbps=nbytes * remote_fraction / seconds / 1e9)
        sm_text = "" if sms is None else f", SMs {sms}"
        line = (f"[intranode] {backend} {op} ({payload}{sm_text}): {record['gbps']:.2f} GB/s (logical), "
                f"{record['nvl_gbps']:.2f} GB/s (NVL), t: {record['t_us']:.2f} us")
        if kernel_seconds:
            record.update(kernel_us=kernel_seconds * 1e6, kernel_us_of=kernel_device,
                          in_jit_overhead=seconds / kernel_seconds - 1)
            line += f", kernel t: {record['kernel_us']:.2f} us (in-jit overhead {100 * record['in_jit_overhead']:+.1f}%)"
        records.append(record)
        print(line, flush=True)

    # DeepEP's byte count: received rows (one per (token, destination rank)) of the BF16 / FP8 payload.
    in_rank = np.any(topk_idx_host[:, :, None] // (E // num_ranks) == np.arange(num_ranks), axis=1)  # [R*T, R]
    per_pair = in_rank.reshape(num_ranks, T, num_ranks).sum(axis=1)  # [source, destination]
    recv_rows = float(np.mean(per_pair.sum(axis=0)))
    # NVLink figure: self traffic (a rank's tokens to itself) excluded.
    remote_fraction = 1.0 - float(np.trace(per_pair)) / float(per_pair.sum())
    bf16_bytes, fp8_bytes = recv_rows * H * 2, recv_rows * H * (1 + 4 / FP8_GROUP)

    if args.baselines:
        for backend, op, payload, result in _baseline_times(mesh, args, topk_idx, x, E):
            if isinstance(result, str):
                print(f"[intranode] {backend}: {result}", flush=True)
            else:
                report(backend, op, payload, None, result, bf16_bytes)

    def store_ceiling(buf, sms):
        """Every GPU storing to every peer at once with plain stores from `sms` SMs (the link ceiling of a
        store-based kernel), 64 MiB per peer. "Counted" scales the wire rate by R / (R - 1): at this routing
        about 1/R of DeepEP's counted bytes stay on the GPU."""
        bytes_per_peer = 64 << 20
        params = cuda_backend.kernel_params(buf)
        probe = lambda idx, _: cuda_backend.store_probe(idx[:1, 0], params=params, num_ranks=num_ranks,
                                                        bytes_per_peer=bytes_per_peer)
        seconds = _time_per_op(mesh, probe, (topk_idx, x), args)
        wire = (num_ranks - 1) * bytes_per_peer / seconds / 1e9
        counted = wire * num_ranks / (num_ranks - 1)
        records.append(dict(backend="cuda", op="store ceiling", payload="bytes", num_sms=sms, num_ranks=num_ranks,
                            process_model=_process_model(args), t_us=seconds * 1e6, gbps=counted, nvl_gbps=wire))
        print(f"[intranode] all-to-all store ceiling (SMs {sms}): {wire:.2f} GB/s out per GPU on the wire, "
              f"{counted:.2f} GB/s in DeepEP's count (x R/(R-1))", flush=True)

    runs = [("xla", None)] if args.xla else []
    runs += [("cuda", sms) for sms in args.sms]
    # One process per GPU: every normal-mode op stages the inputs its peers read in the Buffer's workspace.
    num_nvl_bytes = max(jax_ep.normal_buffer_bytes(T, H, num_ranks, K, fp8=fp8) for fp8 in (False, True))
    if args.processes and args.sms:
        print(f"[intranode] cuda Buffer num_nvl_bytes={num_nvl_bytes} ({num_nvl_bytes / 2**20:.1f} MiB per GPU: "
              "jax_ep.normal_buffer_bytes of these shapes, BF16 and FP8)", flush=True)
    for backend, sms in runs:
        config = jax_ep.Config() if sms is None else jax_ep.Config(num_sms=sms)
        with jax_ep.Buffer(mesh, "ep", backend=backend, config=config,
                           num_nvl_bytes=num_nvl_bytes if args.processes else None) as buf:
            def dispatch(idx, payload):
                return jax_ep.dispatch(buf, payload, idx, num_experts=E)

            def combine(handle, y):
                return jax_ep.combine(buf, y, handle).x

            def timed(op, fn_args):
                """(in-jit seconds per op, bare kernel seconds per op or None)."""
                if backend != "cuda":
                    return _time_per_op(mesh, op, fn_args, args), None
                return _timed_with_kernels(mesh, op, fn_args, args, functools.partial(cuda_backend.kernel_times, buf))

            if backend == "cuda" and not args.processes:
                store_ceiling(buf, sms)
            d = _spmd(mesh, lambda i, p: (lambda r: (r.recv_x, r.handle))(dispatch(i, p)))(topk_idx, x)
            for payload, data, nbytes in (("BF16", x, bf16_bytes), ("FP8", x_fp8, fp8_bytes)):
                seconds, kernel_seconds = timed(dispatch, (topk_idx, data))
                report(backend, "dispatch", payload, sms, seconds, nbytes, kernel_seconds)
            seconds, kernel_seconds = timed(combine, (d[1], d[0]))
            report(backend, "combine", "BF16", sms, seconds, bf16_bytes, kernel_seconds)
            if backend == "cuda":
                records[-1]["combine_method"] = combine_method
    return records


def internode_bench(args) -> list[dict]:
    """The internode normal mode: dispatch (BF16, FP8) and combine (BF16) at each --sms, DeepEP's byte counts."""
    if not args.processes:
        raise SystemExit("internode mode needs one process per GPU: pass --processes N (and --ranks-per-node P)")
    mesh = _mesh(args)
    devices, num_ranks = list(mesh.devices.flat), mesh.devices.size
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    per_node = args.ranks_per_node or internode.ranks_per_node_of(mesh, "ep", None)
    num_nodes = num_ranks // per_node
    rng = np.random.default_rng(0)
    topk_idx_host = _topk_idx(rng, num_ranks, T, K, E)
    topk_idx = _global(mesh, topk_idx_host)
    x = _global(mesh, rng.standard_normal((num_ranks * T, H), dtype=np.float32).astype(jnp.bfloat16))
    x_fp8 = _spmd(mesh, jax_ep.per_token_cast_to_fp8)(x)

    # DeepEP's test_internode counts, per rank then averaged: (token, node) pairs and received rows.
    in_node = np.any(topk_idx_host[:, :, None] // (E // num_nodes) == np.arange(num_nodes), axis=1)  # [R*T, N]
    own_node = np.repeat(np.arange(num_ranks) // per_node, T)
    rdma_rows = float(in_node.sum()) / num_ranks
    cross_rows = float(in_node.sum() - in_node[np.arange(num_ranks * T), own_node].sum()) / num_ranks
    in_rank = np.any(topk_idx_host[:, :, None] // (E // num_ranks) == np.arange(num_ranks), axis=1)  # [R*T, R]
    recv_rows = float(in_rank.sum()) / num_ranks
    fp8_factor = (1 + 4 / FP8_GROUP) / 2
    one_host = len({internode._process_hosts()[d.process_index] for d in devices}) == 1
    print(f"[internode] {num_ranks} ranks = {num_nodes} nodes x {per_node} ({devices[0].device_kind}), one process per "
          f"GPU, T={T} H={H} K={K} E={E}, {args.iters} ops per timed loop, median of {args.repeats}; per rank "
          f"{rdma_rows:.0f} (token, node) pairs ({cross_rows:.0f} to other nodes), {recv_rows:.0f} received rows; "
          "kernel t: process 0's GPU", flush=True)
    if one_host:
        print("[internode] every rank is on one host: the RDMA figures are NVSHMEM traffic over NVLink between the "
              "emulated nodes, not network figures", flush=True)
    records = []

    def report(backend, op, payload, sms, seconds, kernel_seconds=None):
        factor = fp8_factor if payload == "FP8" else 1.0
        rdma_bytes, nvl_bytes = rdma_rows * H * 2 * factor, recv_rows * H * 2 * factor
        record = dict(backend=backend, op=op, payload=payload, num_sms=sms, num_ranks=num_ranks, num_nodes=num_nodes,
                      ranks_per_node=per_node, tokens=T, hidden=H, topk=K, experts=E, one_host=one_host,
                      rdma_rows=rdma_rows, cross_node_rows=cross_rows, recv_rows=recv_rows, t_us=seconds * 1e6,
                      rdma_gbps=rdma_bytes / seconds / 1e9, nvl_gbps=nvl_bytes / seconds / 1e9)
        sm_text = "" if sms is None else f", SMs {sms}"
        line = (f"[internode] {backend} {op} ({payload}{sm_text}): {record['rdma_gbps']:.2f} GB/s (RDMA), "
                f"{record['nvl_gbps']:.2f} GB/s (NVL), t: {record['t_us']:.2f} us")
        if kernel_seconds:
            record.update(kernel_us=kernel_seconds * 1e6, in_jit_overhead=seconds / kernel_seconds - 1)
            line += f", kernel t: {record['kernel_us']:.2f} us"
        records.append(record)
        print(line, flush=True)

    num_rdma_bytes = max(jax_ep.internode_buffer_bytes(T, H, num_ranks, K, per_node, fp8=fp8) for fp8 in (False, True))
    print(f"[internode] Buffer num_rdma_bytes={num_rdma_bytes} ({num_rdma_bytes / 2**20:.0f} MiB per GPU); combine "
          "sends float32 partials between nodes (twice the counted RDMA bytes of BF16)", flush=True)
    for sms in args.sms:
        with jax_ep.Buffer(mesh, "ep", backend="cuda", config=jax_ep.Config(num_sms=sms), ranks_per_node=per_node,
                           num_rdma_bytes=num_rdma_bytes) as buf:
            if not buf.internode:
                raise RuntimeError(f"the Buffer did not take the internode kernels: {buf}")
            kernel_times = functools.partial(internode.kernel_times, buf)

            def dispatch(idx, payload):
                return jax_ep.dispatch(buf, payload, idx, num_experts=E)

            def combine(handle, y):
                return jax_ep.combine(buf, y, handle).x

            d = _spmd(mesh, lambda i, p: (lambda r: (r.recv_x, r.handle))(dispatch(i, p)))(topk_idx, x)
            for payload, data in (("BF16", x), ("FP8", x_fp8)):
                report("cuda", "dispatch", payload, sms,
                       *_timed_with_kernels(mesh, dispatch, (topk_idx, data), args, kernel_times))
            report("cuda", "combine", "BF16", sms,
                   *_timed_with_kernels(mesh, combine, (d[1], d[0]), args, kernel_times))
    if args.baselines:
        for backend, op, payload, result in _baseline_times(mesh, args, topk_idx, x, E):
            if isinstance(result, str):
                print(f"[internode] {backend}: {result}", flush=True)
            else:
                report(backend, op, payload, None, result)
    return records


def _custom_calls(mesh, fn, *fn_args) -> list[str]:
    """The jax_ep FFI targets in the lowered program of `fn`: which implementation a Buffer's ops really run."""
    text = _spmd(mesh, fn).lower(*fn_args).as_text()
    return sorted(set(re.findall(r"custom_call @(jax_ep\w*)", text)))


def _independent_compute(a):
    """The computation scheduled between a send half and its receive half: a bf16 matmul [S, S] @ [S, S],
    reduced to a scalar so that XLA must compute all of it."""
    return jnp.sum(jnp.dot(a, a, preferred_element_type=jnp.float32))


# ---- the low-latency kernels' own clocks (cuda_low_latency.trace) ---------------------------------------------

# What each kernel's phase times are summed over (csrc/low_latency.cu, the kernels' clock_mark calls).
_TRACE_UNITS = {"dispatch send": "block", "dispatch recv": "block", "combine send": "block",
                "combine recv": "(token, part)"}


def trace_breakdown(traces: list[dict], op: str) -> dict | None:
    """Where the time of `op` ("dispatch" or "combine") went on the GPUs, from `cuda_low_latency.trace` of the
    GPUs that ran it (after a reset before the timed programs): per GPU the median over its calls whose send
    and receive both finished, then the mean over GPUs, in µs. Every figure is a difference of two instants of
    one GPU's %globaltimer:

    - send, recv: a kernel's first block start to its last block's end; gap: send end to recv start;
      op: send start to recv end (the op on the device, what DeepEP's kernel timings measure);
    - period: send start to the next call's send start (the op's steady-state cost per step: independent of
      when the host launched each GPU's program), between: recv end to the next send start (the timing
      loop's chaining ops and launch gaps); both over consecutive calls only;
    - per kernel: spread (first to last block start), first/last flag (from the first block's start: sends,
      a flag raised on a receiver; receives, every flag of an expert or of a token found set) and the mean
      time per unit in each phase;
    - send_mean, recv_mean: plain means over the same calls (first calls of a program included, whose waits
      absorb the GPUs' launch skew): what the earlier "kernel time" reported.
    - per_gpu: op, send, recv and the receive's last flag of each GPU (a straggler shows here; the GPUs'
      clocks differ by up to a millisecond, so instants are not compared across GPUs).
    None when no GPU has a finished call."""
    kernels = (f"{op} send", f"{op} recv")
    per_gpu = []
    for device in traces:
        send, recv = (device[k] for k in kernels)
        finished = [(t["first_start"] > 0) & (t["end"] > t["first_start"]) for t in (send, recv)]
        slots = np.flatnonzero(finished[0] & finished[1] & (send["call"] == recv["call"]))
        if not len(slots):
            continue
        after = (slots + 1) % len(send["call"])
        chained = finished[0][after] & (send["call"][after] == send["call"][slots] + 1)
        s, r = ({name: values[slots] for name, values in t.items() if name != "phases"} for t in (send, recv))
        next_start = send["first_start"][after][chained]
        f = dict(calls=float(len(slots)), send=s["end"] - s["first_start"], gap=r["first_start"] - s["end"],
                 recv=r["end"] - r["first_start"], op=r["end"] - s["first_start"],
                 period=next_start - s["first_start"][chained], between=next_start - r["end"][chained])
        f["send_mean"], f["recv_mean"] = float(np.mean(f["send"])), float(np.mean(f["recv"]))
        for kernel, t, phases in zip(kernels, (s, r), (send["phases"], recv["phases"])):
            f[f"{kernel}: spread"] = t["last_start"] - t["first_start"]
            raised = t["first_flag"] > 0  # the minimum stays ~0 (-1 here) when no flag was raised or awaited
            f[f"{kernel}: first flag"] = (t["first_flag"] - t["first_start"])[raised]
            f[f"{kernel}: last flag"] = (t["last_flag"] - t["first_start"])[raised]
            for phase, ns in phases.items():
                f[f"{kernel}: {phase}"] = ns[slots] / np.maximum(t["units"], 1)
        per_gpu.append({name: float(np.median(v)) if isinstance(v, np.ndarray) else v
                        for name, v in f.items() if not isinstance(v, np.ndarray) or len(v)})
    if not per_gpu:
        return None
    names = [name for name in per_gpu[0] if all(name in g for g in per_gpu)]
    out = {name: float(np.mean([g[name] for g in per_gpu])) for name in names}
    gpus = [{name: g[name] / 1e3 for name in ("op", "send", "recv", f"{kernels[1]}: last flag") if name in g}
            for g in per_gpu]
    return ({name: value if name == "calls" else value / 1e3 for name, value in out.items()}
            | {"gpus": len(per_gpu), "per_gpu": gpus})


def _breakdown_lines(b: dict, op: str, kernel_device: str) -> list[str]:
    """The printed form of trace_breakdown's figures."""
    lines = [f"on the GPU ({kernel_device}; %globaltimer, median over {b['calls']:.0f} calls): "
             + (f"an op every {b['period']:.2f} us = " if "period" in b else "")
             + f"send {b['send']:.2f} + gap {b['gap']:.2f} + recv {b['recv']:.2f}"
             + (f" + between ops {b['between']:.2f} us (the loop's chaining ops, launches)" if "between" in b else " us")
             + f"; send start to recv end {b['op']:.2f} us; plain means: send {b['send_mean']:.2f}, "
             f"recv {b['recv_mean']:.2f} us"]
    for kernel in (f"{op} send", f"{op} recv"):
        unit = _TRACE_UNITS[kernel]
        phases = [name.split(": ", 1)[1] for name in b if name.startswith(f"{kernel}: ")
                  and name.split(": ", 1)[1] not in ("spread", "first flag", "last flag")]
        text = (f"{kernel}: blocks start within {b[f'{kernel}: spread']:.2f} us; per {unit}: "
                + ", ".join(f"{phase} {b[f'{kernel}: {phase}']:.2f}" for phase in phases) + " us")
        if f"{kernel}: first flag" in b:
            what = "flags raised" if kernel.endswith("send") else "waits for flags done"
            text += (f"; {what} from {b[f'{kernel}: first flag']:.2f} to {b[f'{kernel}: last flag']:.2f} us "
                     "after its first block started")
        lines.append(text)
    if len(b.get("per_gpu", ())) > 1:
        lines.append("per GPU: " + "; ".join(
            f"op {g['op']:.2f} (recv's last flag {g.get(f'{op} recv: last flag', float('nan')):.2f})"
            for g in b["per_gpu"]) + " us")
    return lines


def low_latency(args) -> dict:
    mesh = _mesh(args)
    devices, num_ranks = list(mesh.devices.flat), mesh.devices.size
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    M = args.max_tokens or T
    L = E // num_ranks
    rng = np.random.default_rng(0)
    topk_idx_host = _topk_idx(rng, num_ranks, T, K, E)
    # DeepEP's test_low_latency sets a few random entries of each rank to -1 (no expert).
    for r in range(num_ranks):
        for _ in range(args.masked):
            topk_idx_host[r * T + rng.integers(T), rng.integers(K)] = -1
    topk_idx = _global(mesh, topk_idx_host)
    topk_weights = _global(mesh, np.abs(rng.standard_normal((num_ranks * T, K))).astype(np.float32))
    x = _global(mesh, rng.standard_normal((num_ranks * T, H), dtype=np.float32).astype(jnp.bfloat16))
    size = args.overlap_size or (128 if devices[0].platform == "cpu" else 4096)
    a = _global(mesh, (rng.standard_normal((num_ranks * size, size), dtype=np.float32) / np.sqrt(size))
                .astype(jnp.bfloat16))

    # DeepEP's byte count: per valid (token, expert) pair, counted on the sending rank; the mean over ranks
    # (= sum / R) of those pairs, against the time of the SPMD program (equal on every rank). "NVL" leaves
    # out the pairs whose expert lives on the token's own rank.
    valid = topk_idx_host >= 0
    remote = valid & (topk_idx_host // L != np.repeat(np.arange(num_ranks), T)[:, None])
    pairs, remote_pairs = valid.sum() / num_ranks, remote.sum() / num_ranks
    pair_bytes = {("dispatch", "FP8"): H + H // FP8_GROUP * 4 + 16, ("dispatch", "BF16"): 2 * H,
                  ("combine", "BF16"): 2 * H}
    setup = dict(num_ranks=num_ranks, device=devices[0].device_kind, tokens=T, hidden=H, topk=K, experts=E,
                 num_max_dispatch_tokens_per_rank=M, masked_per_rank=args.masked, valid_pairs_per_rank=float(pairs),
                 remote_pairs_per_rank=float(remote_pairs), iters=args.iters, repeats=args.repeats,
                 overlap_matmul_size=size, process_model=_process_model(args), ops=list(args.ops),
                 baselines=args.baselines)
    results, splits = [], []
    print(f"[low_latency] {num_ranks} ranks ({devices[0].device_kind}), {_process_model(args)}, "
          f"T={T} H={H} K={K} E={E} M={M}, "
          f"{pairs:.1f} valid (token, expert) pairs per rank ({remote_pairs:.1f} to other ranks); "
          f"times per op: (wall(program of {2 * args.iters} ops) - wall(program of {args.iters} ops)) / "
          f"{args.iters}, median of {args.repeats} (host clock: the difference also carries how far apart the "
          "host started the GPUs of each program; the cuda lines' \"on the GPU\" figures do not)", flush=True)

    # With one process per GPU, each process reads its own GPU's clocks and process 0 prints.
    kernel_device = "process 0's GPU" if args.processes else f"mean of the medians of {num_ranks} GPUs"

    def report(backend, op, payload, seconds, breakdown=None):
        nbytes = pair_bytes[op, payload]
        record = dict(backend=backend, op=op, payload=payload, t_us=seconds * 1e6,
                      gbps=pairs * nbytes / seconds / 1e9, nvl_gbps=remote_pairs * nbytes / seconds / 1e9)
        if breakdown is not None:
            record["device_us"] = breakdown
        results.append(record)
        print(f"[low_latency] {backend} [{op} {payload}] {record['t_us']:.2f} us, {record['gbps']:.2f} GB/s "
              f"(DeepEP count), {record['nvl_gbps']:.2f} GB/s (NVL)", flush=True)
        for line in _breakdown_lines(breakdown, op, kernel_device) if breakdown else ():
            print(f"[low_latency]   {line}", flush=True)

    def time_op(op, fn_args):
        # Every program chains one payload element as well as the routing: the xla backend's all_gather of x
        # does not depend on the routing and would otherwise run once per timed sequence.
        return _time_per_op(mesh, op, fn_args, args, chain_data=True)

    def time_op_and_kernels(op, fn_args, buf, name):
        """time_op, and for a cuda Buffer the kernels' own account of the timed calls (trace_breakdown of op
        `name`), else None."""
        if buf.backend != "cuda":
            return time_op(op, fn_args), None
        seconds = _time_per_op(mesh, op, fn_args, args, chain_data=True,
                               before_timing=lambda: cuda_low_latency.trace(buf, reset=True))
        return seconds, trace_breakdown(cuda_low_latency.trace(buf), name)

    chain = time_op(lambda idx, data: data[:1, :1], (topk_idx, x))
    setup["loop_overhead_us"] = chain * 1e6
    print(f"[low_latency] timing loop: {chain * 1e6:.2f} us per step to chain one op to the next (routing + one "
          f"payload element), included in every figure below", flush=True)

    def ops_of(buf):
        def dispatch(use_fp8):
            return lambda idx, data: jax_ep.low_latency_dispatch(buf, data, idx, use_fp8=use_fp8)

        def combine(routing, y):
            idx, weights, handle = routing
            return jax_ep.low_latency_combine(buf, y, idx, weights, handle)

        recv_bf16 = _spmd(mesh, lambda i, d: (lambda r: (r.recv_x, r.handle))(dispatch(False)(i, d)))(topk_idx, x)
        return dispatch, combine, (topk_idx, topk_weights, recv_bf16[1]), recv_bf16[0]

    def time_all(buf, backend):
        dispatch, combine, combine_routing, y = ops_of(buf)
        for payload, use_fp8 in (("FP8", True), ("BF16", False)) if "dispatch" in args.ops else ():
            report(backend, "dispatch", payload,
                   *time_op_and_kernels(dispatch(use_fp8), (topk_idx, x), buf, "dispatch"))
        if "combine" in args.ops:
            report(backend, "combine", "BF16", *time_op_and_kernels(combine, (combine_routing, y), buf, "combine"))
        return combine_routing, y

    with jax_ep.Buffer(mesh, "ep", backend=args.backend, num_max_dispatch_tokens_per_rank=M, hidden=H,
                       num_experts=E) as buf:
        targets = _custom_calls(mesh, lambda i, d: jax_ep.low_latency_dispatch(buf, d, i).recv_x, topk_idx, x)
        measured = "jax_ep " + ("cuda" if targets else "xla")
        setup.update(buffer_backend=buf.backend, measured=measured, custom_calls=targets,
                     low_latency_transport=buf.low_latency_transport)
        print(f"[low_latency] Buffer(backend={args.backend!r}) resolved to {buf.backend!r}; its low-latency ops run as "
              + (f"CUDA kernels ({', '.join(targets)}), transport {buf.low_latency_transport} (set "
                 "JAX_EP_LL_TRANSPORT=nvshmem with --processes for NVSHMEM)" if targets else
                 "the pure-JAX xla implementation (no jax_ep custom call in the program)"), flush=True)
        combine_routing, y = time_all(buf, measured)

        # Send/receive split (the receive hook). One program cannot stop the clock between the halves, so this
        # measures what the split buys: per step send, an independent matmul, then receive (forced after the
        # matmul through its result), against the matmul alone. exposed = t(send; matmul; recv) - t(matmul)
        # is the op's cost that the matmul did not hide; hidden = t(op) - exposed. XLA orders the send and the
        # matmul itself, as it would in a model.
        def split(send, recv):
            def op(routing, data, mat):
                pending = send(routing, data)
                return recv(_depend(pending, _independent_compute(mat)))
            return op

        t_compute = time_op(lambda idx, data, mat: _independent_compute(mat), (topk_idx, x, a))
        setup["overlap_compute_us"] = t_compute * 1e6
        halves = [
            ("dispatch", "FP8", (topk_idx, x),
             lambda idx, d: jax_ep.low_latency_dispatch_send(buf, d, idx, use_fp8=True),
             lambda p: jax_ep.low_latency_dispatch_recv(buf, p)),
            ("combine", "BF16", (combine_routing, y),
             lambda r, d: jax_ep.low_latency_combine_send(buf, d, r[0], r[1], r[2]),
             lambda p: jax_ep.low_latency_combine_recv(buf, p)),
        ]
        for op, payload, fn_args, send, recv in halves:
            if op not in args.ops:
                continue
            t_split = time_op(split(send, recv), (*fn_args, a))
            t_op = next(r["t_us"] for r in results if (r["backend"], r["op"], r["payload"]) == (measured, op, payload))
            exposed = t_split * 1e6 - t_compute * 1e6
            record = dict(backend=measured, op=op, payload=payload, t_split_us=t_split * 1e6,
                          compute_us=t_compute * 1e6, exposed_us=exposed, hidden_us=t_op - exposed)
            splits.append(record)
            print(f"[low_latency] {measured} [{op} {payload} send/recv] {exposed:.2f} us exposed, "
                  f"{record['hidden_us']:.2f} of {t_op:.2f} us hidden by {t_compute * 1e6:.2f} us of independent "
                  f"compute between send and recv (exposed = t(send; compute; recv) - t(compute))", flush=True)

    baselines = []
    if measured == "jax_ep xla":
        print("[low_latency] jax_ep xla: the measured ops above (not timed twice)", flush=True)
    elif args.baselines:
        with jax_ep.Buffer(mesh, "ep", backend="xla", num_max_dispatch_tokens_per_rank=M, hidden=H,
                           num_experts=E) as xla_buf:
            time_all(xla_buf, "jax_ep xla")
        baselines.append("jax_ep xla")
    if args.baselines:
        for backend, op, payload, result in _baseline_times(mesh, args, topk_idx, x, E, fp8=True, chain_data=True,
                                                            ops=args.ops):
            if isinstance(result, str):
                print(f"[low_latency] {backend}: {result}", flush=True)
            else:
                report(backend, op, payload, result)
                baselines.append(backend)

    speedups = []
    for op in ("dispatch", "combine"):
        pool = [r for r in results if r["backend"] in baselines and r["op"] == op]
        if not pool:
            continue
        best = min(pool, key=lambda r: r["t_us"])
        for r in results:
            if r["backend"] == measured and r["op"] == op:
                speedups.append(dict(op=op, payload=r["payload"], speedup=best["t_us"] / r["t_us"],
                                     baseline=f"{best['backend']} {best['payload']}", baseline_t_us=best["t_us"]))
                print(f"[low_latency] {measured} [{op} {r['payload']}] speedup {speedups[-1]['speedup']:.1f}x over "
                      f"the best pure-JAX baseline ({speedups[-1]['baseline']}, {best['t_us']:.2f} us)", flush=True)
    return dict(mode="low_latency", setup=setup, results=results, splits=splits, speedups=speedups)


def plot_sm_sweep(records: list[dict], path: str) -> None:
    """PNG: logical GB/s of the cuda backend against Config.num_sms, one line per (op, payload), with the
    pure-JAX baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["backend"] == "cuda":
            series.setdefault(f"{r['op']} {r['payload']}", []).append((r["num_sms"], r["gbps"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"jax_ep cuda {label}")
    for r in records:
        if r["backend"] != "cuda":
            ax.axhline(r["gbps"], linestyle=":", linewidth=1, color="gray")
            ax.annotate(f"{r['backend']} {r['op']} {r['payload']}", (0, r["gbps"]), fontsize=6,
                        xycoords=("axes fraction", "data"), va="bottom")
    first = records[0]
    ax.set(xlabel="SMs (Config.num_sms)", ylabel="GB/s (DeepEP count)",
           title=f"jax_ep intranode, {first['num_ranks']} ranks, T={first['tokens']} H={first['hidden']} "
                 f"K={first['topk']} E={first['experts']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- one process per GPU --------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(procs: list[subprocess.Popen], deadline_s: float, grace_s: float = 20.0) -> list[int | None]:
    """Exit codes of `procs`, None for the ones killed: at `deadline_s`, or `grace_s` after the first one failed
    (its peers then wait in collectives that it never joins)."""
    deadline, failed = time.monotonic() + deadline_s, False
    while None in (codes := [proc.poll() for proc in procs]) and time.monotonic() < deadline:
        if not failed and any(code not in (None, 0) for code in codes):
            failed, deadline = True, min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    _kill_running(procs)
    return codes


def _kill_running(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# What every line and JSON record of a run whose ranks share GPUs says.
SHARED_GPU_LABEL = "[shared GPU: not a performance figure] "


def _cuda_device_count() -> int:
    """The GPUs this process sees, asked of the CUDA driver: the launcher starts no JAX backend, which would hold
    GPU memory beside its workers."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


class _LabelledLines:
    """A text stream that starts every line written to it with `label`."""

    def __init__(self, stream, label: str):
        self.stream, self.label, self.at_line_start = stream, label, True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            pieces.append(self.label + piece if self.at_line_start else piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(pieces))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def _label_shared(records):
    """Marks a mode's JSON (a list of records, or the low-latency mode's dict) as taken on shared GPUs."""
    for record in records if isinstance(records, list) else [records]:
        record["not_a_performance_figure"] = "ranks shared GPUs"
    return records


def _launch(args, argv: list[str], gpus: int) -> int:
    """--processes N: runs N copies of this command, process i owning GPU i mod `gpus` (every process sees every
    GPU, for CUDA IPC), joined through jax.distributed on a free localhost port. Process 0's output passes
    through, the others' goes to log files whose last lines are printed when they fail. Returns 0 when all
    succeeded."""
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    first = args.node_rank * args.processes  # this host's first process
    package_root = str(Path(__file__).resolve().parents[1])
    env = environment.for_subprocess(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if environment.runs_on_cpu():  # one CPU device per process
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    with tempfile.TemporaryDirectory(prefix="jax_ep_bench_") as logdir:
        logs = [open(Path(logdir) / f"process{i}.log", "w+") for i in range(args.processes)]
        procs = []
        # Killed by a deadline of its own (SIGTERM), the launcher takes its workers with it (the finally below).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            for i, log in enumerate(logs):
                command = [sys.executable, "-m", "jax_ep.bench", *argv, "--process-id", str(first + i),
                           "--local-device", str(i % gpus), "--coordinator", coordinator]
                if args.processes > gpus:
                    command.append("--shared-gpu")
                procs.append(subprocess.Popen(command, env=env, stdout=None if i == 0 else log,
                                              stderr=None if i == 0 else log))
            codes = _wait_for(procs, args.deadline)
        finally:  # the launcher itself failed or was interrupted
            _kill_running(procs)
        for i, (code, log) in enumerate(zip(codes, logs)):
            if code == 0:
                continue
            what = f"exited with code {code}" if code is not None else "was killed (deadline, or a peer failed)"
            log.seek(0)
            tail = "its output is above" if i == 0 else "last lines:\n" + "".join(log.readlines()[-40:])
            print(f"[bench] process {first + i} of {args.processes * args.nodes} {what}; {tail}", file=sys.stderr,
                  flush=True)
        for log in logs:
            log.close()
    return 0 if codes == [0] * args.processes else 1


def _join(args) -> None:
    """A worker of --processes joins jax.distributed as process `process_id`: on GPU owning its host's GPU
    `local_device` only, on CPU with its CPU device (gloo collectives)."""
    owned = {}
    if environment.runs_on_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
        owned["local_device_ids"] = [args.local_device]
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes * args.nodes,
                               process_id=args.process_id, initialization_timeout=120, **owned)


# DeepEP's benchmark shapes: (tokens per rank, hidden, top-k, experts).
DEFAULT_SHAPES = {"intranode": (4096, 7168, 8, 256), "low_latency": (128, 7168, 8, 288),
                  "internode": (4096, 7168, 8, 256)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_ep.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=sorted(DEFAULT_SHAPES))
    parser.add_argument("--ranks", type=int, default=0, help="GPUs to use (default: every local GPU)")
    parser.add_argument("--processes", type=int, default=0,
                        help="run this many ranks as processes, process i owning GPU i mod G (see --gpus), instead of "
                             "one process driving every GPU")
    parser.add_argument("--gpus", type=int, default=0,
                        help="with --processes: the host's GPUs to spread the processes over (default: every GPU it "
                             "has)")
    parser.add_argument("--allow-shared-gpu", action="store_true",
                        help="with --processes: run even with more processes than GPUs (ranks sharing a GPU: for "
                             "correctness only; every figure is labelled as not a performance figure)")
    parser.add_argument("--deadline", type=float, default=1800,
                        help="with --processes: seconds after which the processes still running are killed")
    parser.add_argument("--nodes", type=int, default=1,
                        help="with --processes: hosts running the launcher (each starts --processes workers)")
    parser.add_argument("--node-rank", type=int, default=0, help="with --nodes: this host's index")
    parser.add_argument("--coordinator", help="with --nodes: HOST:PORT of the jax.distributed coordinator "
                                              "(on host 0; default: a free port on localhost)")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="internode: GPUs per node (default: the GPUs of each host); e.g. 2 runs 4 GPUs of one "
                             "host as 2 nodes x 2")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # a worker of --processes
    parser.add_argument("--local-device", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shared-gpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help="tokens per rank (default 4096 intranode, 128 low_latency)")
    parser.add_argument("--hidden", type=int, help="default 7168")
    parser.add_argument("--topk", type=int, help="default 8")
    parser.add_argument("--experts", type=int, help="default 256 intranode, 288 low_latency")
    parser.add_argument("--sms", type=int, nargs="*", default=[24],
                        help="intranode: Config.num_sms values for the cuda backend (none: skip the cuda backend)")
    parser.add_argument("--iters", type=int, default=20, help="ops per timed jitted loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xla", action="store_true",
                        help="intranode: also time jax_ep's xla backend (its all_gather of the payload does not depend "
                             "on the routing, so XLA computes it once for the whole timed sequence: not a fair figure)")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="skip the pure-JAX baselines (ragged_all_to_all MaxText-style, dense all_to_all; for "
                             "low_latency also jax_ep's xla backend)")
    parser.add_argument("--ops", nargs="+", choices=["dispatch", "combine"], default=["dispatch", "combine"],
                        help="low_latency: the ops to time (default both)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "xla"],
                        help="low_latency: the Buffer backend to measure (the xla backend is timed as a baseline)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="low_latency: num_max_dispatch_tokens_per_rank (default: --tokens)")
    parser.add_argument("--masked", type=int, default=0,
                        help="low_latency: top-k entries per rank set to -1 at random (DeepEP's test sets 10)")
    parser.add_argument("--overlap-size", type=int, default=0,
                        help="low_latency: S of the [S, S] bf16 matmul between send and receive halves "
                             "(default 4096, 128 on CPU)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--plot", help="intranode: write a PNG of GB/s against the SM count to this file")
    args = parser.parse_args(argv)
    for name, default in zip(("tokens", "hidden", "topk", "experts"), DEFAULT_SHAPES[args.mode]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.mode != "intranode" and args.plot:
        parser.error("--plot draws the intranode SM sweep only")
    if args.processes < 0 or (args.processes and args.ranks not in (0, args.processes)):
        parser.error("--processes N runs N ranks, one per process (leave --ranks out)")
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes or (args.nodes > 1 and not args.coordinator):
        parser.error("--nodes M needs --node-rank in [0, M) and --coordinator HOST:PORT")
    if args.processes and args.process_id is None:
        gpus = args.gpus or (0 if environment.runs_on_cpu() else _cuda_device_count()) or args.processes
        if args.processes > gpus and not args.allow_shared_gpu:
            parser.error(f"--processes {args.processes} on {gpus} GPU(s): ranks would share GPUs, so no figure would "
                         "be a performance figure; pass --allow-shared-gpu to run anyway (correctness, smoke tests)")
        return _launch(args, sys.argv[1:] if argv is None else list(argv), gpus)
    if args.process_id is not None:
        _join(args)
    if args.shared_gpu:
        sys.stdout = _LabelledLines(sys.stdout, SHARED_GPU_LABEL)
    try:
        modes = {"intranode": intranode, "low_latency": low_latency, "internode": internode_bench}
        records = modes[args.mode](args)
        if args.shared_gpu:
            _label_shared(records)
        if jax.process_index() == 0:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)
            if args.plot:
                plot_sm_sweep(records, args.plot)
    except BaseException:
        if args.process_id is None:
            raise
        # A failed worker exits at once: jax.distributed's shutdown would wait for peers stuck in collectives.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
