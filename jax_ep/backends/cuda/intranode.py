"""The `cuda` backend's intranode mode: the kernels of csrc/intranode.cu called through `jax.ffi.ffi_call`
(docs/design.md, "Intranode kernels"), for EP groups driven by one process (peer access) or spread over processes
on one host (one process per GPU: CUDA IPC handles exchanged through the `jax.distributed` key-value store), and
the low-latency kernels of the same Buffer (`low_latency`).

The Buffer's device memory is created here (`IntranodeBackend.create`) outside jit; each call names it by
`buffer_id`. Each rank owns a workspace that its peers map: the low-latency region (when the Buffer has
low-latency sizes) and, when the group spans processes, the region where each normal-mode op stages the inputs
its peers read (a peer process cannot map XLA's buffers). That staging region is `num_nvl_bytes` large
(`normal_buffer_bytes` says what a call needs); a call that needs more raises while tracing.

Combine moves rows one of two ways (same results, bit for bit): "pull" (each rank reads its tokens' rows
from the peers' `y`; across processes each rank first copies its valid rows of `y` into its workspace) or
"push" (each rank stores its rows into the tokens' home ranks, which reduce them from local memory: no copy,
no NVLink reads; in one process the peers store into a scratch result of the call). By default one process
pulls and a group spanning processes pushes; `Config.combine` picks one, and `Config.push_warps` (1 to 16,
default 8) tunes the push: how many of each block's 16 warps push at the start (the others reduce what has
arrived; the pushers join them after).
"""
from __future__ import annotations

import dataclasses
import json
import socket
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_ep import _native
from jax_ep.backends import Backend
from jax_ep.backends.cuda import low_latency, normal, runtime
from jax_ep.backends.xla import XlaHandle
from jax_ep.config import (
    COMBINE_METHODS,
    DEFAULT_PUSH_WARPS,
    FP8_GROUP,
    Config,
    low_latency_buffer_bytes,
)

DISPATCH_TARGET = _native.target("dispatch")
CACHED_DISPATCH_TARGET = _native.target("cached_dispatch")
COMBINE_TARGET = _native.target("combine")
EXPERT_MAJOR_DISPATCH_TARGET = _native.target("expert_major_dispatch")
EXPERT_MAJOR_CACHED_DISPATCH_TARGET = _native.target("expert_major_cached_dispatch")
EXPERT_MAJOR_COMBINE_TARGET = _native.target("expert_major_combine")
EXPERT_MAJOR_COMBINE_BACKWARD_TARGET = _native.target("expert_major_combine_backward")
STORE_PROBE_TARGET = _native.target("store_probe")

# Ranks of an intranode group (one NVLink domain; csrc/kernel_limits.h).
MAX_RANKS = _native.limit("max_intranode_ranks")
# The combine kernel's `method` attribute: {"pull": value, "push": value} (csrc/api.h, CombineMethod).
COMBINE_METHOD_VALUES = _native.enum("combine_method")

int32 = jnp.int32


class IntranodeHandle(NamedTuple):
    """Normal-mode routing of the intranode kernels. The first two fields equal `XlaHandle`'s bit for bit (the
    `xla` backend accepts this handle; cached dispatch here accepts an `XlaHandle`)."""

    recv_src_index: jax.Array  # int32 [C]: source rank * T + source token of each row; R*T for padding rows
    is_token_in_rank: jax.Array  # bool [T, R]: this rank's tokens per destination
    send_row: jax.Array  # int32 [T, R]: row of this rank's token t on rank r; -1 where not sent or dropped


def combine_method(config: Config, spans_processes: bool) -> str:
    """"push" or "pull" (see the module docstring): `config.combine`, else push in a group spanning processes
    (pulling would first copy every valid row of y into the workspace) and pull in one process (peers read y
    in place; pushing would need a scratch result of (R - 1) * T rows)."""
    return config.combine or ("push" if spans_processes else "pull")


def combine_push_warps(config: Config, spans_processes: bool) -> int:
    """The warps of each block that push, where combine pushes; 0 where it pulls (no warp pushes)."""
    if combine_method(config, spans_processes) == "pull":
        return 0
    return config.push_warps or DEFAULT_PUSH_WARPS


# ---- workspace sizing ------------------------------------------------------------------------------------------
# A group spanning processes stages each op's inputs in the workspace; the regions, their order and alignment are
# laid out once, in csrc/kernel_limits.h (the staging structs the kernels' launches use), and computed by `_C`.
_SIZING = "sizing the workspace of the cuda backend"


def dispatch_staging_bytes(num_tokens: int, row_bytes: tuple[int, ...], num_topk: int, num_ranks: int,
                           with_weights: bool) -> int:
    """Workspace bytes a dispatch stages: payload rows (1 or 2 row sizes), topk_idx, [topk_weights] and the send
    offsets."""
    return _native.extension(_SIZING).dispatch_staging_bytes(
        int(num_tokens), [int(b) for b in row_bytes], int(num_topk), int(num_ranks), bool(with_weights))


def cached_dispatch_staging_bytes(num_tokens: int, row_bytes: int) -> int:
    """Workspace bytes a cached dispatch stages: the new rows."""
    return _native.extension(_SIZING).cached_dispatch_staging_bytes(int(num_tokens), int(row_bytes))


def combine_staging_bytes(num_tokens: int, row_bytes: int, num_ranks: int, capacity: int, push: bool) -> int:
    """Workspace bytes a combine uses in a group spanning processes: push, the slots where the peers store
    their rows ((R - 1) * T rows); pull, the staged copy of y (capacity rows)."""
    return _native.extension(_SIZING).combine_staging_bytes(
        int(num_tokens), int(row_bytes), int(num_ranks), int(capacity), bool(push))


def normal_buffer_bytes(num_tokens: int, hidden: int, num_ranks: int, num_topk: int, *, capacity: int | None = None,
                        fp8: bool = False, combine: str | None = None) -> int:
    """`num_nvl_bytes` a Buffer needs so that the normal-mode ops (dispatch, cached dispatch, combine, their
    gradients) of these sizes run in a group spanning processes: the most workspace any op uses. Rows are
    bfloat16 [T, hidden] (or the FP8 pair with fp8=True) for dispatch and float32 for the combined weights;
    combine rows are taken at up to 4 bytes an element: the push combine receives (R-1)*T of them, the pull
    combine stages y [capacity, hidden] (capacity defaults to R*T). `combine` ("push" or "pull") sizes for that
    method; None (the default) for either, so that the size holds whatever Config.combine or $JAX_EP_COMBINE
    chooses (the figure depends on the arguments only, never on the environment). The expert-major layout's
    combines always push ((R-1)*T rows, which this counts whatever `combine` says) and stage nothing of their
    capacity; its composed path (more experts than the kernels take) combines partials at the routing
    dispatch's R*T rows: leave capacity at its default for it."""
    if combine not in (None,) + COMBINE_METHODS:
        raise ValueError(f"jax_ep.normal_buffer_bytes: combine must be one of {COMBINE_METHODS} or None, "
                         f"got {combine!r}")
    capacity = num_ranks * num_tokens if capacity is None else capacity
    methods = (combine,) if combine else COMBINE_METHODS
    rows = (hidden, hidden // FP8_GROUP * 4) if fp8 else (2 * hidden,)
    return max(dispatch_staging_bytes(num_tokens, rows, num_topk, num_ranks, True),
               cached_dispatch_staging_bytes(num_tokens, 4 * hidden),  # of a float32 cotangent
               *(combine_staging_bytes(num_tokens, 4 * hidden, num_ranks, capacity, method == "push")  # float32 rows
                 for method in methods),
               combine_staging_bytes(num_tokens, 4 * hidden, num_ranks, capacity, True))  # expert-major kernels


def _check_staging(op: str, staging_bytes: int | None, need: int) -> None:
    if staging_bytes is not None and need > staging_bytes:
        raise ValueError(
            f"jax_ep.{op} (cuda): this call needs {need} bytes of workspace in a group spanning processes (inputs "
            f"staged for the peers, or the rows the push combine receives), the Buffer has "
            f"num_nvl_bytes={staging_bytes}; create it with num_nvl_bytes >= {need} "
            "(jax_ep.normal_buffer_bytes computes it from the shapes)")


# ---- where the kernels run -------------------------------------------------------------------------------------

def unsupported_reason(mesh, axis_name: str) -> str | None:
    """Why these kernels cannot serve an EP axis of `mesh`, or None when they can (an axis spanning hosts is only
    found out while creating: see SpansHostsError)."""
    groups = runtime.ep_groups(mesh, axis_name)
    if groups.shape[1] > MAX_RANKS:
        return f"the cuda backend supports up to {MAX_RANKS} ranks per EP axis, the axis has {groups.shape[1]}"
    return None


class SpansHostsError(NotImplementedError):
    """The EP axis spans hosts: the intranode kernels need every rank's GPU in one NVLink domain."""


# ---- the backend -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IntranodeBackend(normal.ExpertMajorKernels, low_latency.LowLatencyOps, Backend):
    """The intranode kernels of one Buffer, normal and low-latency modes."""

    name: ClassVar[str] = "cuda"
    buffer_id: int  # the Buffer's name in jax_ep._C
    mesh: Mesh
    axis_name: str
    config: Config
    # The staging room of each rank (num_nvl_bytes) when some EP group spans processes; None when the peers read
    # XLA's buffers directly.
    staging_bytes: int | None = None
    collective_name: str | None = None  # the Buffer's name in the key-value store, when groups span processes
    low_latency_transport: str | None = None  # "peer_stores", "nvshmem", or None: no low-latency region
    low_latency_offset: int | None = None  # byte offset of the low-latency region in its allocation

    @classmethod
    def create(cls, spec, low_latency_transport: str | None) -> IntranodeBackend:
        """Allocates every EP group of `spec` (a BackendSpec: the Buffer's settings) with this process's devices in
        it (one group per combination of the other mesh axes): directly when the group is local to this process,
        else collectively with the group's other processes through the jax.distributed key-value store.

        Workspace of each rank: the staging region first (`num_nvl_bytes`, when any EP group of the Buffer spans
        processes, also if only low-latency ops are used), then the low-latency region (when `low_latency_transport`
        is peer stores). Under the NVSHMEM transport the low-latency region is NVSHMEM symmetric memory of its own,
        allocated collectively by every process once the groups exist."""
        reason = unsupported_reason(spec.mesh, spec.axis_name)
        if reason:
            raise NotImplementedError(f"jax_ep.Buffer: {reason}")
        spans_processes = runtime.spans_processes(spec.mesh, spec.axis_name)
        align = _native.limit("low_latency_align")  # the LL region follows the staging room, aligned
        staging = -(-spec.num_nvl_bytes // align) * align if spans_processes else 0
        workspace_bytes = staging
        low_latency_bytes = 0
        low_latency_offset = None
        if low_latency_transport is not None:
            low_latency_bytes = low_latency_buffer_bytes(spec.num_max_dispatch_tokens_per_rank, spec.hidden,
                                                         spec.num_ranks, spec.num_experts,
                                                         transport=low_latency_transport)
            if low_latency_transport == "peer_stores":
                low_latency_offset = staging
                workspace_bytes += low_latency_bytes
            else:
                low_latency_offset = 0  # the start of the symmetric region
        me = jax.process_index()
        groups = list(enumerate(runtime.ep_groups(spec.mesh, spec.axis_name)))
        collective_name = None
        try:
            for _, group in groups:
                # local_hardware_id is the CUDA ordinal XLA hands the FFI handler as DeviceOrdinal.
                if all(d.process_index == me for d in group):
                    _native._C.create_intranode(spec.buffer_id, [int(d.local_hardware_id) for d in group],
                                                workspace_bytes, staging)
            shared = [(i, g) for i, g in groups if any(d.process_index == me for d in g) and
                      any(d.process_index != me for d in g)]
            if shared:
                collective_name = _create_across_processes(spec, shared, workspace_bytes, staging)
            if low_latency_transport == "nvshmem":
                # Every peer through puts: plain stores reach a rank's own region only (one rank per "node").
                runtime.create_symmetric_region(spec.buffer_id, spec.mesh, spec.axis_name,
                                                spec.config.host_timeout_s, low_latency_bytes, ranks_per_node=1)
        except BaseException:
            _native._C.destroy_intranode(spec.buffer_id)
            raise
        return cls(spec.buffer_id, spec.mesh, spec.axis_name, spec.config,
                   spec.num_nvl_bytes if spans_processes else None, collective_name, low_latency_transport,
                   low_latency_offset)

    @property
    def num_ranks(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    @property
    def spans_processes(self) -> bool:
        return self.staging_bytes is not None

    @property
    def combine_method(self) -> str:
        """How this Buffer's combine moves rows: "pull" or "push"."""
        return combine_method(self.config, self.spans_processes)

    def _attributes(self) -> dict:
        return normal.kernel_attributes(self.buffer_id, self.config)

    # ---- normal mode ----------------------------------------------------------------------------------------

    def dispatch(self, x_leaves, topk_idx, topk_weights, *, num_experts, capacity, expert_alignment):
        num_tokens, num_topk = topk_idx.shape
        num_ranks = self.num_ranks
        normal.check_dispatch(num_ranks, num_tokens, num_topk)
        row_bytes = tuple(normal.row_bytes(leaf) for leaf in x_leaves)
        _check_staging("dispatch", self.staging_bytes,
                       dispatch_staging_bytes(num_tokens, row_bytes, num_topk, num_ranks, topk_weights is not None))
        routing = ((num_tokens, num_ranks), int32)
        outs, (_send_offset, send_row) = normal.call_dispatch(
            DISPATCH_TARGET, x_leaves, topk_idx, topk_weights, (routing, routing), attributes=self._attributes(),
            num_ranks=num_ranks, num_experts=num_experts, capacity=capacity, expert_alignment=expert_alignment)
        *results, recv_src_index, is_token_in_rank = outs
        return (*results, IntranodeHandle(recv_src_index, is_token_in_rank, send_row))

    def all_gather(self, x):
        return normal.all_gather(self, x)

    def cached_dispatch(self, leaf, handle):
        capacity = handle.recv_src_index.shape[0]
        _check_staging("cached dispatch", self.staging_bytes,
                       cached_dispatch_staging_bytes(leaf.shape[0], normal.row_bytes(leaf)))
        result_type = jax.typeof(leaf).update(shape=(capacity, *leaf.shape[1:]), dtype=leaf.dtype)
        return normal.call(CACHED_DISPATCH_TARGET, result_type, leaf, handle.recv_src_index,
                           attributes=self._attributes())

    def combine(self, y, handle, *, bias=None, out_dtype=jnp.float32):
        """Each token's rows summed in float32 in rank order; the kernel adds the bias and casts (one pass)."""
        if not isinstance(handle, IntranodeHandle):
            raise TypeError("jax_ep.combine (cuda): the handle must come from a dispatch of the cuda backend, got "
                            f"{type(handle).__name__}")
        y, bias, kernel_out = normal.combine_kernel_types(y, bias, out_dtype)
        num_tokens, num_ranks = handle.send_row.shape
        row_bytes = normal.row_bytes(y)
        method = self.combine_method
        _check_staging("combine", self.staging_bytes,
                       combine_staging_bytes(num_tokens, row_bytes, num_ranks, y.shape[0], method == "push"))
        aval = jax.typeof(y)
        result_types = [aval.update(shape=(num_tokens, *y.shape[1:]), dtype=kernel_out)]
        if method == "push" and not self.spans_processes:  # one process: the peers push into a scratch result
            result_types.append(aval.update(shape=((num_ranks - 1) * num_tokens * row_bytes,), dtype=jnp.uint8))
        operands = (y, handle.send_row, handle.recv_src_index) + (() if bias is None else (bias,))
        attributes = dict(self._attributes(), method=np.int64(COMBINE_METHOD_VALUES[method]),
                          push_warps=np.int64(combine_push_warps(self.config, self.spans_processes)))
        out = normal.call(COMBINE_TARGET, result_types, *operands, attributes=attributes)[0]
        return out.astype(out_dtype)

    # ---- the expert-major layout (csrc/expert_major.cu; normal.ExpertMajorKernels) ------------------------------

    expert_major_rows_type = XlaHandle

    def expert_major_dispatch(self, x_leaves, topk_idx, topk_weights, *, num_experts, capacity, expert_alignment):
        from jax_ep.expert_major import ExpertMajorHandle  # jax_ep.expert_major imports the backends' interface

        num_tokens, num_topk = topk_idx.shape
        normal.check_dispatch(self.num_ranks, num_tokens, num_topk)
        row_bytes = tuple(normal.row_bytes(leaf) for leaf in x_leaves)
        _check_staging("dispatch", self.staging_bytes,
                       dispatch_staging_bytes(num_tokens, row_bytes, num_topk, self.num_ranks, topk_weights is not None))
        recv, weights, sizes, offsets, kept, dropped, invalid, rows_needed, recv_src_index, is_token_in_rank, \
            pair_row, topk_row, rows_end, _ = normal.call_expert_major_dispatch(
                EXPERT_MAJOR_DISPATCH_TARGET, x_leaves, topk_idx, topk_weights, (), attributes=self._attributes(),
                num_ranks=self.num_ranks, num_experts=num_experts, capacity=capacity,
                expert_alignment=expert_alignment, num_sms=self.config.num_sms)
        handle = ExpertMajorHandle(XlaHandle(recv_src_index, is_token_in_rank), pair_row, topk_row, rows_end=rows_end,
                                   by_kernels=True)
        return recv, weights, sizes, offsets, kept, dropped, invalid, handle, rows_needed

    def expert_major_cached_dispatch(self, leaf, handle):
        self.check_expert_major_handle("dispatch", handle)
        _check_staging("cached dispatch", self.staging_bytes,
                       cached_dispatch_staging_bytes(leaf.shape[0], normal.row_bytes(leaf)))
        result_type = jax.typeof(leaf).update(shape=(handle.capacity, *leaf.shape[1:]), dtype=leaf.dtype)
        return normal.call(EXPERT_MAJOR_CACHED_DISPATCH_TARGET, result_type, leaf, handle.pair_row,
                           handle.rows.recv_src_index, handle.rows_end, attributes=self._attributes())

    def _expert_major_combine_call(self, y, weights, pair_row, handle, bias, kernel_out):
        """Partials are made where the pairs are and stored into their home ranks, whatever Config.combine says."""
        num_tokens, num_ranks = handle.rows.is_token_in_rank.shape
        row_bytes = normal.row_bytes(y)
        _check_staging("combine", self.staging_bytes,
                       combine_staging_bytes(num_tokens, row_bytes, num_ranks, y.shape[0], True))
        aval = jax.typeof(y)
        result_types = [aval.update(shape=(num_tokens, *y.shape[1:]), dtype=kernel_out)]
        if not self.spans_processes:  # one process: the peers push into a scratch result
            result_types.append(aval.update(shape=((num_ranks - 1) * num_tokens * row_bytes,), dtype=jnp.uint8))
        operands = (y, pair_row, handle.rows.is_token_in_rank) + (() if weights is None else (weights,)) + \
            (() if bias is None else (bias,))
        return normal.call(EXPERT_MAJOR_COMBINE_TARGET, result_types, *operands,
                           attributes=dict(self._attributes(), weighted=np.int64(weights is not None)))[0]

    def _expert_major_combine_backward_operands(self, d_out, y, handle):
        _check_staging("combine backward", self.staging_bytes,
                       cached_dispatch_staging_bytes(d_out.shape[0], normal.row_bytes(d_out)))
        return EXPERT_MAJOR_COMBINE_BACKWARD_TARGET, (d_out, y, handle.pair_row, handle.rows.recv_src_index,
                                                      handle.rows_end)

    # ---- lifetime -------------------------------------------------------------------------------------------

    def destroy(self) -> str:
        """Frees the device memory after its GPUs finished. In a group spanning processes every process first
        waits for its GPUs and unmaps its peers, then all meet at a bounded barrier, then each frees its own
        memory: nobody frees what another process still maps. An NVSHMEM region is freed collectively, and only
        when every process says its GPU is healthy (runtime.destroy_symmetric_region)."""
        problems = []
        timeout_s = self.config.host_timeout_s
        if self.spans_processes:
            processes = sorted({d.process_index for d in self.mesh.devices.flat})
            unmapped = _native._C.unmap_intranode(self.buffer_id)  # this process reads no peer memory from here on
            if unmapped:
                problems.append(unmapped)
            try:
                runtime.kv_client().wait_at_barrier(f"{self.collective_name}/destroy", int(timeout_s * 1000),
                                                    processes)
            except Exception as e:  # a peer died or never destroys: free ours anyway
                problems.append(f"not every process reached destroy within {timeout_s} s ({e})")
            if self.low_latency_transport == "nvshmem":
                problems += runtime.destroy_symmetric_region(self.buffer_id, self.collective_name, processes,
                                                             timeout_s, healthy=not problems)
        elif self.low_latency_transport == "nvshmem":  # a single process: NVSHMEM with one PE
            problems += runtime.destroy_symmetric_region(self.buffer_id, self.collective_name,
                                                         [jax.process_index()], timeout_s, healthy=True)
        freed = _native._C.destroy_intranode(self.buffer_id)
        if freed:
            problems.append(freed)
        return "; ".join(problems)

    def errors(self) -> list[str]:
        """The normal-mode and low-latency kernels' records."""
        return list(_native._C.intranode_errors(self.buffer_id)) + self.low_latency_errors()

    # ---- the benchmark's instruments ------------------------------------------------------------------------

    def kernel_times(self, reset: bool = False) -> list[tuple[int, int]]:
        """(calls, summed kernel nanoseconds) per device of this process, by CUDA ordinal: the bare kernel time of
        each op, as %globaltimer sees it from the kernel's first block starting to its last block leaving."""
        _native.require_instrumentation("kernel_times")
        return [tuple(t) for t in _native._C.intranode_kernel_times(self.buffer_id, reset)]

    def store_probe(self, token, *, bytes_per_peer: int) -> jax.Array:
        """The all-to-all store ceiling (per rank, inside shard_map): every rank stores `bytes_per_peer` bytes into
        each peer at once with plain 16-byte stores from `Config.num_sms` SMs; returns this rank's uint8
        [num_ranks * bytes_per_peer] (what the peers stored). `token` orders the call after its producer. One
        process driving the group only."""
        _native.require_instrumentation("the store probe")
        if self.spans_processes:
            raise NotImplementedError("jax_ep store probe: needs one process driving every GPU of the EP group")
        result_type = jax.typeof(token).update(shape=(self.num_ranks * bytes_per_peer,), dtype=jnp.uint8)
        return jax.ffi.ffi_call(STORE_PROBE_TARGET, result_type)(token, **self._attributes())


# ---- creation across processes ---------------------------------------------------------------------------------

def _create_across_processes(spec, groups, workspace_bytes: int, staging_bytes: int) -> str:
    """Two collective steps per group: every process exports its ranks' CUDA IPC handles with the Buffer's
    sizes to the key-value store, then maps every other rank's memory, after checking the sizes agree. Returns
    the Buffer's name in the key-value store."""
    name = runtime.collective_name(spec.mesh)
    me = jax.process_index()
    timeout_s = spec.config.host_timeout_s
    sizes = dict(num_ranks=spec.num_ranks, workspace_bytes=workspace_bytes, num_nvl_bytes=spec.num_nvl_bytes,
                 num_max_dispatch_tokens_per_rank=spec.num_max_dispatch_tokens_per_rank, hidden=spec.hidden,
                 num_experts=spec.num_experts)
    key = "{}/group/{}/rank/{}".format
    exported = {}
    for index, group in groups:
        for rank, device in enumerate(group):
            if device.process_index == me:
                handle = _native._C.export_intranode(spec.buffer_id, int(device.local_hardware_id), rank,
                                                     len(group), workspace_bytes, staging_bytes)
                exported[key(name, index, rank)] = json.dumps(dict(
                    sizes, process=me, host=socket.gethostname(), ordinal=int(device.local_hardware_id),
                    handle=handle.hex()))
    runtime.exchange(exported, [], timeout_s)
    for index, group in groups:
        published = runtime.require_published(
            runtime.exchange({}, [key(name, index, rank) for rank in range(len(group))], timeout_s),
            [f"rank {rank} of EP group {index} (process {d.process_index})" for rank, d in enumerate(group)],
            f"create Buffer #{spec.buffer_id}", timeout_s)
        records = [json.loads(record) for record in published]
        hosts = sorted({r["host"] for r in records})
        if len(hosts) > 1:
            raise SpansHostsError(f"jax_ep.Buffer: EP group {index} spans the hosts {hosts}; the intranode cuda "
                                  "backend needs every rank's GPU on one host (use backend='xla')")
        for rank, record in enumerate(published):
            runtime.require_same_sizes(sizes, record, f"rank {rank} of EP group {index}", f"Buffer #{spec.buffer_id}")
        handles = [bytes.fromhex(r["handle"]) for r in records]
        local = [r["ordinal"] if r["process"] == me else -1 for r in records]
        outcome = "ok"
        try:
            for device in group:
                if device.process_index == me:
                    _native._C.connect_intranode(spec.buffer_id, int(device.local_hardware_id), handles, local)
        except Exception as e:  # told to the other processes first, so that none of them waits on us at run time
            outcome = f"{type(e).__name__}: {e}"
        _confirm_connected(spec, name, index, group, outcome)
    return name


def _confirm_connected(spec, name: str, index: int, group, outcome: str) -> None:
    """Every process of the group publishes whether it mapped its peers and reads the others': a Buffer is
    created everywhere or nowhere (else a rank that failed would leave the others to time out at the first op)."""
    key = "{}/group/{}/connected/{}".format
    processes = sorted({d.process_index for d in group})
    timeout_s = spec.config.host_timeout_s
    answers = runtime.require_published(
        runtime.exchange({key(name, index, jax.process_index()): outcome}, [key(name, index, p) for p in processes],
                         timeout_s),
        [f"process {p}" for p in processes], f"finish creating Buffer #{spec.buffer_id}", timeout_s)
    for process, answer in zip(processes, answers):
        if answer != "ok":
            raise RuntimeError(f"jax_ep.Buffer: process {process} could not map its peers' memory for Buffer "
                               f"#{spec.buffer_id} (EP group {index}): {answer}")
