"""low_latency: DeepEP's decode shape (T=128, H=7168, K=8, E=288): FP8 and BF16 low-latency dispatch and the
weighted BF16 combine of the Buffer's backend (`--backend`, which implementation ran is printed), timed the
same way as the intranode mode; the send/receive split as the part of each op that independent compute between
the halves hides; then the pure-JAX baselines (the `xla` backend's low-latency ops, dense all_to_all,
ragged_all_to_all) and the speedup over the best of them. Bytes as DeepEP counts them per valid (token, expert)
pair: H + H/128·4 + 16 (FP8 dispatch), 2H (BF16 dispatch, combine), on the sending rank, averaged over ranks.
On the GPU, the kernels' own clocks (`Buffer.backend_impl.low_latency_trace`) split each op into send, gap and receive.
"""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep import _native, logfmt
from jax_ep.bench import harness
from jax_ep.bench.baselines import baseline_times
from jax_ep.config import FP8_GROUP

# DeepEP's low-latency benchmark shape: (tokens per rank, hidden, top-k, experts).
SHAPE = (128, 7168, 8, 288)


# Options that size the problem: at their defaults the mode refuses to run without GPUs (harness).
GPU_SIZES = harness.COMMUNICATION_SIZES


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    harness.add_communication_arguments(parser, SHAPE)
    parser.add_argument("--ops", nargs="+", choices=["dispatch", "combine"], default=["dispatch", "combine"],
                        help="the ops to time (default both)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "xla"],
                        help="the Buffer backend to measure (the xla backend is timed as a baseline)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="num_max_dispatch_tokens_per_rank (default: --tokens)")
    parser.add_argument("--masked", type=int, default=0,
                        help="top-k entries per rank set to -1 at random (DeepEP's test sets 10)")
    parser.add_argument("--overlap-size", type=int, default=0,
                        help="S of the [S, S] bf16 matmul between send and receive halves (default 4096, 128 on CPU)")
    harness.add_output_arguments(parser)


def _custom_calls(mesh, fn, *fn_args) -> list[str]:
    """The jax_ep FFI targets in the lowered program of `fn`: which implementation a Buffer's ops really run."""
    text = harness.spmd(mesh, fn).lower(*fn_args).as_text()
    return sorted(set(re.findall(r"custom_call @(jax_ep\w*)", text)))


def _independent_compute(a):
    """The computation scheduled between a send half and its receive half: a bf16 matmul [S, S] @ [S, S],
    reduced to a scalar so that XLA must compute all of it."""
    return jnp.sum(jnp.dot(a, a, preferred_element_type=jnp.float32))


# ---- the low-latency kernels' own clocks (Buffer.backend_impl.low_latency_trace) ---------------------------------------------

# What each kernel's phase times are summed over (csrc/low_latency_*.cu, the kernels' clock_mark calls).
_TRACE_UNITS = {"dispatch send": "block", "dispatch recv": "block", "combine send": "block",
                "combine recv": "(token, part)"}


def trace_breakdown(traces: list[dict], op: str) -> dict | None:
    """Where the time of `op` ("dispatch" or "combine") went on the GPUs, from `backend_impl.low_latency_trace` of the
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


def breakdown_lines(b: dict, op: str, kernel_device: str) -> list[str]:
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


def run(args) -> dict:
    mesh = harness.ep_mesh(args)
    devices, num_ranks = list(mesh.devices.flat), mesh.devices.size
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    M = args.max_tokens or T
    L = E // num_ranks
    rng = np.random.default_rng(0)
    topk_idx_host = harness.random_topk_idx(rng, num_ranks, T, K, E)
    # DeepEP's test_low_latency sets a few random entries of each rank to -1 (no expert).
    for r in range(num_ranks):
        for _ in range(args.masked):
            topk_idx_host[r * T + rng.integers(T), rng.integers(K)] = -1
    topk_idx = harness.global_array(mesh, topk_idx_host)
    topk_weights = harness.global_array(mesh, np.abs(rng.standard_normal((num_ranks * T, K))).astype(np.float32))
    x = harness.global_array(mesh, rng.standard_normal((num_ranks * T, H), dtype=np.float32).astype(jnp.bfloat16))
    size = args.overlap_size or (128 if devices[0].platform == "cpu" else 4096)
    a = harness.global_array(mesh, (rng.standard_normal((num_ranks * size, size), dtype=np.float32) / np.sqrt(size))
                .astype(jnp.bfloat16))

    # DeepEP's byte count: per valid (token, expert) pair, counted on the sending rank; the mean over ranks
    # (= sum / R) of those pairs, against the time of the SPMD program (equal on every rank). "NVL" leaves
    # out the pairs whose expert lives on the token's own rank.
    valid = topk_idx_host >= 0
    remote = valid & (topk_idx_host // L != np.repeat(np.arange(num_ranks), T)[:, None])
    pairs, remote_pairs = valid.sum() / num_ranks, remote.sum() / num_ranks
    pair_bytes = {("dispatch", "FP8"): H + H // FP8_GROUP * 4 + 16, ("dispatch", "BF16"): 2 * H,
                  ("combine", "BF16"): logfmt.bytes_per_row(H, compressed=False),
                  ("combine", "LogFMT"): logfmt.bytes_per_row(H, compressed=True)}
    setup = dict(num_ranks=num_ranks, device=devices[0].device_kind, tokens=T, hidden=H, topk=K, experts=E,
                 num_max_dispatch_tokens_per_rank=M, masked_per_rank=args.masked, valid_pairs_per_rank=float(pairs),
                 remote_pairs_per_rank=float(remote_pairs), iters=args.iters, repeats=args.repeats,
                 overlap_matmul_size=size, process_model=harness.process_model(args), ops=list(args.ops),
                 baselines=args.baselines)
    results, splits = [], []
    print(f"[low_latency] {num_ranks} ranks ({devices[0].device_kind}), {harness.process_model(args)}, "
          f"T={T} H={H} K={K} E={E} M={M}, "
          f"{pairs:.1f} valid (token, expert) pairs per rank ({remote_pairs:.1f} to other ranks); "
          f"times per op: (wall(program of {2 * args.iters} ops) - wall(program of {args.iters} ops)) / "
          f"{args.iters}, median of {args.repeats} (host clock: the difference also carries how far apart the "
          "host started the GPUs of each program; the cuda lines' \"on the GPU\" figures do not)", flush=True)

    if "combine" in args.ops:
        plain, encoded = (pairs * pair_bytes["combine", p] for p in ("BF16", "LogFMT"))
        setup["combine_bytes_per_rank"] = dict(BF16=float(plain), LogFMT=float(encoded))
        print(f"[low_latency] combine payload per rank (valid pairs x row bytes): BF16 {plain / 1e6:.3f} MB, "
              f"LogFMT-compressed {encoded / 1e6:.3f} MB ({encoded / plain:.1%}; compression='logfmt')", flush=True)

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
        for line in breakdown_lines(breakdown, op, kernel_device) if breakdown else ():
            print(f"[low_latency]   {line}", flush=True)

    def time_op(op, fn_args):
        # Every program chains one payload element as well as the routing: the xla backend's all_gather of x
        # does not depend on the routing and would otherwise run once per timed sequence.
        return harness.time_per_op(mesh, op, fn_args, args, chain_data=True)

    def time_op_and_kernels(op, fn_args, buf, name):
        """time_op, and for a cuda Buffer the kernels' own account of the timed calls (trace_breakdown of op
        `name`), else None."""
        if buf.backend != "cuda" or not _native.with_instrumentation():
            return time_op(op, fn_args), None
        seconds = harness.time_per_op(mesh, op, fn_args, args, chain_data=True,
                               before_timing=lambda: buf.backend_impl.low_latency_trace(reset=True))
        return seconds, trace_breakdown(buf.backend_impl.low_latency_trace(), name)

    chain = time_op(lambda idx, data: data[:1, :1], (topk_idx, x))
    setup["loop_overhead_us"] = chain * 1e6
    print(f"[low_latency] timing loop: {chain * 1e6:.2f} us per step to chain one op to the next (routing + one "
          f"payload element), included in every figure below", flush=True)

    def ops_of(buf):
        def dispatch(use_fp8):
            return lambda idx, data: jax_ep.low_latency_dispatch(buf, data, idx, use_fp8=use_fp8)

        def combine(compression=None):
            def op(routing, y):
                idx, weights, handle = routing
                return jax_ep.low_latency_combine(buf, y, idx, weights, handle, compression=compression)
            return op

        recv_bf16 = harness.spmd(mesh, lambda i, d: (lambda r: (r.recv_x, r.handle))(dispatch(False)(i, d)))(
            topk_idx, x)
        return dispatch, combine, (topk_idx, topk_weights, recv_bf16[1]), recv_bf16[0]

    def time_all(buf, backend):
        dispatch, combine, combine_routing, y = ops_of(buf)
        for payload, use_fp8 in (("FP8", True), ("BF16", False)) if "dispatch" in args.ops else ():
            report(backend, "dispatch", payload,
                   *time_op_and_kernels(dispatch(use_fp8), (topk_idx, x), buf, "dispatch"))
        if "combine" in args.ops:
            report(backend, "combine", "BF16", *time_op_and_kernels(combine(), (combine_routing, y), buf, "combine"))
            report(backend, "combine", "LogFMT",
                   *time_op_and_kernels(combine("logfmt"), (combine_routing, y), buf, "combine"))
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
                return recv(harness.depend(pending, _independent_compute(mat)))
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
        for backend, op, payload, seconds in baseline_times("low_latency", mesh, args, topk_idx, x, E, fp8=True,
                                                            chain_data=True, ops=args.ops):
            report(backend, op, payload, seconds)
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
