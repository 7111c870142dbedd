"""Benchmarks: `python -m jax_ep.bench intranode [--sms 24 32 ...] [--json PATH]`.

intranode: normal-mode dispatch (BF16 and the FP8 pair) and combine (BF16) over every local GPU of this
process, DeepEP's shape by default (T=4096, H=7168, K=8, E=256), for the `cuda` backend at each `--sms` value
and the pure-JAX baselines. Each op runs in jitted sequences of `--iters` and 2×`--iters` ops; time per op =
the difference of their wall times / iters after a warm-up, median over `--repeats` runs. Bandwidth is
counted as DeepEP counts it (ARCHITECTURE.md §5): received rows × H × 2 bytes for BF16 (dispatch and combine),
× (1 + 4/128) / 2 of that for FP8, per rank, averaged over ranks.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import cuda_backend
from jax_ep.config import FP8_GROUP


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


def _timed_loop(mesh, op, iters: int, unroll: bool = True):
    """jit(shard_map(...)) running `op(routing, *data)` `iters` times in a row, unrolled: an XLA while loop
    adds a host round trip per iteration, which is the loop's cost, not the op's (the ragged_all_to_all
    baseline keeps the loop: unrolled, XLA reserves collective memory for every call). One element of each
    op's output feeds the next op's routing. A custom call always writes all its outputs; for the pure-JAX
    baselines XLA may skip local work after the collective that the probe does not need (which only
    flatters them)."""

    def body(routing, *data):
        def step(_, carry):
            routing, total = carry
            out = op(routing, *data)
            probe = jax.tree.leaves(out)[0].ravel()[0].astype(jnp.float32)
            return _depend(routing, probe), total + probe

        return jax.lax.fori_loop(0, iters, step, (routing, jnp.float32(0)), unroll=unroll)[1][None]

    return _spmd(mesh, body)


def _time_per_op(mesh, op, fn_args, args, unroll: bool = True, before_timing=None) -> float:
    """Seconds per op: (time of a sequence of 2n ops - time of n ops) / n, median over repeats. The fixed
    cost of launching a program on every device and waiting for it cancels out."""
    short, long = (_timed_loop(mesh, op, n, unroll) for n in (args.iters, 2 * args.iters))
    for fn in (short, long):
        jax.block_until_ready(fn(*fn_args))  # compile and warm up
    if before_timing:
        before_timing()

    def wall(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        return time.perf_counter() - start

    return statistics.median((wall(long) - wall(short)) / args.iters for _ in range(args.repeats))


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


def intranode(args) -> list[dict]:
    devices = jax.local_devices()[: args.ranks or None]
    num_ranks = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    rng = np.random.default_rng(0)
    topk_idx = _topk_idx(rng, num_ranks, T, K, E)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H), dtype=np.float32), jnp.bfloat16)
    x_fp8 = jax.jit(jax_ep.per_token_cast_to_fp8)(x)
    print(f"[intranode] {num_ranks} ranks ({devices[0].device_kind}), T={T} H={H} K={K} E={E}, "
          f"{args.iters} ops per timed loop, median of {args.repeats}", flush=True)
    records = []

    def report(backend, op, payload, sms, seconds, nbytes, kernel_seconds=None):
        record = dict(backend=backend, op=op, payload=payload, num_sms=sms, num_ranks=num_ranks, tokens=T, hidden=H,
                      topk=K, experts=E, recv_rows=recv_rows, t_us=seconds * 1e6, gbps=nbytes / seconds / 1e9,
                      nvl_gbps=nbytes * remote_fraction / seconds / 1e9)
        sm_text = "" if sms is None else f", SMs {sms}"
        line = (f"[intranode] {backend} {op} ({payload}{sm_text}): {record['gbps']:.2f} GB/s (logical), "
                f"{record['nvl_gbps']:.2f} GB/s (NVL), t: {record['t_us']:.2f} us")
        if kernel_seconds:
            record.update(kernel_us=kernel_seconds * 1e6, in_jit_overhead=seconds / kernel_seconds - 1)
            line += f", kernel t: {record['kernel_us']:.2f} us (in-jit overhead {100 * record['in_jit_overhead']:+.1f}%)"
        records.append(record)
        print(line, flush=True)

    # DeepEP's byte count: received rows (one per (token, destination rank)) of the BF16 / FP8 payload.
    with jax_ep.Buffer(mesh, "ep", backend="xla") as buf:
        num_recv = _spmd(mesh, lambda i: jax_ep.get_dispatch_layout(buf, i, E).num_tokens_per_rank)(topk_idx)
    per_pair = np.asarray(jax.device_get(num_recv)).reshape(num_ranks, num_ranks)  # [source, destination]
    recv_rows = float(np.mean(per_pair.sum(axis=0)))
    # NVLink figure: self traffic (a rank's tokens to itself) excluded.
    remote_fraction = 1.0 - float(np.trace(per_pair)) / float(per_pair.sum())
    bf16_bytes, fp8_bytes = recv_rows * H * 2, recv_rows * H * (1 + 4 / FP8_GROUP)

    if args.baselines and devices[0].platform == "cpu":
        print("[intranode] jax ragged_all_to_all: not run (XLA:CPU has no ragged-all-to-all)", flush=True)
    elif args.baselines:
        report("jax ragged_all_to_all", "dispatch", "BF16", None, _time_per_op(
            mesh, functools.partial(_ragged_dispatch, num_experts=E), (topk_idx, x), args, unroll=False), bf16_bytes)
        routing = _spmd(mesh, lambda i: {**_ragged_routing(i, E), "num_topk": jnp.zeros((K,), jnp.int32)})(topk_idx)
        y_ragged = _spmd(mesh, functools.partial(_ragged_dispatch, num_experts=E))(topk_idx, x)
        report("jax ragged_all_to_all", "combine", "BF16", None,
               _time_per_op(mesh, _ragged_combine, (routing, y_ragged), args, unroll=False), bf16_bytes)
    if args.baselines:
        report("jax all_to_all", "dispatch", "BF16", None,
               _time_per_op(mesh, functools.partial(_dense_dispatch, num_experts=E), (topk_idx, x), args), bf16_bytes)
        y_dense = _spmd(mesh, functools.partial(_dense_dispatch, num_experts=E))(topk_idx, x).reshape(-1, H)
        in_rank = _spmd(mesh, lambda i: jnp.any(i[:, :, None] // (E // num_ranks) == jnp.arange(num_ranks), axis=1)
                        .astype(jnp.int32) - 1)(topk_idx)
        report("jax all_to_all", "combine", "BF16", None, _time_per_op(
            mesh, lambda r, y: _dense_combine(r, y.reshape(num_ranks, T, H)), (in_rank, y_dense), args), bf16_bytes)

    runs = [("xla", None)] if args.xla else []
    runs += [("cuda", sms) for sms in args.sms]
    for backend, sms in runs:
        config = jax_ep.Config() if sms is None else jax_ep.Config(num_sms=sms)
        with jax_ep.Buffer(mesh, "ep", backend=backend, config=config) as buf:
            def dispatch(idx, payload):
                return jax_ep.dispatch(buf, payload, idx, num_experts=E)

            def combine(handle, y):
                return jax_ep.combine(buf, y, handle).x

            def timed(op, fn_args):
                """(in-jit seconds per op, bare kernel seconds per op or None)."""
                if backend != "cuda":
                    return _time_per_op(mesh, op, fn_args, args), None
                seconds = _time_per_op(mesh, op, fn_args, args, before_timing=lambda: cuda_backend.kernel_times(buf, reset=True))
                times = cuda_backend.kernel_times(buf)
                return seconds, float(np.mean([ns / calls for calls, ns in times])) * 1e-9

            d = _spmd(mesh, lambda i, p: (lambda r: (r.recv_x, r.handle))(dispatch(i, p)))(topk_idx, x)
            for payload, data, nbytes in (("BF16", x, bf16_bytes), ("FP8", x_fp8, fp8_bytes)):
                seconds, kernel_seconds = timed(dispatch, (topk_idx, data))
                report(backend, "dispatch", payload, sms, seconds, nbytes, kernel_seconds)
            seconds, kernel_seconds = timed(combine, (d[1], d[0]))
            report(backend, "combine", "BF16", sms, seconds, bf16_bytes, kernel_seconds)
    return records


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_ep.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["intranode"])
    parser.add_argument("--ranks", type=int, default=0, help="GPUs to use (default: every local GPU)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sms", type=int, nargs="*", default=[24],
                        help="Config.num_sms values for the cuda backend (none: skip the cuda backend)")
    parser.add_argument("--iters", type=int, default=20, help="ops per timed jitted loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xla", action="store_true",
                        help="also time jax_ep's xla backend (its all_gather of the payload does not depend on the "
                             "routing, so XLA computes it once for the whole timed sequence: not a fair figure)")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="skip the pure-JAX baselines (ragged_all_to_all MaxText-style, dense all_to_all)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--plot", help="write a PNG of GB/s against the SM count to this file")
    args = parser.parse_args(argv)
    records = intranode(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot:
        plot_sm_sweep(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
