"""The cuda backend's low-latency path on CPU: what can be checked without a GPU. The ops trace and lower
(forward, split halves, gradients) to the four custom calls with the Buffer's attributes; the region size
formula; clear errors for a Buffer without a low-latency region and for too many top-k entries.
Lowering compiles and runs nothing, so a Buffer made for the xla backend, holding an intranode backend that
allocated nothing, stands in for a cuda one."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import mesh_of, with_standin_backend
from jax_ep import _native
from jax_ep.backends.cuda import intranode, low_latency
from jax_ep.config import LOW_LATENCY_MAX_TOPK

R, T, H, K, E, M = 4, 8, 512, 3, 8, 16


def cuda_standin(low_latency_offset=0, num_max_tokens=M, on_timeout="trap"):
    """A cuda Buffer whose low-latency region (peer stores) starts at `low_latency_offset`; None: it has none."""
    if not low_latency.available():
        pytest.skip("this build has no CUDA low-latency kernels")
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="xla", num_max_dispatch_tokens_per_rank=num_max_tokens, hidden=H,
                        num_experts=E, config=jax_ep.Config(on_timeout=on_timeout))
    return with_standin_backend(buf, intranode.IntranodeBackend,
                                low_latency_transport=None if low_latency_offset is None else "peer_stores",
                                low_latency_offset=low_latency_offset)


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


@pytest.mark.parametrize("on_timeout", ["trap", "mask"])
def test_masking_buffer_reads_each_ops_masks_on_the_device(on_timeout):
    """Config(on_timeout="mask"): each op first reads its rank's masks from the GPU (a side-effecting custom call,
    which XLA neither merges nor drops) and every kernel is told to mask instead of trapping; "trap" reads none."""
    buf = cuda_standin(on_timeout=on_timeout)

    def body(x, idx, w):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return d.num_masked[None], jax_ep.low_latency_combine(buf, d.recv_x, idx, w, d.handle)

    text = lower(buf, body, X, IDX, W)
    masking = int(on_timeout == "mask")
    kernels = re.findall(rf"custom_call @jax_ep_low_latency_\w+\([^\n]*mask_on_timeout = {masking}", text)
    assert len(kernels) == 4, text
    reads = re.findall(r"custom_call @jax_ep_low_latency_mask\([^\n]*has_side_effect = true", text)
    assert len(reads) == 2 * masking, text


def test_masks_need_a_region_and_come_back_by_a_reset():
    """The cuda backend's host API of masks: a Buffer without a low-latency region says so; unmask_ranks refuses
    (its ranks come back through reset_low_latency). Nothing here touches a GPU."""
    buf = cuda_standin(low_latency_offset=None, on_timeout="mask")
    for call in (lambda: buf.mask_ranks(1), buf.masked_ranks, buf.reset_low_latency):
        with pytest.raises(ValueError, match="this Buffer has no low-latency region"):
            call()
    with pytest.raises(ValueError, match="reset_low_latency"):
        cuda_standin(on_timeout="mask").unmask_ranks()


def test_buffer_without_low_latency_region():
    buf = cuda_standin(low_latency_offset=None)
    with pytest.raises(RuntimeError, match="the cuda Buffer has no low-latency region"):
        lower(buf, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_count, X, IDX)


def test_topk_beyond_the_kernels_limit():
    buf = cuda_standin()
    topk = LOW_LATENCY_MAX_TOPK + 1
    message = rf"low_latency_dispatch \(cuda\): at most {LOW_LATENCY_MAX_TOPK} top-k entries per token, got {topk}"
    with pytest.raises(ValueError, match=message):
        lower(buf, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_count, X, ((T, topk), jnp.int32))


def test_topk_entries_beyond_the_kernels_limit():
    """The send keeps a rank's routing in shared memory: T * K <= MAX_ENTRIES, however few entries each token has."""
    entries = low_latency.MAX_ENTRIES
    tokens, topk = entries // 8, 9
    buf = cuda_standin(num_max_tokens=tokens)
    example = rf"{entries // LOW_LATENCY_MAX_TOPK} \* {LOW_LATENCY_MAX_TOPK}"
    with pytest.raises(ValueError, match=rf"at most {entries} top-k entries per rank \(tokens \* top-k, e.g. "
                                         rf"{example}\), got {tokens} \* {topk}"):
        lower(buf, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_count, ((tokens, H), jnp.bfloat16),
              ((tokens, topk), jnp.int32))


def test_region_size():
    """The region as docs/design.md and csrc/low_latency_state.h describe it, in order: the header, the trace, a
    dispatch send counter per expert (8 bytes) and a combine send counter per (local expert, source rank) (4 bytes),
    the staging rows, then 2 sets of (2 flag arrays of 8 bytes per expert, an int32 index of E*M positions, R*M
    dispatch rows, MAX_TOPK*M combine rows). A dispatch row is a row header and 2H bytes, a combine row 2H bytes;
    each array starts aligned (here every size but the counters' and the flags' already is a multiple of the
    alignment). The fixed sizes and the alignment are the extension's."""
    if not _native.available():
        pytest.skip("the native extension did not load")
    limit = _native.limit
    align, header = limit("low_latency_align"), limit("low_latency_header_bytes")
    trace = limit("low_latency_trace_bytes")
    dispatch_row, combine_row = limit("low_latency_row_header_bytes") + 2 * H, 2 * H
    assert E * 8 <= align  # so each counter array and each flag array takes one alignment unit
    counters = flags = 2 * align
    index = E * M * 4
    assert (M * dispatch_row) % align == 0 and index % align == 0 and trace % align == 0 and header % align == 0
    set_bytes = flags + index + R * M * dispatch_row + LOW_LATENCY_MAX_TOPK * M * combine_row
    total = header + trace + counters + M * dispatch_row + 2 * set_bytes
    assert jax_ep.low_latency_buffer_bytes(M, H, R, E) == total
    # The NVSHMEM transport's region ends with the combine send's staging: a combine row per (expert, token).
    assert jax_ep.low_latency_buffer_bytes(M, H, R, E, transport="nvshmem") == total + E * M * combine_row
    with pytest.raises(ValueError, match="transport must be 'peer_stores' or 'nvshmem', got 'auto'"):
        jax_ep.low_latency_buffer_bytes(M, H, R, E, transport="auto")


def test_compressed_combine_lowers_with_the_attribute():
    """compression="logfmt" reaches both combine kernels as compression = 1 (0 without), on either transport."""
    buf = cuda_standin()

    def body(compression):
        def fn(x, idx, w):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            return jax_ep.low_latency_combine(buf, d.recv_x, idx, w, d.handle, compression=compression)
        return fn

    for transport in ("peer_stores", "nvshmem"):
        with_standin_backend(buf, intranode.IntranodeBackend, low_latency_transport=transport, low_latency_offset=0)
        for compression, attribute in ((None, 0), ("logfmt", 1)):
            text = lower(buf, body(compression), X, IDX, W)
            calls = re.findall(r"custom_call @(jax_ep_low_latency_combine_\w+)\([^\n]*compression = (\d)", text)
            assert sorted(calls) == [("jax_ep_low_latency_combine_recv", str(attribute)),
                                     ("jax_ep_low_latency_combine_send", str(attribute))], (transport, calls)


def test_logfmt_sizes_agree_with_the_kernels():
    if not _native.available():
        pytest.skip("the native extension did not load")
    from jax_ep import logfmt
    assert (_native.limit("logfmt_block"), _native.limit("logfmt_code_bits"), _native.limit("logfmt_max_octaves"),
            _native.limit("logfmt_block_bytes")) == (logfmt.BLOCK, logfmt.CODE_BITS, logfmt.MAX_OCTAVES,
                                                     4 * logfmt.WORDS_PER_BLOCK)


def test_compressions_agree_with_the_kernels():
    """The compressions jax_ep.low_latency_combine accepts (the xla backend's codecs) are those the kernels
    implement, by name."""
    if not _native.available():
        pytest.skip("the native extension did not load")
    from jax_ep.backends import xla
    assert set(_native.enum("low_latency_compression")) == {"none", *xla.COMBINE_CODECS}
    assert jax_ep.ops.COMBINE_COMPRESSIONS == (None, *xla.COMBINE_CODECS)
