"""Internode mode of the `cuda` backend (docs/design.md, "Internode normal mode"): the normal-mode kernels of
csrc/internode.cu through `jax.ffi.ffi_call`, for an EP axis over N nodes of P = `ranks_per_node` GPUs, one
process per GPU, NVSHMEM owned by jax_ep.

EP rank g = node * P + local. Each token crosses the network once per destination node: rank (n, l) puts it
into the NVSHMEM region of rank (m, l) (its "relay" on node m), and every rank of node m pulls the tokens it
needs from its node's relays over NVLink, writing the normal-mode outputs in (source rank, source token)
order, bit for bit those of the intranode kernels and the `xla` backend. Combine reduces inside the node, then
across nodes: relay (m, l) sums the node's rows of each token of rank (s, l) in float32 in local-rank order and
puts that float32 partial to (s, l), which sums the nodes' partials in float32 in node order, adds the bias and
casts. So the result is the flat rank-order sum of the intranode mode with the additions regrouped by node: it
can differ from it in the last bits, and is deterministic. Partials travel as float32 (exact, twice the bytes
of BF16 rows on the network for BF16 y).

Memory: one NVSHMEM symmetric region per GPU of `num_rdma_bytes` (plus a header of `HEADER_BYTES`), allocated
collectively by every process when the Buffer is created; each op lays out its part of it from its shapes
(csrc/internode_state.h and kernel_limits.h; `dispatch_region_bytes` / `combine_region_bytes` here) and a call that
needs more raises while tracing. `internode_buffer_bytes` gives what given shapes need. jax_ep initialises
NVSHMEM at the first Buffer with symmetric memory and, when NVSHMEM_SYMMETRIC_SIZE is unset, sizes its symmetric
heap for that Buffer (jax_ep.nvshmem.initialize); set it yourself when several such Buffers live at once.

Low-latency ops: a Buffer created with low-latency sizes also gets a low-latency region (`low_latency`), NVSHMEM
symmetric memory of its own, reached with plain stores by the ranks of its node (NVLink, mapped through
nvshmem_ptr) and with NVSHMEM puts by the others; `low_latency_transport` is "nvshmem". Its size is
`jax_ep.low_latency_buffer_bytes(..., transport="nvshmem")`.

Bounded waits, lifetime and ordering rules are the intranode mode's (see `jax_ep.backends.cuda`); creation and
`destroy()` are collective over every process of the job (NVSHMEM allocations are).
"""
from __future__ import annotations

import dataclasses
import json
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native, nvshmem
from jax_ep._checks import is_int
from jax_ep.backends import Backend
from jax_ep.backends.cuda import low_latency, normal, runtime
from jax_ep.config import FP8_GROUP, Config, low_latency_buffer_bytes

DISPATCH_TARGET = _native.target("internode_dispatch")
CACHED_DISPATCH_TARGET = _native.target("internode_cached_dispatch")
COMBINE_TARGET = _native.target("internode_combine")
EXPERT_MAJOR_DISPATCH_TARGET = _native.target("internode_expert_major_dispatch")
EXPERT_MAJOR_CACHED_DISPATCH_TARGET = _native.target("internode_expert_major_cached_dispatch")
EXPERT_MAJOR_COMBINE_TARGET = _native.target("internode_expert_major_combine")
EXPERT_MAJOR_COMBINE_BACKWARD_TARGET = _native.target("internode_expert_major_combine_backward")

# Limits and the region header of the internode kernels (csrc/kernel_limits.h): ranks of the EP axis, ranks per node
# (one NVLink domain), and the header each rank's symmetric region holds before its num_rdma_bytes.
MAX_RANKS = _native.limit("max_internode_ranks")
MAX_RANKS_PER_NODE = _native.limit("max_ranks_per_node")
HEADER_BYTES = _native.limit("internode_header_bytes")
DEFAULT_NUM_RDMA_BYTES = 1 << 30

int32 = jnp.int32


class InternodeHandle(NamedTuple):
    """Normal-mode routing of the internode kernels. The first two fields equal `XlaHandle`'s bit for bit (the
    `xla` backend and cached dispatch of either mode accept this handle); combine here needs the relay part."""

    recv_src_index: jax.Array  # int32 [C]: source rank * T + source token of each row; R*T for padding rows
    is_token_in_rank: jax.Array  # bool [T, R]: this rank's tokens per destination
    relay_row: jax.Array  # int32 [N*T, P]: row on node rank j of token t of rank (s, local) (index s*T + t), or -1
    relay_token: jax.Array  # bool [N*T]: whether token t of rank (s, local) came into this node


def available() -> bool:
    """Whether this build has the internode kernels (CUDA with NVSHMEM)."""
    return _native.has_target(DISPATCH_TARGET, "cuda")


# ---- region sizes (laid out in csrc/kernel_limits.h, computed by `_C`) -------------------------------------------
_SIZING = "sizing the region of the internode kernels"


def dispatch_region_bytes(num_nodes: int, ranks_per_node: int, num_tokens: int, num_topk: int,
                          payload_bytes: int) -> int:
    """Region bytes of a dispatch (num_topk=0: cached dispatch) whose token rows are payload_bytes long: a slot
    per (source node, token), and with top-k the per-source-node topk_idx/weights and routing, and this rank's
    outgoing routing per node."""
    return _native.extension(_SIZING).internode_dispatch_bytes(int(num_nodes), int(ranks_per_node), int(num_tokens),
                                                               int(num_topk), int(payload_bytes))


def combine_region_bytes(num_nodes: int, num_tokens: int, capacity: int, row_elements: int, item_bytes: int) -> int:
    """Region bytes of a combine of y [capacity, row_elements]: the staged rows of y, then float32 partials
    received and sent per (node, token)."""
    return _native.extension(_SIZING).internode_combine_bytes(int(num_nodes), int(num_tokens), int(capacity),
                                                              int(row_elements), int(item_bytes))


def internode_buffer_bytes(num_tokens: int, hidden: int, num_ranks: int, num_topk: int, ranks_per_node: int, *,
                           capacity: int | None = None, fp8: bool = False) -> int:
    """`num_rdma_bytes` an internode Buffer needs so that the normal-mode ops of these sizes and their gradients
    run: the largest of a dispatch of BF16 rows (or the FP8 pair with fp8=True) with weights, a cached dispatch
    of float32 rows (a cotangent) and a combine of float32 rows (capacity defaults to R*T).

    Roughly N*T token rows for dispatch, and capacity + 2*N*T float32 rows for combine: at DeepEP's shape
    (T=4096, H=7168, R=16 on 2 nodes, default capacity) about 2.3 GB; a smaller `max_recv_tokens` shrinks the
    combine part (not for the expert-major layout, which stages its partials, in y's dtype, at R*T rows, one per
    token a rank may receive: leave capacity at its default for it)."""
    num_nodes = num_ranks // ranks_per_node
    capacity = num_ranks * num_tokens if capacity is None else capacity
    payload = hidden + hidden // FP8_GROUP * 4 if fp8 else 2 * hidden
    return max(dispatch_region_bytes(num_nodes, ranks_per_node, num_tokens, num_topk, payload),
               dispatch_region_bytes(num_nodes, ranks_per_node, num_tokens, 0, 4 * hidden),
               combine_region_bytes(num_nodes, num_tokens, capacity, hidden, 4))


def _check_region(op: str, num_rdma_bytes: int, need: int) -> None:
    if need > num_rdma_bytes:
        raise ValueError(
            f"jax_ep.{op} (cuda, internode): this call needs {need} bytes of the Buffer's NVSHMEM region, the Buffer "
            f"has num_rdma_bytes={num_rdma_bytes}; create it with num_rdma_bytes >= {need} "
            "(jax_ep.internode_buffer_bytes computes it from the shapes)")


# ---- topology ----------------------------------------------------------------------------------------------------

class IrregularNodesError(NotImplementedError):
    """The EP axis spans hosts, but not as consecutive blocks of equal size (the internode layout)."""


def ranks_per_node_of(mesh, axis_name: str, ranks_per_node: int | None) -> int:
    """P of the EP axis: `ranks_per_node` when given (checked: it divides the axis), else from where its devices
    are: the axis size when one process drives them all or they are on one host, else the ranks per host, which
    must form consecutive blocks of equal size in every EP group (IrregularNodesError otherwise). Finding the
    hosts is collective over the processes the first time."""
    num_ranks = int(mesh.shape[axis_name])
    if ranks_per_node is not None:
        if not is_int(ranks_per_node) or not 1 <= ranks_per_node <= num_ranks or num_ranks % ranks_per_node:
            raise ValueError(f"jax_ep.Buffer: ranks_per_node must be a positive divisor of the {num_ranks} ranks on "
                             f"axis {axis_name!r}, got {ranks_per_node!r}")
        return int(ranks_per_node)
    if not runtime.spans_processes(mesh, axis_name):
        return num_ranks
    hosts = runtime.process_hosts()
    sizes = {ranks_per_host([hosts[d.process_index] for d in group], axis_name)
             for group in runtime.ep_groups(mesh, axis_name)}
    if len(sizes) != 1:
        raise IrregularNodesError(f"jax_ep.Buffer: EP groups of axis {axis_name!r} have different ranks per host")
    return sizes.pop()


def ranks_per_host(hosts: list[str], axis_name: str = "ep") -> int:
    """Ranks per node of an EP group whose rank g runs on host hosts[g]: every host's ranks must be consecutive
    and equally many (IrregularNodesError otherwise)."""
    size = hosts.count(hosts[0])
    blocks = [tuple(hosts[i:i + size]) for i in range(0, len(hosts), size)]
    if len(hosts) % size or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise IrregularNodesError(
            f"jax_ep.Buffer: the EP axis {axis_name!r} spans the hosts {hosts} (by rank); internode mode needs every "
            "host's ranks consecutive and equally many per host (order the mesh by host, or pass ranks_per_node)")
    return size


def unsupported_reason(mesh, axis_name: str, per_node: int) -> str | None:
    """Why the internode kernels cannot serve an EP axis of `mesh` in nodes of `per_node` ranks (with this build),
    or None."""
    num_ranks = int(mesh.shape[axis_name])
    if num_ranks > MAX_RANKS:  # (the low-latency kernels' limit too)
        return f"internode mode supports up to {MAX_RANKS} ranks per EP axis, the axis has {num_ranks}"
    if per_node > MAX_RANKS_PER_NODE:
        return f"internode mode supports up to {MAX_RANKS_PER_NODE} ranks per node, got {per_node}"
    if not available():
        return ("this jax_ep build has no internode kernels (they need NVSHMEM: install the cuda12/cuda13 extra and "
                "rebuild jax_ep with nvcc on the PATH)")
    processes = [d.process_index for d in mesh.devices.flat]
    if len(set(processes)) != len(processes):
        return ("internode mode needs one process per GPU (jax.distributed.initialize(..., local_device_ids=[i])); "
                "some process drives several GPUs of the mesh")
    if sorted(processes) != list(range(jax.process_count())):
        return "internode mode needs the mesh to hold a GPU of every process (NVSHMEM allocates collectively)"
    return None


# ---- the backend -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class InternodeBackend(normal.ExpertMajorKernels, low_latency.LowLatencyOps, Backend):
    """The internode kernels of one Buffer: normal mode, and the low-latency ops when it has a low-latency region."""

    name: ClassVar[str] = "cuda"
    internode: ClassVar[bool] = True
    buffer_id: int  # the Buffer's name in jax_ep._C
    mesh: jax.sharding.Mesh
    axis_name: str
    config: Config
    num_ranks: int
    ranks_per_node: int
    num_rdma_bytes: int  # each rank's NVSHMEM region (after its header)
    collective_name: str  # the Buffer's name in the key-value store
    low_latency_transport: str | None = None  # "nvshmem" with a low-latency region, else None
    low_latency_offset: int | None = None  # 0: the region is a symmetric allocation of its own

    @classmethod
    def create(cls, spec, ranks_per_node: int, low_latency: bool) -> InternodeBackend:
        """Collective over every process: checks that every process passed the same sizes, initialises NVSHMEM
        (once per process) and allocates this process's rank's region, and with `low_latency` its low-latency
        region, for `spec` (a BackendSpec: the Buffer's settings) over nodes of `ranks_per_node` ranks."""
        backend = cls(spec.buffer_id, spec.mesh, spec.axis_name, spec.config, spec.num_ranks, ranks_per_node,
                      spec.num_rdma_bytes, runtime.collective_name(spec.mesh),
                      *(("nvshmem", 0) if low_latency else ()))
        me = jax.process_index()
        group = next(g for g in runtime.ep_groups(spec.mesh, spec.axis_name)
                     if any(d.process_index == me for d in g))
        rank = next(i for i, d in enumerate(group) if d.process_index == me)
        timeout_s = spec.config.host_timeout_s
        low_latency_bytes = low_latency_buffer_bytes(spec.num_max_dispatch_tokens_per_rank, spec.hidden,
                                                     spec.num_ranks, spec.num_experts,
                                                     transport="nvshmem") if low_latency else 0
        backend._check_same_sizes(low_latency_bytes)
        nvshmem.initialize(timeout_s, symmetric_bytes=HEADER_BYTES + spec.num_rdma_bytes + low_latency_bytes)
        _native._C.create_internode(spec.buffer_id, int(group[rank].local_hardware_id), rank, ranks_per_node,
                                    [int(d.process_index) for d in group], spec.num_rdma_bytes)
        if low_latency:
            try:
                runtime.create_symmetric_region(spec.buffer_id, spec.mesh, spec.axis_name, timeout_s,
                                                low_latency_bytes, ranks_per_node=ranks_per_node)
            except BaseException:  # every process met the same problem: all free the internode region together
                _native._C.destroy_internode(spec.buffer_id, True)
                raise
        return backend

    def _check_same_sizes(self, low_latency_bytes: int) -> None:
        """Every process publishes its Buffer sizes and reads everyone's, so that all raise together on a mismatch
        (before the collective allocation, which would otherwise wait forever)."""
        if jax.process_count() == 1:
            return
        sizes = dict(num_ranks=self.num_ranks, ranks_per_node=self.ranks_per_node, num_rdma_bytes=self.num_rdma_bytes,
                     low_latency_bytes=low_latency_bytes)
        key = f"{self.collective_name}/internode/{{}}".format
        timeout_s = self.config.host_timeout_s
        processes = range(jax.process_count())
        published = runtime.require_published(
            runtime.exchange({key(jax.process_index()): json.dumps(sizes)}, [key(p) for p in processes], timeout_s),
            [f"process {p}" for p in processes], f"create internode Buffer #{self.buffer_id}", timeout_s)
        for process, record in zip(processes, published):
            runtime.require_same_sizes(sizes, record, f"process {process}", f"internode Buffer #{self.buffer_id}")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    def _attributes(self) -> dict:
        return normal.kernel_attributes(self.buffer_id, self.config)

    # ---- normal mode (per rank, inside shard_map) -------------------------------------------------------------

    def _relay_types(self, x_leaves, topk_idx) -> tuple:
        """Checks a dispatch of either layout against the limits and the region; the (shape, dtype) of its handle's
        relay part: relay_row [N*T, P], relay_token [N*T]."""
        num_tokens, num_topk = topk_idx.shape
        normal.check_dispatch(self.num_ranks, num_tokens, num_topk)
        payload = sum(normal.row_bytes(leaf) for leaf in x_leaves)
        _check_region("dispatch", self.num_rdma_bytes,
                      dispatch_region_bytes(self.num_nodes, self.ranks_per_node, num_tokens, num_topk, payload))
        relayed = self.num_nodes * num_tokens
        return ((relayed, self.ranks_per_node), int32), ((relayed,), jnp.bool_)

    def dispatch(self, x_leaves, topk_idx, topk_weights, *, num_experts, capacity, expert_alignment):
        outs, (relay_row, relay_token) = normal.call_dispatch(
            DISPATCH_TARGET, x_leaves, topk_idx, topk_weights, self._relay_types(x_leaves, topk_idx),
            attributes=self._attributes(), num_ranks=self.num_ranks, num_experts=num_experts, capacity=capacity,
            expert_alignment=expert_alignment)
        *results, recv_src_index, is_token_in_rank = outs
        return (*results, InternodeHandle(recv_src_index, is_token_in_rank, relay_row, relay_token))

    def all_gather(self, x):
        return normal.all_gather(self, x)

    def cached_dispatch(self, leaf, handle):
        num_tokens, capacity = handle.is_token_in_rank.shape[0], handle.recv_src_index.shape[0]
        _check_region("cached dispatch", self.num_rdma_bytes,
                      dispatch_region_bytes(self.num_nodes, self.ranks_per_node, num_tokens, 0, normal.row_bytes(leaf)))
        result_type = jax.typeof(leaf).update(shape=(capacity, *leaf.shape[1:]), dtype=leaf.dtype)
        return normal.call(CACHED_DISPATCH_TARGET, result_type, leaf, handle.recv_src_index, handle.is_token_in_rank,
                           attributes=self._attributes())

    def combine(self, y, handle, *, bias=None, out_dtype=jnp.float32):
        """Each token's rows summed in float32 per node (local rank order), the nodes' partials in float32 in node
        order; the kernel adds the bias and casts."""
        if not isinstance(handle, InternodeHandle):
            raise TypeError("jax_ep.combine (cuda, internode): the handle must come from a dispatch of this Buffer, "
                            f"got {type(handle).__name__}")
        y, bias, kernel_out = normal.combine_kernel_types(y, bias, out_dtype)
        num_tokens = handle.is_token_in_rank.shape[0]
        row_elements = int(np.prod(y.shape[1:], dtype=np.int64))
        _check_region("combine", self.num_rdma_bytes, combine_region_bytes(self.num_nodes, num_tokens, y.shape[0],
                                                                           row_elements, np.dtype(y.dtype).itemsize))
        result_type = jax.typeof(y).update(shape=(num_tokens, *y.shape[1:]), dtype=kernel_out)
        operands = (y, *handle) + (() if bias is None else (bias,))
        out = normal.call(COMBINE_TARGET, result_type, *operands, attributes=self._attributes())
        return out.astype(out_dtype)

    # ---- the expert-major layout (csrc/internode_expert_major.cu; normal.ExpertMajorKernels) -------------------

    # The handle's rows are an InternodeHandle: recv_src_index and is_token_in_rank, and the relay part, whose
    # relay_row names each relayed token's item on the node ranks that received it (where they stage its partial).
    expert_major_rows_type = InternodeHandle

    def expert_major_dispatch(self, x_leaves, topk_idx, topk_weights, *, num_experts, capacity, expert_alignment):
        from jax_ep.expert_major import ExpertMajorHandle  # jax_ep.expert_major imports the backends' interface

        recv, weights, sizes, offsets, kept, dropped, invalid, rows_needed, recv_src_index, is_token_in_rank, \
            pair_row, topk_row, rows_end, (relay_row, relay_token) = normal.call_expert_major_dispatch(
                EXPERT_MAJOR_DISPATCH_TARGET, x_leaves, topk_idx, topk_weights, self._relay_types(x_leaves, topk_idx),
                attributes=self._attributes(), num_ranks=self.num_ranks, num_experts=num_experts, capacity=capacity,
                expert_alignment=expert_alignment, num_sms=self.config.num_sms)
        rows = InternodeHandle(recv_src_index, is_token_in_rank, relay_row, relay_token)
        handle = ExpertMajorHandle(rows, pair_row, topk_row, rows_end=rows_end, by_kernels=True)
        return recv, weights, sizes, offsets, kept, dropped, invalid, handle, rows_needed

    def _check_cached_region(self, op: str, leaf) -> None:
        _check_region(op, self.num_rdma_bytes, dispatch_region_bytes(self.num_nodes, self.ranks_per_node, leaf.shape[0],
                                                                     0, normal.row_bytes(leaf)))

    def expert_major_cached_dispatch(self, leaf, handle):
        self.check_expert_major_handle("dispatch", handle)
        self._check_cached_region("cached dispatch", leaf)
        result_type = jax.typeof(leaf).update(shape=(handle.capacity, *leaf.shape[1:]), dtype=leaf.dtype)
        return normal.call(EXPERT_MAJOR_CACHED_DISPATCH_TARGET, result_type, leaf, handle.pair_row,
                           handle.rows.recv_src_index, handle.rows_end, handle.rows.is_token_in_rank,
                           attributes=self._attributes())

    def _expert_major_combine_call(self, y, weights, pair_row, handle, bias, kernel_out):
        """Each rank stages its partial of every token it received at the token's item row (R*T rows of y's type);
        the node's relays sum them, then the nodes' partials go home, as the rank-major combine's rows."""
        rows = handle.rows
        num_tokens = rows.is_token_in_rank.shape[0]
        row_elements = int(np.prod(y.shape[1:], dtype=np.int64))
        _check_region("combine", self.num_rdma_bytes,
                      combine_region_bytes(self.num_nodes, num_tokens, self.num_ranks * num_tokens, row_elements,
                                           np.dtype(y.dtype).itemsize))
        result_type = jax.typeof(y).update(shape=(num_tokens, *y.shape[1:]), dtype=kernel_out)
        operands = (y, pair_row, rows.is_token_in_rank, rows.relay_row, rows.relay_token) + \
            (() if weights is None else (weights,)) + (() if bias is None else (bias,))
        return normal.call(EXPERT_MAJOR_COMBINE_TARGET, result_type, *operands,
                           attributes=dict(self._attributes(), weighted=np.int64(weights is not None)))

    def _expert_major_combine_backward_operands(self, d_out, y, handle):
        self._check_cached_region("combine backward", d_out)
        return EXPERT_MAJOR_COMBINE_BACKWARD_TARGET, (d_out, y, handle.pair_row, handle.rows.recv_src_index,
                                                      handle.rows_end, handle.rows.is_token_in_rank)

    # ---- lifetime -----------------------------------------------------------------------------------------------

    def destroy(self) -> str:
        """Collective: frees this process's regions after its GPU finished, when every process can take part (none
        has a kernel that timed out: runtime.agree_to_free), else forgets them."""
        processes = sorted({d.process_index for d in self.mesh.devices.flat})
        release, problems = runtime.agree_to_free(self.collective_name, processes, self.config.host_timeout_s,
                                                  healthy=not self.errors(),
                                                  what=f"the NVSHMEM regions of Buffer #{self.buffer_id}")
        if self.low_latency_transport:
            problems.append(_native._C.nvshmem_region_destroy(self.buffer_id, release))
        problems.append(_native._C.destroy_internode(self.buffer_id, release))
        return "; ".join(p for p in problems if p)

    def errors(self) -> list[str]:
        """The records of this process's rank (op, rank, the rank it waited for), normal and low-latency ops."""
        return list(_native._C.internode_errors(self.buffer_id)) + self.low_latency_errors()

    def kernel_times(self, reset: bool = False) -> list[tuple[int, int]]:
        """(calls, summed kernel nanoseconds) of this process's GPU since the last reset (the benchmark's; see
        IntranodeBackend.kernel_times)."""
        _native.require_instrumentation("kernel_times")
        return [tuple(t) for t in _native._C.internode_kernel_times(self.buffer_id, reset)]
