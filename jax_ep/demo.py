"""`python -m jax_ep.demo`: one expert-parallel MoE step (router -> dispatch -> per-expert FFN -> combine,
forward and backward) on the devices present, checked against a single-device dense computation.

Without a GPU it runs on 8 virtual CPU devices."""
from __future__ import annotations

from jax_ep import environment

environment.virtual_cpu_devices(8)  # before JAX starts its CPU backend (at first use); GPUs ignore it

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402


def route(x, router, num_topk):
    probs = jax.nn.softmax(x.astype(jnp.float32) @ router, axis=-1)
    weights, idx = jax.lax.top_k(probs, num_topk)
    return idx.astype(jnp.int32), weights / jnp.sum(weights, axis=-1, keepdims=True)


def expert_ffn(h, w_in, w_out):
    """SwiGLU-free two-layer FFN of one expert: [N, D] -> [N, D]."""
    return jax.nn.gelu(h @ w_in) @ w_out


def dense_moe(params, x, num_topk):
    """Single-device reference: every token through its top-k experts, weighted sum."""
    idx, weights = route(x, params["router"], num_topk)
    all_out = jax.vmap(expert_ffn, in_axes=(None, 0, 0))(x, params["w_in"], params["w_out"])  # [E, T, D]
    picked = all_out[idx, jnp.arange(x.shape[0])[:, None]]  # [T, K, D]
    return jnp.sum(weights[..., None] * picked, axis=1)


def ep_moe(buffer, params, x, num_topk, num_experts):
    """Per-rank body inside shard_map: local experts w_in/w_out are [L, D, F] / [L, F, D]."""
    idx, weights = route(x, params["router"], num_topk)
    d = jax_ep.dispatch(buffer, x, idx, weights, num_experts=num_experts)
    local = jax.vmap(expert_ffn, in_axes=(None, 0, 0))(d.recv_x, params["w_in"], params["w_out"])  # [L, C, D]
    # Gate weight of each local expert per received row (ids are local; -1 where the expert is elsewhere).
    gate = jnp.sum(jnp.where(d.recv_topk_idx[..., None] == jnp.arange(local.shape[0]), d.recv_topk_weights[..., None], 0.0), axis=1)
    y = jnp.einsum("cl,lcd->cd", gate, local)
    return jax_ep.combine(buffer, y, d.handle).x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts-per-rank", type=int, default=2,
                        help="raised where the ranks would hold fewer experts than --topk (e.g. on one GPU)")
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "xla"])
    args = parser.parse_args(argv)

    devices = jax.devices()
    num_ranks = len(devices)
    num_experts = max(args.experts_per_rank, -(-args.topk // num_ranks)) * num_ranks
    mesh = Mesh(np.array(devices), ("ep",))
    buffer = jax_ep.Buffer(mesh, "ep", backend=args.backend)
    print(f"devices: {num_ranks} x {devices[0].platform} ({devices[0].device_kind}); jax_ep backend: {buffer.backend}")
    print(f"shape: {args.tokens} tokens/rank, hidden {args.hidden}, ffn {args.ffn}, {num_experts} experts, top-{args.topk}")

    keys = jax.random.split(jax.random.key(0), 4)
    scale = args.hidden ** -0.5
    params = {
        "router": jax.random.normal(keys[0], (args.hidden, num_experts)) * scale,
        "w_in": jax.random.normal(keys[1], (num_experts, args.hidden, args.ffn)) * scale,
        "w_out": jax.random.normal(keys[2], (num_experts, args.ffn, args.hidden)) * args.ffn ** -0.5,
    }
    x = jax.random.normal(keys[3], (num_ranks * args.tokens, args.hidden))

    param_specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}
    params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in param_specs.items()})
    x = jax.device_put(x, NamedSharding(mesh, P("ep")))

    ep_forward = jax.shard_map(
        lambda p, t: ep_moe(buffer, p, t, args.topk, num_experts),
        mesh=mesh, in_specs=(param_specs, P("ep")), out_specs=P("ep"),
    )

    def loss(forward, p, t):
        return jnp.mean(forward(p, t) ** 2)

    ep_step = jax.jit(jax.value_and_grad(lambda p, t: loss(ep_forward, p, t), argnums=(0, 1)))
    dense_step = jax.jit(jax.value_and_grad(lambda p, t: loss(lambda q, u: dense_moe(q, u, args.topk), p, t), argnums=(0, 1)))

    def timed(step):
        t0 = time.perf_counter()
        out = jax.block_until_ready(step(params, x))
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, x))
            runs.append(time.perf_counter() - t0)
        return out, compile_s, float(np.median(runs))

    (ep_loss, ep_grads), ep_compile, ep_time = timed(ep_step)
    (ref_loss, ref_grads), ref_compile, ref_time = timed(dense_step)

    def rel_err(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    errors = {"loss": rel_err(ep_loss, ref_loss), "d x": rel_err(ep_grads[1], ref_grads[1])}
    for name in ("router", "w_in", "w_out"):
        errors[f"d {name}"] = rel_err(ep_grads[0][name], ref_grads[0][name])
    ok = all(e < 1e-4 for e in errors.values())
    print("check against the single-device dense MoE (relative L2 error, float32):")
    for name, err in errors.items():
        print(f"  {name:10s} {err:.2e}")
    print(f"timings (median of 5, forward + backward): expert-parallel {ep_time * 1e3:.2f} ms "
          f"(compile {ep_compile:.1f} s), dense reference {ref_time * 1e3:.2f} ms (compile {ref_compile:.1f} s)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
