"""The cuda backend's low-latency path on CPU: what can be checked without a GPU. The ops trace and lower
(forward, split halves, gradients) to the four custom calls with the Buffer's attributes; the region size
formula; clear errors for a Buffer without a low-latency region and for too many top-k entries.
Lowering compiles and runs nothing, so a Buffer made for the xla backend stands in for a cuda one."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import mesh_of
from jax_ep import cuda_low_latency

R, T, H, K, E, M = 4, 8, 512, 3, 8, 16


def cuda_standin(low_latency_offset=0):
    if not cuda_low_latency.available():
        pytest.skip("this build has no CUDA low-latency kernels")
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="xla", num_max_dispatch_tokens_per_rank=M, hidden=H, num_experts=E)
    buf.backend, buf.low_latency_offset, buf.low_latency_transport = "cuda", low_latency_offset, "peer_stores"
    return buf


def lower(buf, body, *shapes):
    args = [jnp.zeros((R * s[0], *s[1:]), dtype) for s, dtype in shapes]
    return jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()


X, IDX, W = ((T, H), jnp.bfloat16), ((T, K), jnp.int32), ((T, K), jnp.float32)


def test_ops_and_gradients_lower_to_the_custom_calls():
    buf = cuda_standin(low_latency_offset=4096)

    def body(x, idx, w):
        def loss(x, w):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            return jnp.sum(jax_ep.low_latency_combine(buf, d.recv_x * 2, idx, w, d.handle).astype(jnp.float32))

        d_x, d_w = jax.grad(loss, argnums=(0, 1))(x, w)
        d = jax_ep.low_latency_dispatch_recv(
            buf, jax_ep.low_latency_dispatch_send(buf, x, idx, round_scale=True, use_ue8m0=True))
        out = jax_ep.low_latency_combine_recv(buf, jax_ep.low_latency_combine_send(buf, d.recv_x[0].astype(jnp.bfloat16),
                                                                                   idx, w, d.handle))
        return d_x, d_w, d.recv_x[1], out

    text = lower(buf, body, X, IDX, W)
    calls = re.findall(r"custom_call @(jax_ep_low_latency_\w+)\([^\n]*ll_offset = 4096[^\n]*num_max_tokens = 16[^\n]*"
                       r"transport = 0", text)
    assert sorted(set(calls)) == ["jax_ep_low_latency_combine_recv", "jax_ep_low_latency_combine_send",
                                  "jax_ep_low_latency_dispatch_recv", "jax_ep_low_latency_dispatch_send"], calls
    assert "payload = 2" in text  # FP8 with UE8M0 scales


def test_buffer_without_low_latency_region():
    buf = cuda_standin(low_latency_offset=None)
    with pytest.raises(RuntimeError, match="the cuda Buffer has no low-latency region"):
        lower(buf, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_count, X, IDX)


def test_topk_beyond_the_kernels_limit():
    buf = cuda_standin()
    with pytest.raises(ValueError, match=r"low_latency_dispatch \(cuda\): at most 16 top-k entries per token, got 17"):
        lower(buf, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_count, X, ((T, 17), jnp.int32))


def test_topk_entries_beyond_the_kernels_limit():
    """The send keeps a rank's routing in shared memory: T * K <= 8192."""
    tokens, topk = 1024, 9
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="xla", num_max_dispatch_tokens_per_rank=tokens, hidden=H,
                        num_experts=E)
    buf.backend, buf.low_latency_offset, buf.low_latency_transport = "cuda", 0, "peer_stores"
    with pytest.raises(ValueError, match=r"at most 8192 top-k entries per rank \(tokens \* top-k, e.g. 512 \* 16\), "
                                         r"got 1024 \* 9"):
        lower(buf, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_count, ((tokens, H), jnp.bfloat16),
              ((tokens, topk), jnp.int32))


def test_region_size():
    # header + trace (4 kernels x 256 calls x 11 words) + a dispatch send counter per expert (8 bytes) + a combine
    # send counter per (local expert, source rank) (4 bytes) + staging rows + 2 sets of
    # (2 flag arrays + an int32 index of E*M positions + R*M dispatch rows + 16*M combine rows); a dispatch row
    # is a 48-byte row header and 2H bytes, a combine row 2H bytes; the counters, the flag arrays, the index and
    # the row arrays each start 256-byte aligned (here every size but the counters' and the flags' already is a
    # multiple of 256).
    dispatch_row, combine_row = 48 + 2 * H, 2 * H
    trace, counters, flags = 4 * 256 * 11 * 8, 2 * 256, 2 * 256  # E * 8 and E * 4 bytes, each aligned up
    index = E * M * 4
    assert (M * dispatch_row) % 256 == 0 and index % 256 == 0 and trace % 256 == 0
    set_bytes = flags + index + R * M * dispatch_row + 16 * M * combine_row
    assert jax_ep.low_latency_buffer_bytes(M, H, R, E) == 512 + trace + counters + M * dispatch_row + 2 * set_bytes
