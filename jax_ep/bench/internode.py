"""internode: the internode normal mode (NVSHMEM between nodes, NVLink inside them; one process per GPU, so with
--processes), DeepEP's internode shape by default (T=4096, H=7168, K=8, E=256), on nodes of --ranks-per-node
GPUs (default: the GPUs of each host): dispatch (BF16, FP8) and combine (BF16) at each --sms, timed as the
intranode mode times them (with --layout expert_major the expert-major ops beside them), then the pure-JAX
baselines. Bandwidth as DeepEP's test_internode counts it, per
rank, averaged over ranks: "RDMA" = (token, destination node) pairs, the token's own node included, x row bytes;
"NVL" = received rows x row bytes (BF16: 2H, FP8: H (1 + 4/128)); combine the same as the dispatch it reverses.
On one host (e.g. 4 GPUs as 2 nodes x 2) the "RDMA" traffic is NVSHMEM over NVLink, not a network figure.
"""
from __future__ import annotations

import numpy as np

import jax_ep
from jax_ep.backends.cuda import internode as internode_backend
from jax_ep.backends.cuda import runtime
from jax_ep.bench import harness
from jax_ep.bench.baselines import baseline_times
from jax_ep.config import FP8_GROUP

# DeepEP's internode benchmark shape: (tokens per rank, hidden, top-k, experts).
SHAPE = (4096, 7168, 8, 256)


# Options that size the problem: at their defaults the mode refuses to run without GPUs (harness).
GPU_SIZES = harness.COMMUNICATION_SIZES


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="GPUs per node (default: the GPUs of each host); e.g. 2 runs 4 GPUs of one host as 2 "
                             "nodes x 2")
    harness.add_communication_arguments(parser, SHAPE)
    harness.add_sms_argument(parser)
    parser.add_argument("--layout", choices=("rank_major", "expert_major"), default="rank_major",
                        help="expert_major: also the expert-major dispatch (BF16, FP8) and weighted combine beside the "
                             "rank-major ops, in the same run, counted in the same bytes")
    harness.add_output_arguments(parser)


def run(args) -> list[dict]:
    if not args.processes:
        raise SystemExit("internode mode needs one process per GPU: pass --processes N (and --ranks-per-node P)")
    mesh = harness.ep_mesh(args)
    devices, num_ranks = list(mesh.devices.flat), mesh.devices.size
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    per_node = args.ranks_per_node or internode_backend.ranks_per_node_of(mesh, "ep", None)
    num_nodes = num_ranks // per_node
    topk_idx_host, topk_idx, x, x_fp8 = harness.routed_tokens(mesh, args)

    # DeepEP's test_internode counts, per rank then averaged: (token, node) pairs and received rows.
    in_node = np.any(topk_idx_host[:, :, None] // (E // num_nodes) == np.arange(num_nodes), axis=1)  # [R*T, N]
    own_node = np.repeat(np.arange(num_ranks) // per_node, T)
    rdma_rows = float(in_node.sum()) / num_ranks
    cross_rows = float(in_node.sum() - in_node[np.arange(num_ranks * T), own_node].sum()) / num_ranks
    in_rank = np.any(topk_idx_host[:, :, None] // (E // num_ranks) == np.arange(num_ranks), axis=1)  # [R*T, R]
    recv_rows = float(in_rank.sum()) / num_ranks
    fp8_factor = (1 + 4 / FP8_GROUP) / 2
    one_host = len({runtime.process_hosts()[d.process_index] for d in devices}) == 1
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
            kernel_times = buf.backend_impl.kernel_times

            def dispatch(idx, payload):
                return jax_ep.dispatch(buf, payload, idx, num_experts=E)

            def combine(handle, y):
                return jax_ep.combine(buf, y, handle).x

            d = harness.spmd(mesh, lambda i, p: (lambda r: (r.recv_x, r.handle))(dispatch(i, p)))(topk_idx, x)
            for payload, data in (("BF16", x), ("FP8", x_fp8)):
                report("cuda", "dispatch", payload, sms,
                       *harness.timed_with_kernels(mesh, dispatch, (topk_idx, data), args, kernel_times))
            report("cuda", "combine", "BF16", sms,
                   *harness.timed_with_kernels(mesh, combine, (d[1], d[0]), args, kernel_times))
            if args.layout == "expert_major":  # rows are (token, local expert) pairs; the byte count as above
                em_dispatch, em_combine, em = harness.expert_major_ops(mesh, buf, topk_idx, x, E, "internode")
                for payload, data in (("BF16", x), ("FP8", x_fp8)):
                    report("cuda", "expert-major dispatch", payload, sms,
                           *harness.timed_with_kernels(mesh, em_dispatch, (topk_idx, data), args, kernel_times))
                report("cuda", "expert-major combine", "BF16", sms,
                       *harness.timed_with_kernels(mesh, em_combine, em, args, kernel_times))
    if args.baselines:
        for backend, op, payload, seconds in baseline_times("internode", mesh, args, topk_idx, x, E):
            report(backend, op, payload, None, seconds)
    return records
