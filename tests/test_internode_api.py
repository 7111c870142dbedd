"""The internode mode on CPU: what can be checked without GPUs. Buffer arguments (ranks_per_node,
num_rdma_bytes) and backend selection; how hosts make nodes; the region sizes against the layout's description;
the ops trace and lower (forward, FP8, cached dispatch, bias, gradients) to the internode custom calls; a call
that needs more than num_rdma_bytes, and a foreign handle, raise before anything runs. Lowering compiles and runs
nothing, so a Buffer made for the xla backend, holding an internode backend that allocated nothing, stands in for
an internode one."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import mesh_of, with_standin_backend
from jax_ep import _native
from jax_ep.backends.cuda import internode, intranode, low_latency

R, T, H, K, E = 4, 8, 256, 3, 8
PER_NODE = 2


# ---- Buffer arguments and backend selection -------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, 3, 8, -2, True, 2.0, "2"])
def test_ranks_per_node_must_divide_the_axis(value):
    with pytest.raises(ValueError, match=re.escape("ranks_per_node must be a positive divisor of the 4 ranks on "
                                                   f"axis 'ep', got {value!r}")):
        jax_ep.Buffer(mesh_of(R), "ep", backend="xla", ranks_per_node=value)


def test_num_rdma_bytes_is_checked():
    with pytest.raises(ValueError, match="num_rdma_bytes must be >= 0, got -1"):
        jax_ep.Buffer(mesh_of(R), "ep", backend="xla", num_rdma_bytes=-1)
    with pytest.raises(TypeError, match="num_rdma_bytes must be an integer"):
        jax_ep.Buffer(mesh_of(R), "ep", backend="xla", num_rdma_bytes=1.5)


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_cpu_meshes_use_the_xla_backend(backend):
    with jax_ep.Buffer(mesh_of(R), "ep", backend=backend, ranks_per_node=PER_NODE) as buf:
        assert (buf.backend, buf.internode, buf.ranks_per_node) == ("xla", False, PER_NODE)


def test_cuda_backend_needs_cuda_devices():
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA devices"):
        jax_ep.Buffer(mesh_of(R), "ep", backend="cuda", ranks_per_node=PER_NODE)


def test_unsupported_reason_names_the_requirement():
    """One process drives every device here: internode mode needs one per GPU (or, without NVSHMEM, the build)."""
    reason = internode.unsupported_reason(mesh_of(R), "ep", PER_NODE)
    expected = "one process per GPU" if internode.available() else "need NVSHMEM"
    assert reason is not None and expected in reason, reason


def test_more_ranks_than_the_limit_are_refused():
    """64 ranks at most (the internode and the low-latency kernels' limit), 8 per node: the reason names the limit
    (backend="cuda" raises it, "auto" warns with it and takes the xla backend)."""
    from types import SimpleNamespace

    assert internode.MAX_RANKS == low_latency.MAX_RANKS == 64
    mesh_shaped = lambda ranks: SimpleNamespace(shape={"ep": ranks})  # noqa: E731  (the limits need no devices)
    assert (internode.unsupported_reason(mesh_shaped(2 * internode.MAX_RANKS), "ep", 8) ==
            "internode mode supports up to 64 ranks per EP axis, the axis has 128")
    assert internode.unsupported_reason(mesh_shaped(32), "ep", 16) == "internode mode supports up to 8 ranks per node, got 16"


@pytest.mark.parametrize("hosts,per_node", [(["a", "a", "b", "b"], 2), (["a", "b", "c", "d"], 1),
                                            (["a"] * 4, 4), (["h0"] * 8 + ["h1"] * 8, 8)])
def test_ranks_per_host(hosts, per_node):
    assert internode.ranks_per_host(hosts) == per_node


@pytest.mark.parametrize("hosts", [["a", "b", "a", "b"], ["a", "a", "a", "b"], ["a", "a", "b", "b", "a", "a"]])
def test_irregular_hosts_are_refused(hosts):
    with pytest.raises(internode.IrregularNodesError, match="consecutive and equally many per host"):
        internode.ranks_per_host(hosts)


# ---- region sizes --------------------------------------------------------------------------------------------

def native():
    if not _native.available():
        pytest.skip("the native extension did not load")
    return _native._C


def aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def dispatch_region_oracle(nodes: int, per_node: int, tokens: int, topk: int, payload: int) -> int:
    """The dispatch layout csrc/internode_state.h describes: a slot per (source node, token) of the payload bytes
    rounded up to 16; with top-k, per source node its topk_idx and topk_weights (int32 and f32 [T, K], each
    aligned) and its routing into this node (one aligned block of per-rank counts, then the offsets [T, P] int32,
    aligned), and this rank's outgoing routing per node. Parts start aligned to the region's alignment."""
    align = native().limits()["internode_align"]
    slots = aligned(nodes * tokens * aligned(payload, 16), align)
    if topk == 0:
        return slots
    topk_part = 2 * aligned(tokens * topk * 4, align)
    routing = align + aligned(tokens * per_node * 4, align)
    return slots + nodes * (topk_part + routing) + nodes * routing


def combine_region_oracle(nodes: int, tokens: int, capacity: int, elements: int, item: int) -> int:
    """The combine layout csrc/internode_state.h describes: y's rows staged (rows rounded up to 16 bytes, the part
    aligned), then float32 partials received and sent per (node, token)."""
    align = native().limits()["internode_align"]
    partial = aligned(elements * 4, 16)
    return aligned(capacity * aligned(elements * item, 16), align) + aligned(nodes * tokens * partial, align) + \
        nodes * tokens * partial


@pytest.mark.parametrize("nodes,per_node,tokens,topk,payload", [
    (2, 2, 96, 8, 512), (4, 1, 37, 5, 384 * 4), (2, 8, 4096, 8, 7168 * 2), (8, 8, 4096, 8, 7168 + 224),
    (2, 2, 96, 0, 4 * 256), (3, 2, 1, 1, 2)])
def test_dispatch_region_matches_its_description(nodes, per_node, tokens, topk, payload):
    assert internode.dispatch_region_bytes(nodes, per_node, tokens, topk, payload) == \
        dispatch_region_oracle(nodes, per_node, tokens, topk, payload)


@pytest.mark.parametrize("nodes,tokens,capacity,elements,item", [
    (2, 96, 384, 512, 2), (4, 37, 7, 5, 4), (2, 4096, 16384, 7168, 2), (8, 4096, 1, 7168, 4)])
def test_combine_region_matches_its_description(nodes, tokens, capacity, elements, item):
    assert internode.combine_region_bytes(nodes, tokens, capacity, elements, item) == \
        combine_region_oracle(nodes, tokens, capacity, elements, item)


def test_buffer_bytes_by_hand():
    """2 nodes of 2, T=8, H=256, K=3, capacity R*T=32. Dispatch: 2*8 slots of 512 bytes, per node 2 * 256
    (top-k, each 96 bytes aligned) + 256 + 256 (counts, offsets) routing, plus 2 outgoing routings; cached
    dispatch of float32 rows: 2*8 slots of 1024; combine: 32 staged rows of 1024, 2 * 2*8 partial rows of 1024."""
    dispatch = 2 * 8 * 512 + 2 * (2 * 256 + 512) + 2 * 512
    cached = 2 * 8 * 1024
    combine = 32 * 1024 + 2 * (2 * 8 * 1024)
    assert jax_ep.internode_buffer_bytes(T, H, R, K, PER_NODE) == max(dispatch, cached, combine) == combine


# ---- ops lowered with an internode stand-in --------------------------------------------------------------------

def standin(num_rdma_bytes=64 << 20, low_latency=False):
    sizes = dict(num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E) if low_latency else {}
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="xla", ranks_per_node=PER_NODE, num_rdma_bytes=num_rdma_bytes,
                        **sizes)
    with_standin_backend(buf, internode.InternodeBackend, R, PER_NODE, num_rdma_bytes, "standin",
                         *(("nvshmem", 0) if low_latency else ()))
    assert (buf.backend, buf.internode) == ("cuda", True)
    return buf


def lower(buf, body, *shapes):
    args = [jnp.zeros((R * s[0], *s[1:]), dtype) for s, dtype in shapes]
    return jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()


X, IDX, W = ((T, H), jnp.bfloat16), ((T, K), jnp.int32), ((T, K), jnp.float32)


def test_ops_and_gradients_lower_to_the_internode_calls():
    buf = standin()

    def body(x, idx, w, bias):
        def loss(x, w, bias):
            d = jax_ep.dispatch(buf, x, idx, w, num_experts=E)
            c = jax_ep.combine(buf, d.recv_x * 2, d.handle, topk_weights=d.recv_topk_weights, bias=bias)
            return jnp.sum(c.x.astype(jnp.float32)) + jnp.sum(c.topk_weights)

        grads = jax.grad(loss, argnums=(0, 1, 2))(x, w, bias)
        d = jax_ep.dispatch(buf, jax_ep.per_token_cast_to_fp8(x), idx, num_experts=E)
        cached = jax_ep.dispatch(buf, x.astype(jnp.float32), handle=d.handle).recv_x
        return *grads, d.recv_x[1], cached

    text = lower(buf, body, X, IDX, W, X)
    calls = set(re.findall(r"custom_call @(jax_ep_\w+)\(", text))
    assert calls == {"jax_ep_internode_dispatch", "jax_ep_internode_cached_dispatch", "jax_ep_internode_combine"}, calls
    assert re.search(r"jax_ep_internode_dispatch\([^\n]*num_payloads = 2", text)  # the FP8 pair


def test_expert_major_ops_and_gradients_lower_to_the_internode_expert_major_calls():
    """The expert-major layout runs on the internode kernels of its own (no routing dispatch, no composed plan):
    dispatch, cached dispatch, the weighted combine and their gradients."""
    buf = standin()

    def body(x, idx, w):
        def loss(x, w):
            d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, layout="expert_major")
            again = jax_ep.dispatch(buf, x * 2, handle=d.handle).recv_x
            c = jax_ep.combine(buf, (d.recv_x + again).astype(jnp.bfloat16), d.handle, weights=d.recv_weights)
            return jnp.sum(c.x.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1))(x, w)

    text = lower(buf, body, X, IDX, W)
    calls = set(re.findall(r"custom_call @(jax_ep_\w+)\(", text))
    assert calls == {f"jax_ep_internode_expert_major_{op}" for op in
                     ("dispatch", "cached_dispatch", "combine", "combine_backward")}, calls


def test_low_latency_ops_lower_to_the_low_latency_calls_on_nvshmem():
    """An internode Buffer with low-latency sizes runs the low-latency kernels on the NVSHMEM transport (1), the
    compressed combine included; one without a low-latency region says how to create one."""
    if not _native.has_target("jax_ep_low_latency_dispatch_send", "cuda"):
        pytest.skip("this build has no CUDA low-latency kernels")
    buf = standin(low_latency=True)
    assert buf.low_latency_transport == "nvshmem"

    def body(x, idx, w):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True)
        return jax_ep.low_latency_combine(buf, d.recv_x[0].astype(jnp.bfloat16), idx, w, d.handle,
                                          compression="logfmt")

    text = lower(buf, body, X, IDX, W)
    calls = re.findall(r"custom_call @(jax_ep_low_latency_\w+)\([^\n]*transport = (\d+)", text)
    assert sorted(calls) == [(f"jax_ep_low_latency_{op}", "1") for op in
                             ("combine_recv", "combine_send", "dispatch_recv", "dispatch_send")], calls
    plain = standin()
    plain.num_max_dispatch_tokens_per_rank, plain.hidden, plain.num_experts = T, H, E  # sizes, but no region
    with pytest.raises(RuntimeError, match="the cuda Buffer has no low-latency region; create it with "
                                           "num_max_dispatch_tokens_per_rank"):
        lower(plain, lambda x, idx: jax_ep.low_latency_dispatch(plain, x, idx).recv_count, X, IDX)


def test_call_needing_more_than_the_region_raises():
    need = internode.combine_region_bytes(R // PER_NODE, T, R * T, H, 2)
    buf = standin(num_rdma_bytes=need - 1)

    def body(x, idx):
        d = jax_ep.dispatch(buf, x, idx, num_experts=E)
        return jax_ep.combine(buf, d.recv_x, d.handle).x

    with pytest.raises(ValueError, match=re.escape(f"jax_ep.combine (cuda, internode): this call needs {need} bytes "
                                                   f"of the Buffer's NVSHMEM region, the Buffer has num_rdma_bytes="
                                                   f"{need - 1}; create it with num_rdma_bytes >= {need}")):
        lower(buf, body, X, IDX)


def test_combine_refuses_a_foreign_handle():
    buf, xla = standin(), jax_ep.Buffer(mesh_of(R), "ep", backend="xla")

    def body(x, idx, y):
        return jax_ep.combine(buf, y, jax_ep.dispatch(xla, x, idx, num_experts=E).handle).x

    with pytest.raises(TypeError, match="the handle must come from a dispatch of this Buffer, got XlaHandle"):
        lower(buf, body, X, IDX, ((R * T, H), jnp.bfloat16))


def test_expert_major_handle_of_the_other_kernel_family_is_refused():
    """An expert-major handle of the intranode kernels given to an internode Buffer (and the other way round) is
    refused while tracing, naming the op: the two families' handles hold different rows."""
    internode_buf = standin()
    intranode_buf = with_standin_backend(jax_ep.Buffer(internode_buf.mesh, "ep", backend="xla"),
                                         intranode.IntranodeBackend)
    for made_by, used_by, op in ((intranode_buf, internode_buf, "combine"), (internode_buf, intranode_buf, "dispatch")):
        def body(x, idx, w):
            d = jax_ep.dispatch(made_by, x, idx, w, num_experts=E, layout="expert_major")
            if op == "combine":
                return jax_ep.combine(used_by, d.recv_x, d.handle, weights=d.recv_weights).x
            return jax_ep.dispatch(used_by, x, handle=d.handle).recv_x

        with pytest.raises(TypeError, match=f"jax_ep.{op}: this expert-major handle comes from the other kernel"):
            lower(internode_buf, body, X, IDX, W)
