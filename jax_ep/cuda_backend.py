"""The `cuda` backend, intranode normal mode: the CUDA kernels of csrc/intranode.cu called through
`jax.ffi.ffi_call` (docs/design.md, "Intranode kernels"), for EP groups driven by one process (peer access) or spread
over processes on one host (one process per GPU: CUDA IPC handles exchanged through the `jax.distributed`
key-value store).

Same per-rank functions and return tuples as `xla_backend` (run inside `shard_map` over the EP axis). The
Buffer's device memory is created here (`create`) outside jit; each call names it by `buffer_id`. Each rank
owns a workspace that its peers map: the low-latency region (when the Buffer has low-latency sizes) and,
when the group spans processes, the region where each normal-mode op stages the inputs its peers read
(a peer process cannot map XLA's buffers). That staging region is `num_nvl_bytes` large
(`normal_buffer_bytes` says what a call needs); a call that needs more raises while tracing.

Combine moves rows one of two ways (same results, bit for bit): "pull" (each rank reads its tokens' rows
from the peers' `y`; across processes each rank first copies its valid rows of `y` into its workspace) or
"push" (each rank stores its rows into the tokens' home ranks, which reduce them from local memory: no copy,
no NVLink reads; in one process the peers store into a scratch result of the call). By default one process
pulls and a group spanning processes pushes; `Config.combine` picks one, and `Config.push_warps` (1 to 16,
default 8) tunes the push: how many of each block's 16 warps push at the start (the others reduce what has
arrived; the pushers join them after).

Bounded waits: a kernel that waits longer than `Config.timeout_s` for a peer writes a record (op, rank, peer)
to pinned host memory and executes `trap`. The handler cannot see this (under CUDA graphs it does not even
run), so the trap surfaces at the next synchronisation as an XLA runtime error carrying a CUDA launch
failure (e.g. "unspecified launch failure"), and that GPU's CUDA context stays unusable: the process must
restart. `errors(buffer)` reads the records, also after the trap, and names the op, rank and peer.

Lifetime: compiled programs hold the Buffer's device pointers (CUDA graphs bake them in); do not run a
program after destroying the Buffer it was traced with. Ops of one device must run one at a time, as XLA's
default command-buffer scheduling (LHS) and stream assignment do; `--xla_gpu_command_buffer_scheduling_mode=
CONCURRENT` could overlap two jax_ep calls of one device and is not supported.
"""
from __future__ import annotations

import dataclasses
import json
import socket
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native, cuda_low_latency, environment
from jax_ep.config import COMBINE_METHODS, DEFAULT_PUSH_WARPS, FP8_GROUP, Config, low_latency_buffer_bytes

DISPATCH_TARGET = "jax_ep_dispatch"
CACHED_DISPATCH_TARGET = "jax_ep_cached_dispatch"
COMBINE_TARGET = "jax_ep_combine"
STORE_PROBE_TARGET = "jax_ep_store_probe"

# Limits of the intranode kernels (csrc/kernel_limits.h): ranks of a group (one NVLink domain), and top-k entries per
# token of a normal-mode dispatch (one warp lane each; the internode kernels share it).
MAX_RANKS = _native.limit("max_intranode_ranks")
MAX_TOPK = _native.limit("normal_max_topk")
_FLOAT_TYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

int32 = jnp.int32


class IntranodeHandle(NamedTuple):
    """Normal-mode routing of the `cuda` intranode backend. The first two fields equal `XlaHandle`'s bit
    for bit (the `xla` backend accepts this handle; cached dispatch here accepts an `XlaHandle`)."""

    recv_src_index: jax.Array  # int32 [C]: source rank * T + source token of each row; R*T for padding rows
    is_token_in_rank: jax.Array  # bool [T, R]: this rank's tokens per destination
    send_row: jax.Array  # int32 [T, R]: row of this rank's token t on rank r; -1 where not sent or dropped


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """Static parameters every intranode call carries as FFI attributes, the staging room of a group that
    spans processes (None when peers read XLA's buffers directly), and whether combine pushes."""

    buffer_id: int
    num_sms: int
    timeout_ns: int
    staging_bytes: int | None = None
    combine_push_warps: int = 0  # 0: the pull combine; else the push combine with this many pushing warps

    def attributes(self) -> dict:
        return dict(buffer_id=np.int64(self.buffer_id), num_sms=np.int64(self.num_sms),
                    timeout_ns=np.int64(self.timeout_ns))


def combine_method(config: Config, spans_processes: bool) -> str:
    """"push" or "pull" (see the module docstring): `config.combine`, else push in a group spanning processes
    (pulling would first copy every valid row of y into the workspace) and pull in one process (peers read y
    in place; pushing would need a scratch result of (R - 1) * T rows)."""
    return config.combine or ("push" if spans_processes else "pull")


def combine_push_warps(config: Config, spans_processes: bool) -> int:
    """0 where combine pulls, else the warps of each block that push."""
    if combine_method(config, spans_processes) == "pull":
        return 0
    return config.push_warps or DEFAULT_PUSH_WARPS


def kernel_params(buffer) -> KernelParams:
    return KernelParams(buffer.buffer_id, buffer.config.num_sms, int(buffer.config.timeout_s * 1e9),
                        buffer.num_nvl_bytes if buffer.spans_processes else None,
                        combine_push_warps(buffer.config, buffer.spans_processes))


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
    combine stages y [capacity, hidden] (capacity defaults to R*T). `combine` ("push" or "pull") defaults to
    the method such a group runs with `Config.combine` None (push, or $JAX_EP_COMBINE)."""
    if combine not in (None,) + COMBINE_METHODS:
        raise ValueError(f"jax_ep.normal_buffer_bytes: combine must be one of {COMBINE_METHODS} or None, "
                         f"got {combine!r}")
    capacity = num_ranks * num_tokens if capacity is None else capacity
    default = Config().with_overrides(environment.overrides().combine, None)
    push = (combine or combine_method(default, spans_processes=True)) == "push"
    rows = (hidden, hidden // FP8_GROUP * 4) if fp8 else (2 * hidden,)
    return max(dispatch_staging_bytes(num_tokens, rows, num_topk, num_ranks, True),
               cached_dispatch_staging_bytes(num_tokens, 4 * hidden),  # of a float32 cotangent
               combine_staging_bytes(num_tokens, 4 * hidden, num_ranks, capacity, push))  # float32 rows


def _row_bytes(leaf) -> int:
    return int(np.prod(leaf.shape[1:], dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _check_staging(op: str, params: KernelParams, need: int) -> None:
    if params.staging_bytes is not None and need > params.staging_bytes:
        raise ValueError(
            f"jax_ep.{op} (cuda): this call needs {need} bytes of workspace in a group spanning processes (inputs "
            f"staged for the peers, or the rows the push combine receives), the Buffer has "
            f"num_nvl_bytes={params.staging_bytes}; create it with num_nvl_bytes >= {need} "
            "(jax_ep.normal_buffer_bytes computes it from the shapes)")


# ---- runtime ------------------------------------------------------------------------------------------------

def _ep_groups(mesh, axis_name: str) -> np.ndarray:
    """Devices as [groups, R]: one row per EP group (every combination of the other mesh axes), in rank order."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(axis_name)
    return np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])


def unsupported_reason(mesh, axis_name: str) -> str | None:
    """Why this backend cannot serve an EP axis of `mesh`, or None when it can (an axis spanning hosts is only
    found out while creating: see SpansHostsError)."""
    groups = _ep_groups(mesh, axis_name)
    if groups.shape[1] > MAX_RANKS:
        return f"the cuda backend supports up to {MAX_RANKS} ranks per EP axis, the axis has {groups.shape[1]}"
    return None


class SpansHostsError(NotImplementedError):
    """The EP axis spans hosts: the intranode kernels need every rank's GPU in one NVLink domain."""


def spans_processes(mesh, axis_name: str) -> bool:
    return any(len({d.process_index for d in group}) > 1 for group in _ep_groups(mesh, axis_name))


def create(buffer) -> None:
    """Allocates every EP group of `buffer` with this process's devices in it (one group per combination of
    the other mesh axes): directly when the group is local to this process, else collectively with the
    group's other processes through the jax.distributed key-value store. Sets `buffer.low_latency_offset`.

    Workspace of each rank: the staging region first (`num_nvl_bytes`, when any EP group of the Buffer spans
    processes, also if only low-latency ops are used), then the low-latency region (when the Buffer has
    low-latency sizes and its transport is peer stores). Under the NVSHMEM transport the low-latency region is
    NVSHMEM symmetric memory of its own, allocated collectively by every process once the groups exist."""
    reason = unsupported_reason(buffer.mesh, buffer.axis_name)
    if reason:
        raise NotImplementedError(f"jax_ep.Buffer: {reason}")
    align = _native.limit("low_latency_align")  # the LL region follows the staging room, aligned
    staging = -(-buffer.num_nvl_bytes // align) * align if buffer.spans_processes else 0
    workspace_bytes = staging
    low_latency_bytes = 0
    buffer.low_latency_offset = None
    if buffer.low_latency_transport is not None:
        low_latency_bytes = low_latency_buffer_bytes(buffer.num_max_dispatch_tokens_per_rank, buffer.hidden,
                                                     buffer.num_ranks, buffer.num_experts)
        if buffer.low_latency_transport == "peer_stores":
            buffer.low_latency_offset = staging
            workspace_bytes += low_latency_bytes
        else:
            buffer.low_latency_offset = 0  # the start of the symmetric region
    me = jax.process_index()
    groups = list(enumerate(_ep_groups(buffer.mesh, buffer.axis_name)))
    try:
        for _, group in groups:
            # local_hardware_id is the CUDA ordinal XLA hands the FFI handler as DeviceOrdinal.
            if all(d.process_index == me for d in group):
                _native._C.create_intranode(buffer.buffer_id, [int(d.local_hardware_id) for d in group], workspace_bytes,
                                            staging)
        shared = [(i, g) for i, g in groups if any(d.process_index == me for d in g) and
                  any(d.process_index != me for d in g)]
        if shared:
            _create_across_processes(buffer, shared, workspace_bytes, staging)
        if buffer.low_latency_transport == "nvshmem":
            _create_symmetric_region(buffer, groups, low_latency_bytes)
    except BaseException:
        _native._C.destroy_intranode(buffer.buffer_id)
        raise


def _create_symmetric_region(buffer, groups, nbytes: int) -> None:
    """The NVSHMEM transport's low-latency region: symmetric memory on this process's GPU, allocated collectively
    by every process (Buffer.__init__ checked one process per GPU over every process: the PE of a rank is its
    process index). Every process got here through _create_across_processes, which checked that all of them
    create this Buffer with the same sizes, so every PE enters the allocation with the same size."""
    from jax_ep import nvshmem

    nvshmem.initialize(buffer.config.timeout_s)  # collective once per process; a no-op afterwards
    me = jax.process_index()
    (group,) = [g for _, g in groups if any(d.process_index == me for d in g)]
    device = next(d for d in group if d.process_index == me)
    _native._C.nvshmem_region_create(buffer.buffer_id, int(device.local_hardware_id), nbytes,
                                     [int(d.process_index) for d in group])


def _kv_client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax_ep.Buffer: the EP axis spans processes but jax.distributed is not initialized")
    return client


# Buffers created so far over each set of devices (by global device id): the key-value store names a Buffer by
# its devices and this count, which every process of the set agrees on (creation is collective), whatever
# other Buffers a process made on its own.
_creations_per_devices: dict[tuple[int, ...], int] = {}


def _collective_name(buffer) -> str:
    devices = tuple(sorted(int(d.id) for d in buffer.mesh.devices.flat))
    count = _creations_per_devices[devices] = _creations_per_devices.get(devices, 0) + 1
    return "jax_ep/buffer/{}/{}".format("-".join(map(str, devices)), count)


def _create_across_processes(buffer, groups, workspace_bytes: int, staging_bytes: int) -> None:
    """Two collective steps per group: every process exports its ranks' CUDA IPC handles with the Buffer's
    sizes to the key-value store, then maps every other rank's memory, after checking the sizes agree."""
    client = _kv_client()
    buffer.collective_name = _collective_name(buffer)
    me = jax.process_index()
    timeout_ms = int(buffer.config.timeout_s * 1000)
    sizes = dict(num_ranks=buffer.num_ranks, workspace_bytes=workspace_bytes, num_nvl_bytes=buffer.num_nvl_bytes,
                 num_max_dispatch_tokens_per_rank=buffer.num_max_dispatch_tokens_per_rank, hidden=buffer.hidden,
                 num_experts=buffer.num_experts)
    key = "{}/group/{}/rank/{}".format
    for index, group in groups:
        for rank, device in enumerate(group):
            if device.process_index == me:
                handle = _native._C.export_intranode(buffer.buffer_id, int(device.local_hardware_id), rank,
                                                     len(group), workspace_bytes, staging_bytes)
                record = dict(sizes, process=me, host=socket.gethostname(), ordinal=int(device.local_hardware_id),
                              handle=handle.hex())
                client.key_value_set(key(buffer.collective_name, index, rank), json.dumps(record))
    for index, group in groups:
        records = []
        for rank, device in enumerate(group):
            try:
                record = client.blocking_key_value_get(key(buffer.collective_name, index, rank), timeout_ms)
                records.append(json.loads(record))
            except Exception as e:  # the client raises a runtime error on its deadline
                raise RuntimeError(
                    f"jax_ep.Buffer: rank {rank} of EP group {index} (process {device.process_index}) did not create "
                    f"Buffer #{buffer.buffer_id} within {buffer.config.timeout_s} s: {e}") from e
        hosts = sorted({r["host"] for r in records})
        if len(hosts) > 1:
            raise SpansHostsError(f"jax_ep.Buffer: EP group {index} spans the hosts {hosts}; the intranode cuda "
                                  "backend needs every rank's GPU on one host (use backend='xla')")
        for rank, record in enumerate(records):
            theirs = {k: record[k] for k in sizes}
            if theirs != sizes:
                raise ValueError(
                    f"jax_ep.Buffer: rank {rank} of EP group {index} created Buffer #{buffer.buffer_id} with {theirs}, "
                    f"this process with {sizes}; every rank must pass the same sizes")
        handles = [bytes.fromhex(r["handle"]) for r in records]
        local = [r["ordinal"] if r["process"] == me else -1 for r in records]
        outcome = "ok"
        try:
            for device in group:
                if device.process_index == me:
                    _native._C.connect_intranode(buffer.buffer_id, int(device.local_hardware_id), handles, local)
        except Exception as e:  # told to the other processes first, so that none of them waits on us at run time
            outcome = f"{type(e).__name__}: {e}"
        _confirm_connected(client, buffer, index, group, outcome, timeout_ms)


def _confirm_connected(client, buffer, index: int, group, outcome: str, timeout_ms: int) -> None:
    """Every process of the group publishes whether it mapped its peers and reads the others': a Buffer is
    created everywhere or nowhere (else a rank that failed would leave the others to time out at the first op)."""
    key = "{}/group/{}/connected/{}".format
    me = jax.process_index()
    client.key_value_set(key(buffer.collective_name, index, me), outcome)
    for process in sorted({d.process_index for d in group}):
        try:
            theirs = client.blocking_key_value_get(key(buffer.collective_name, index, process), timeout_ms)
        except Exception as e:  # the client raises a runtime error on its deadline
            raise RuntimeError(f"jax_ep.Buffer: process {process} did not finish creating Buffer #{buffer.buffer_id} "
                               f"within {buffer.config.timeout_s} s: {e}") from e
        if theirs != "ok":
            raise RuntimeError(f"jax_ep.Buffer: process {process} could not map its peers' memory for Buffer "
                               f"#{buffer.buffer_id} (EP group {index}): {theirs}")


def destroy(buffer) -> str:
    """Frees the device memory of `buffer` after its GPUs finished; returns '' or the problems met. In a group
    spanning processes every process first waits for its GPUs and unmaps its peers, then all meet at a
    bounded barrier, then each frees its own memory: nobody frees what another process still maps. An NVSHMEM
    region is freed collectively, and only when every process says its GPU is healthy (a GPU whose kernel timed
    out cannot take part, and the others would wait for it): otherwise every process only forgets it."""
    problems = []
    if buffer.spans_processes:
        processes = sorted({d.process_index for d in buffer.mesh.devices.flat})
        unmapped = _native._C.unmap_intranode(buffer.buffer_id)  # this process reads no peer memory from here on
        if unmapped:
            problems.append(unmapped)
        try:
            _kv_client().wait_at_barrier(f"{buffer.collective_name}/destroy",
                                         int(buffer.config.timeout_s * 1000), processes)
        except Exception as e:  # a peer died or never destroys: free ours anyway
            problems.append(f"not every process reached destroy within {buffer.config.timeout_s} s ({e})")
        if buffer.low_latency_transport == "nvshmem":
            problems += _destroy_symmetric_region(buffer, processes, healthy=not problems)
    elif buffer.low_latency_transport == "nvshmem":  # a single process: NVSHMEM with one PE
        problems += _destroy_symmetric_region(buffer, [jax.process_index()], healthy=True)
    freed = _native._C.destroy_intranode(buffer.buffer_id)
    if freed:
        problems.append(freed)
    return "; ".join(problems)


def _destroy_symmetric_region(buffer, processes, healthy: bool) -> list[str]:
    """Every process publishes whether it can take part in the collective free, reads the others' answers
    (bounded), and frees only when all can; else it forgets the region (leaking it until the process ends)."""
    answers = {jax.process_index(): "ok" if healthy else "unhealthy"}
    if len(processes) > 1:
        client, timeout_ms = _kv_client(), int(buffer.config.timeout_s * 1000)
        key = f"{buffer.collective_name}/nvshmem_free/{{}}".format
        client.key_value_set(key(jax.process_index()), answers[jax.process_index()])
        for process in processes:
            try:
                answers[process] = client.blocking_key_value_get(key(process), timeout_ms)
            except Exception:  # the client raises a runtime error on its deadline
                answers[process] = "absent"
    release = all(answer == "ok" for answer in answers.values())
    problems = [] if release else [f"the NVSHMEM region of Buffer #{buffer.buffer_id} was not freed (processes: "
                                   f"{answers})"]
    errors = _native._C.nvshmem_region_destroy(buffer.buffer_id, release)
    return problems + ([errors] if errors else [])


def kernel_times(buffer, reset: bool = False) -> list[tuple[int, int]]:
    """(calls, summed kernel nanoseconds) per device of this process, by CUDA ordinal: the bare kernel time of
    each op, as %globaltimer sees it from the kernel's first block starting to its last block leaving."""
    return [tuple(t) for t in _native._C.intranode_kernel_times(buffer.buffer_id, reset)]


def errors(buffer) -> list[str]:
    """One line per rank of this process whose kernel (normal, low-latency or internode mode) timed out waiting
    for a peer (op, rank, peer, call)."""
    if buffer.internode:
        from jax_ep import internode  # which builds on this module

        return internode.errors(buffer)
    return list(_native._C.intranode_errors(buffer.buffer_id)) + cuda_low_latency.errors(buffer)


# ---- checks --------------------------------------------------------------------------------------------------

def check_dispatch(num_ranks: int, num_tokens: int, num_topk: int) -> None:
    if num_topk > MAX_TOPK:
        raise ValueError(f"jax_ep.dispatch (cuda): at most {MAX_TOPK} top-k entries per token, got {num_topk}")
    if num_ranks * num_tokens >= 2**31 - 1:
        raise ValueError(f"jax_ep.dispatch (cuda): ranks * tokens must fit int32, got {num_ranks} * {num_tokens}")


# ---- ops -------------------------------------------------------------------------------------------------------

def dispatch(x_leaves, topk_idx, topk_weights, *, params: KernelParams, num_ranks, num_experts, capacity,
             expert_alignment):
    """Normal dispatch. Returns (recv leaves, recv_topk_idx, recv_topk_weights, num_recv_tokens,
    num_recv_tokens_per_expert, num_dropped, invalid_ids, handle), as `xla_backend.dispatch`."""
    num_tokens, num_topk = topk_idx.shape
    check_dispatch(num_ranks, num_tokens, num_topk)
    row_bytes = tuple(_row_bytes(leaf) for leaf in x_leaves)
    _check_staging("dispatch", params,
                   dispatch_staging_bytes(num_tokens, row_bytes, num_topk, num_ranks, topk_weights is not None))
    routing = ((num_tokens, num_ranks), int32)
    outs, (_send_offset, send_row) = call_dispatch(
        DISPATCH_TARGET, x_leaves, topk_idx, topk_weights, (routing, routing), params=params, num_ranks=num_ranks,
        num_experts=num_experts, capacity=capacity, expert_alignment=expert_alignment)
    *results, recv_src_index, is_token_in_rank = outs
    return (*results, IntranodeHandle(recv_src_index, is_token_in_rank, send_row))


def call_dispatch(target: str, x_leaves, topk_idx, topk_weights, handle_types, *, params, num_ranks, num_experts,
                  capacity, expert_alignment):
    """The normal-mode dispatch FFI call (intranode or internode kernels): its operands, the results every
    dispatch kernel writes and then results of `handle_types` ((shape, dtype) pairs). Returns ((recv leaves,
    recv_topk_idx, recv_topk_weights or None, num_recv_tokens, num_recv_tokens_per_expert, num_dropped,
    invalid_ids, recv_src_index, is_token_in_rank), the results of handle_types)."""
    num_tokens, num_topk = topk_idx.shape
    aval = jax.typeof(x_leaves[0])

    def result(shape, dtype):
        return aval.update(shape=shape, dtype=dtype)

    result_types = [result((capacity, *leaf.shape[1:]), leaf.dtype) for leaf in x_leaves]
    result_types.append(result((capacity, num_topk), int32))
    if topk_weights is not None:
        result_types.append(result((capacity, num_topk), jnp.float32))
    result_types += [
        result((), int32), result((num_experts // num_ranks,), int32), result((), int32), result((), int32),
        result((capacity,), int32), result((num_tokens, num_ranks), jnp.bool_),
        *(result(shape, dtype) for shape, dtype in handle_types),
    ]
    operands = (*x_leaves, topk_idx) + (() if topk_weights is None else (topk_weights,))
    outs = list(jax.ffi.ffi_call(target, result_types)(
        *operands, num_payloads=np.int64(len(x_leaves)), num_experts=np.int64(num_experts),
        expert_alignment=np.int64(expert_alignment), **params.attributes(),
    ))
    recv_leaves = tuple(outs[:len(x_leaves)])
    outs = outs[len(x_leaves):]
    recv_topk_idx = outs.pop(0)
    recv_topk_weights = None if topk_weights is None else outs.pop(0)
    common, extra = outs[:6], outs[6:]
    return (recv_leaves, recv_topk_idx, recv_topk_weights, *common), tuple(extra)


def cached_dispatch(leaf, handle, *, params: KernelParams) -> jax.Array:
    """Dispatch new data [T, ...] along the routing of `handle` -> [C, ...]."""
    capacity = handle.recv_src_index.shape[0]
    _check_staging("cached dispatch", params, cached_dispatch_staging_bytes(leaf.shape[0], _row_bytes(leaf)))
    result_type = jax.typeof(leaf).update(shape=(capacity, *leaf.shape[1:]), dtype=leaf.dtype)
    return jax.ffi.ffi_call(CACHED_DISPATCH_TARGET, result_type)(leaf, handle.recv_src_index, **params.attributes())


def combine(y, handle: IntranodeHandle, *, params: KernelParams, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """y [C, ...] -> [T, ...] of out_dtype: each token's rows summed in float32 in rank order, plus `bias` in
    float32, cast once."""
    if not isinstance(handle, IntranodeHandle):
        raise TypeError("jax_ep.combine (cuda): the handle must come from a dispatch of the cuda backend, got "
                        f"{type(handle).__name__}")
    y, bias, kernel_out = combine_kernel_types(y, bias, out_dtype)
    num_tokens, num_ranks = handle.send_row.shape
    row_bytes = _row_bytes(y)
    push = params.combine_push_warps > 0
    _check_staging("combine", params, combine_staging_bytes(num_tokens, row_bytes, num_ranks, y.shape[0], push))
    aval = jax.typeof(y)
    result_types = [aval.update(shape=(num_tokens, *y.shape[1:]), dtype=kernel_out)]
    if push and params.staging_bytes is None:  # one process: the peers push into a scratch result
        result_types.append(aval.update(shape=((num_ranks - 1) * num_tokens * row_bytes,), dtype=jnp.uint8))
    operands = (y, handle.send_row, handle.recv_src_index) + (() if bias is None else (bias,))
    out = jax.ffi.ffi_call(COMBINE_TARGET, result_types)(
        *operands, push_warps=np.int64(params.combine_push_warps), **params.attributes())[0]
    return out.astype(out_dtype)


def combine_kernel_types(y, bias, out_dtype):
    """(y, bias, the kernel's output dtype) as the combine kernels take them: they read f32/bf16/f16 rows and
    write y's type or f32; other types widen to f32 first, exactly as the float32 sum would (the xla backend's
    semantics), and the caller casts the kernel's output to out_dtype."""
    if y.dtype not in _FLOAT_TYPES:
        y = y.astype(jnp.float32)
    if bias is not None and bias.dtype not in (y.dtype, jnp.float32):
        bias = bias.astype(jnp.float32)
    return y, bias, out_dtype if out_dtype in (y.dtype, jnp.float32) else jnp.float32


def store_probe(token, *, params: KernelParams, num_ranks: int, bytes_per_peer: int) -> jax.Array:
    """The benchmark's all-to-all store ceiling (per rank, inside shard_map): every rank stores
    `bytes_per_peer` bytes into each peer at once with plain 16-byte stores from `params.num_sms` SMs; returns
    this rank's uint8 [num_ranks * bytes_per_peer] (what the peers stored). `token` orders the call after its
    producer. One process driving the group only."""
    if params.staging_bytes is not None:
        raise NotImplementedError("jax_ep store probe: needs one process driving every GPU of the EP group")
    result_type = jax.typeof(token).update(shape=(num_ranks * bytes_per_peer,), dtype=jnp.uint8)
    return jax.ffi.ffi_call(STORE_PROBE_TARGET, result_type)(token, **params.attributes())
