"""Narrows a failing intranode program down to one op: python tests/gpu/diag.py MODE (one process per mode)."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep

mode = sys.argv[1]
R, T, H, K, E = 2, 24, 1536, 8, 64
mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
buf = jax_ep.Buffer(mesh, "ep", backend="cuda")
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
idx = jnp.asarray(rng.integers(0, E, (R * T, K)), jnp.int32)
w = jnp.asarray(rng.random((R * T, K)), jnp.float32)


def body(x, idx, w):
    d = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
    outs = [d.recv_x]
    if "cached" in mode:
        outs.append(jax_ep.dispatch(buf, x.astype(jnp.float32), handle=d.handle).recv_x)
    if "combine" in mode:
        outs.append(jax_ep.combine(buf, d.recv_x, d.handle).x)
    if "weights" in mode:
        outs.append(jax_ep.combine(buf, d.recv_x, d.handle, topk_weights=d.recv_topk_weights).topk_weights)
    return outs


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
try:
    out = jax.block_until_ready(f(x, idx, w))
    print(mode, "OK", [o.shape for o in out])
except Exception as e:  # noqa: BLE001
    print(mode, "FAILED", str(e).splitlines()[0][:200])
    print(jax_ep.cuda_backend.errors(buf) if hasattr(jax_ep, "cuda_backend") else "")
