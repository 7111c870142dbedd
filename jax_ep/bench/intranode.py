"""intranode: normal-mode dispatch (BF16 and the FP8 pair) and combine (BF16) over every local GPU of this
process, DeepEP's shape by default (T=4096, H=7168, K=8, E=256), for the `cuda` backend at each `--sms` value
and the pure-JAX baselines. Each op runs in jitted sequences of `--iters` and 2×`--iters` ops; time per op =
the difference of their wall times / iters after a warm-up, median over `--repeats` runs. Bandwidth is
counted as DeepEP counts it (docs/design.md): received rows × H × 2 bytes for BF16 (dispatch and combine),
× (1 + 4/128) / 2 of that for FP8, per rank, averaged over ranks. Beside them: the all-to-all store ceiling
(every GPU storing to every peer at once from the same SMs).
"""
from __future__ import annotations

import numpy as np

import jax_ep
from jax_ep import _native, environment
from jax_ep.backends.cuda import intranode as intranode_backend
from jax_ep.bench import harness
from jax_ep.bench.baselines import baseline_times
from jax_ep.config import FP8_GROUP

# DeepEP's benchmark shape: (tokens per rank, hidden, top-k, experts).
SHAPE = (4096, 7168, 8, 256)


# Options that size the problem: at their defaults the mode refuses to run without GPUs (harness).
GPU_SIZES = harness.COMMUNICATION_SIZES


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    harness.add_communication_arguments(parser, SHAPE)
    harness.add_sms_argument(parser)
    parser.add_argument("--layout", choices=("rank_major", "expert_major"), default="rank_major",
                        help="expert_major: also the expert-major dispatch (BF16, FP8) and weighted combine beside the "
                             "rank-major ops, in the same run, counted in the same bytes")
    parser.add_argument("--xla", action="store_true",
                        help="also time jax_ep's xla backend (its all_gather of the payload does not depend on the "
                             "routing, so XLA computes it once for the whole timed sequence: not a fair figure)")
    harness.add_output_arguments(parser, plot_help="write a PNG of GB/s against the SM count to this file")


def run(args) -> list[dict]:
    mesh = harness.ep_mesh(args)
    devices, num_ranks = list(mesh.devices.flat), mesh.devices.size
    if args.sms and not harness.on_gpu(mesh):
        raise SystemExit(f"[intranode] the cuda kernels (--sms {' '.join(map(str, args.sms))}) need NVIDIA GPUs, "
                         f"and this run's devices are {devices[0].platform}: pass --sms with no value and --xla to "
                         "time the xla backend here")
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    topk_idx_host, topk_idx, x, x_fp8 = harness.routed_tokens(mesh, args)
    # Kernel times are per device of this process: with one process per GPU, process 0's GPU (which prints).
    kernel_device = "process 0's GPU" if args.processes else "mean over the GPUs"
    overrides = environment.overrides()  # what the cuda Buffers below resolve their Config to
    config = jax_ep.Config().with_overrides(overrides.combine, overrides.push_warps)
    push_warps = intranode_backend.combine_push_warps(config, spans_processes=bool(args.processes))
    combine_method = f"push ({push_warps} pushing warps per block)" if push_warps else "pull"
    process_model = harness.process_model(args)
    print(f"[intranode] {num_ranks} ranks ({devices[0].device_kind}), {process_model}, T={T} H={H} K={K} "
          f"E={E}, {args.iters} ops per timed loop, median of {args.repeats}"
          + (f", kernel t: {kernel_device}, cuda combine: {combine_method}" if args.sms else ""), flush=True)
    records = []

    def report(backend, op, payload, sms, seconds, nbytes, kernel_seconds=None):
        record = dict(backend=backend, op=op, payload=payload, num_sms=sms, num_ranks=num_ranks, tokens=T, hidden=H,
                      topk=K, experts=E, process_model=process_model, recv_rows=recv_rows,
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
        for backend, op, payload, seconds in baseline_times("intranode", mesh, args, topk_idx, x, E):
            report(backend, op, payload, None, seconds, bf16_bytes)

    def store_ceiling(buf, sms):
        """Every GPU storing to every peer at once with plain stores from `sms` SMs (the link ceiling of a
        store-based kernel), 64 MiB per peer. "Counted" scales the wire rate by R / (R - 1): at this routing
        about 1/R of DeepEP's counted bytes stay on the GPU."""
        bytes_per_peer = 64 << 20
        probe = lambda idx, _: buf.backend_impl.store_probe(idx[:1, 0], bytes_per_peer=bytes_per_peer)
        seconds = harness.time_per_op(mesh, probe, (topk_idx, x), args)
        wire = (num_ranks - 1) * bytes_per_peer / seconds / 1e9
        counted = wire * num_ranks / (num_ranks - 1)
        records.append(dict(backend="cuda", op="store ceiling", payload="bytes", num_sms=sms, num_ranks=num_ranks,
                            process_model=process_model, t_us=seconds * 1e6, gbps=counted, nvl_gbps=wire))
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
                    return harness.time_per_op(mesh, op, fn_args, args), None
                return harness.timed_with_kernels(mesh, op, fn_args, args,
                                                  buf.backend_impl.kernel_times)

            # One rank has no peer to store to; the probe exists in the instrumented build only.
            if backend == "cuda" and not args.processes and num_ranks > 1 and _native.with_instrumentation():
                store_ceiling(buf, sms)
            d = harness.spmd(mesh, lambda i, p: (lambda r: (r.recv_x, r.handle))(dispatch(i, p)))(topk_idx, x)
            for payload, data, nbytes in (("BF16", x, bf16_bytes), ("FP8", x_fp8, fp8_bytes)):
                seconds, kernel_seconds = timed(dispatch, (topk_idx, data))
                report(backend, "dispatch", payload, sms, seconds, nbytes, kernel_seconds)
            seconds, kernel_seconds = timed(combine, (d[1], d[0]))
            report(backend, "combine", "BF16", sms, seconds, bf16_bytes, kernel_seconds)
            if backend == "cuda":
                records[-1]["combine_method"] = combine_method
            if args.layout == "expert_major":  # rows are (token, local expert) pairs; DeepEP's byte count as above
                em_dispatch, em_combine, em = harness.expert_major_ops(mesh, buf, topk_idx, x, E, "intranode")
                for payload, data, nbytes in (("BF16", x, bf16_bytes), ("FP8", x_fp8, fp8_bytes)):
                    seconds, kernel_seconds = timed(em_dispatch, (topk_idx, data))
                    report(backend, "expert-major dispatch", payload, sms, seconds, nbytes, kernel_seconds)
                seconds, kernel_seconds = timed(em_combine, em)
                report(backend, "expert-major combine", "BF16", sms, seconds, bf16_bytes, kernel_seconds)
    return records


def plot(plt, records: list[dict], path: str) -> None:
    """PNG: logical GB/s of the cuda backend against Config.num_sms, one line per (op, payload), with the
    pure-JAX baselines as horizontal lines."""
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
    first = next(r for r in records if r["op"] != "store ceiling")  # a record that carries the shape
    ax.set(xlabel="SMs (Config.num_sms)", ylabel="GB/s (DeepEP count)",
           title=f"jax_ep intranode, {first['num_ranks']} ranks, T={first['tokens']} H={first['hidden']} "
                 f"K={first['topk']} E={first['experts']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
