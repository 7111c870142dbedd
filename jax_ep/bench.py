"""Benchmarks: `python -m jax_ep.bench intranode [--sms 24 32 ...] [--json PATH]`.

intranode: normal-mode dispatch (BF16 and the FP8 pair) and combine (BF16) over every local GPU of this
process, DeepEP's shape by default (T=4096, H=7168, K=8, E=256), for the `cuda` backend at each `--sms` value
and the pure-JAX `xla` backend as the baseline. Each op runs `--iters` times inside one jitted
`lax.fori_loop`; time per op = wall time / iters after a warm-up, median over `--repeats` runs. Bandwidth is
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
from jax_ep.config import FP8_GROUP


def _topk_idx(rng: np.random.Generator, num_ranks: int, num_tokens: int, num_topk: int, num_experts: int) -> np.ndarray:
    """DeepEP's test routing: the top-k of random scores, so every token has k distinct experts."""
    scores = rng.random((num_ranks * num_tokens, num_experts))
    return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def _spmd(mesh: Mesh, body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _depend(array, value):
    """`array` made to depend on `value` (adds a run-time zero) so XLA cannot hoist loop-invariant ops."""
    zero = (jnp.asarray(value, jnp.float32) * 0).astype(array.dtype)
    return array + zero


def _median_time_per_iter(fn, args, iters: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def _dispatch_once(buf, num_experts: int, x, topk_idx):
    """One dispatch: the received row count (for the byte count), recv_x and handle (the combine's input)."""
    d = jax_ep.dispatch(buf, x, topk_idx, num_experts=num_experts)
    return d.num_recv_tokens[None], d.recv_x, d.handle


def _dispatch_loop(mesh, buf, num_experts: int, iters: int):
    def body(x, topk_idx):
        def step(_, carry):
            idx, total = carry
            num_recv = jax_ep.dispatch(buf, x, idx, num_experts=num_experts).num_recv_tokens
            return _depend(idx, num_recv), total + num_recv

        total = topk_idx[0, 0] * 0  # varying over the EP axis, like the loop's output
        return jax.lax.fori_loop(0, iters, step, (topk_idx, total))[1][None]

    return _spmd(mesh, body)


def _combine_loop(mesh, buf, iters: int):
    def body(y, handle):
        def step(_, carry):
            handle, total = carry
            out = jax_ep.combine(buf, y, handle).x
            probe = out[0, 0].astype(jnp.float32)
            handle = jax.tree.map(lambda a: _depend(a, probe) if a.dtype == jnp.int32 else a, handle)
            return handle, total + probe

        total = y[0, 0].astype(jnp.float32) * 0  # varying over the EP axis, like the loop's output
        return jax.lax.fori_loop(0, iters, step, (handle, total))[1][None]

    return _spmd(mesh, body)


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

    runs = [("xla", None)] if args.xla else []
    runs += [("cuda", sms) for sms in args.sms]
    records = []
    for backend, sms in runs:
        config = jax_ep.Config() if sms is None else jax_ep.Config(num_sms=sms)
        with jax_ep.Buffer(mesh, "ep", backend=backend, config=config) as buf:
            num_recv, recv_x, handle = _spmd(mesh, functools.partial(_dispatch_once, buf, E))(x, topk_idx)
            recv_rows = float(np.mean(jax.device_get(num_recv)))
            bf16_bytes = recv_rows * H * 2
            cases = [
                ("dispatch", "BF16", _dispatch_loop(mesh, buf, E, args.iters), (x, topk_idx), bf16_bytes),
                ("dispatch", "FP8", _dispatch_loop(mesh, buf, E, args.iters), (x_fp8, topk_idx),
                 recv_rows * H * (1 + 4 / FP8_GROUP)),
                ("combine", "BF16", _combine_loop(mesh, buf, args.iters), (recv_x, handle), bf16_bytes),
            ]
            for op, payload, fn, fn_args, nbytes in cases:
                seconds = _median_time_per_iter(fn, fn_args, args.iters, args.repeats)
                record = dict(backend=backend, op=op, payload=payload, num_sms=sms, num_ranks=num_ranks, tokens=T,
                              hidden=H, topk=K, experts=E, recv_rows=recv_rows, t_us=seconds * 1e6,
                              gbps=nbytes / seconds / 1e9)
                records.append(record)
                sm_text = "" if sms is None else f", SMs {sms}"
                print(f"[intranode] {backend} {op} ({payload}{sm_text}): {record['gbps']:.2f} GB/s (NVL), "
                      f"t: {record['t_us']:.2f} us", flush=True)
    return records


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
    parser.add_argument("--no-xla", dest="xla", action="store_false", help="skip the xla backend baseline")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    records = intranode(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
