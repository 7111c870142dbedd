"""The pure-JAX baselines of dispatch and combine that the intranode, internode and low_latency modes print beside
jax_ep's figures: MaxText-style `ragged_all_to_all` and a dense `all_to_all` (per rank, inside shard_map)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep.bench.harness import spmd, time_per_op


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


def baseline_times(mode: str, mesh, args, topk_idx, x, num_experts, fp8: bool = False, chain_data: bool = False,
                   ops=("dispatch", "combine")):
    """Yields (backend, op, payload, seconds per op) for the pure-JAX baselines of `ops` (MaxText-style
    ragged_all_to_all, dense all_to_all; with `fp8` also the dense dispatch of the FP8 pair); prints why a
    baseline did not run, on a line of `mode`'s."""
    for backend, op, payload, result in _baseline_times(mesh, args, topk_idx, x, num_experts, fp8, chain_data, ops):
        if isinstance(result, str):
            print(f"[{mode}] {backend}: {result}", flush=True)
        else:
            yield backend, op, payload, result


def _baseline_times(mesh, args, topk_idx, x, num_experts, fp8, chain_data, ops):
    """baseline_times' figures, or (backend, None, None, why it did not run)."""
    num_ranks, (num_tokens, hidden) = mesh.devices.size, (topk_idx.shape[0] // mesh.devices.size, x.shape[1])
    ragged = "jax ragged_all_to_all"
    if mesh.devices.flat[0].platform == "cpu":
        yield ragged, None, None, "not run (XLA:CPU has no ragged-all-to-all)"
    else:
        try:
            if "dispatch" in ops:
                yield ragged, "dispatch", "BF16", time_per_op(
                    mesh, functools.partial(_ragged_dispatch, num_experts=num_experts), (topk_idx, x), args,
                    unroll=False, chain_data=chain_data)
            if "combine" in ops:
                routing = spmd(mesh, lambda i: {**_ragged_routing(i, num_experts),
                                                "num_topk": jnp.zeros((i.shape[1],), jnp.int32)})(topk_idx)
                y_ragged = spmd(mesh, functools.partial(_ragged_dispatch, num_experts=num_experts))(topk_idx, x)
                yield ragged, "combine", "BF16", time_per_op(mesh, _ragged_combine, (routing, y_ragged), args,
                                                             unroll=False, chain_data=chain_data)
        except Exception as e:  # noqa: BLE001 -- a baseline that XLA cannot run is reported, not fatal
            yield ragged, None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    dense = "jax all_to_all"
    if "dispatch" in ops:
        yield dense, "dispatch", "BF16", time_per_op(
            mesh, functools.partial(_dense_dispatch, num_experts=num_experts), (topk_idx, x), args,
            chain_data=chain_data)
        if fp8:
            def dense_fp8(idx, data):
                e4m3, scales = jax_ep.per_token_cast_to_fp8(data)
                # The e4m3 bytes travel as uint8: the same bytes, and a type every collective library has.
                return tuple(_dense_dispatch(idx, leaf, num_experts=num_experts)
                             for leaf in (jax.lax.bitcast_convert_type(e4m3, jnp.uint8), scales))

            yield dense, "dispatch", "FP8", time_per_op(mesh, dense_fp8, (topk_idx, x), args, chain_data=chain_data)
    if "combine" in ops:
        y_dense = spmd(mesh, functools.partial(_dense_dispatch, num_experts=num_experts))(topk_idx, x).reshape(
            -1, hidden)
        in_rank = spmd(mesh, lambda i: jnp.any(i[:, :, None] // (num_experts // num_ranks) == jnp.arange(num_ranks),
                                               axis=1).astype(jnp.int32) - 1)(topk_idx)
        yield dense, "combine", "BF16", time_per_op(
            mesh, lambda r, y: _dense_combine(r, y.reshape(num_ranks, num_tokens, hidden)), (in_rank, y_dense), args,
            chain_data=chain_data)
