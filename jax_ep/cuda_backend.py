"""The `cuda` backend, intranode normal mode with one process driving every GPU of the EP group: the CUDA
kernels of csrc/intranode.cu called through `jax.ffi.ffi_call` (ARCHITECTURE.md §3, §4).

Same per-rank functions and return tuples as `xla_backend` (run inside `shard_map` over the EP axis). The
Buffer's device state is created here (`create`) outside jit; each call names it by `buffer_id`.

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native

DISPATCH_TARGET = "jax_ep_dispatch"
CACHED_DISPATCH_TARGET = "jax_ep_cached_dispatch"
COMBINE_TARGET = "jax_ep_combine"

MAX_RANKS = 8  # csrc kMaxIntranodeRanks
MAX_TOPK = 32  # one warp lane per top-k entry
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
    """Static parameters every intranode call carries as FFI attributes."""

    buffer_id: int
    num_sms: int
    timeout_ns: int

    def attributes(self) -> dict:
        return dict(buffer_id=np.int64(self.buffer_id), num_sms=np.int64(self.num_sms),
                    timeout_ns=np.int64(self.timeout_ns))


def kernel_params(buffer) -> KernelParams:
    return KernelParams(buffer.buffer_id, buffer.config.num_sms, int(buffer.config.timeout_s * 1e9))


# ---- runtime ------------------------------------------------------------------------------------------------

def _ep_groups(mesh, axis_name: str) -> np.ndarray:
    """Devices as [groups, R]: one row per EP group (every combination of the other mesh axes), in rank order."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(axis_name)
    return np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])


def unsupported_reason(mesh, axis_name: str) -> str | None:
    """Why this backend cannot serve an EP axis of `mesh`, or None when it can."""
    groups = _ep_groups(mesh, axis_name)
    if any(d.process_index != jax.process_index() for d in groups.flat):
        return ("the cuda backend drives every GPU of the EP axis from one process; this mesh holds devices of "
                "other processes (one process per GPU is not supported by the cuda backend yet: use backend='xla')")
    if groups.shape[1] > MAX_RANKS:
        return f"the cuda backend supports up to {MAX_RANKS} ranks per EP axis, the axis has {groups.shape[1]}"
    return None


def create(buffer) -> None:
    """Allocates the device state of every EP group of `buffer` (one per combination of the other mesh axes)."""
    reason = unsupported_reason(buffer.mesh, buffer.axis_name)
    if reason:
        raise NotImplementedError(f"jax_ep.Buffer: {reason}")
    try:
        for group in _ep_groups(buffer.mesh, buffer.axis_name):
            # local_hardware_id is the CUDA ordinal XLA hands the FFI handler as DeviceOrdinal.
            _native._C.create_intranode(buffer.buffer_id, [int(d.local_hardware_id) for d in group])
    except BaseException:
        _native._C.destroy_intranode(buffer.buffer_id)
        raise


def destroy(buffer) -> str:
    """Frees the device state of `buffer` after its GPUs finished; returns '' or the CUDA errors met."""
    return _native._C.destroy_intranode(buffer.buffer_id)


def kernel_times(buffer, reset: bool = False) -> list[tuple[int, int]]:
    """(calls, summed kernel nanoseconds) per device in rank order: the bare kernel time of each op, as
    %globaltimer sees it from the kernel's first block starting to its last block leaving."""
    return [tuple(t) for t in _native._C.intranode_kernel_times(buffer.buffer_id, reset)]


def errors(buffer) -> list[str]:
    """One line per rank whose kernel timed out waiting for a peer (op, rank, peer, call number)."""
    return list(_native._C.intranode_errors(buffer.buffer_id))


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
    aval = jax.typeof(x_leaves[0])

    def result(shape, dtype):
        return aval.update(shape=shape, dtype=dtype)

    routing = (num_tokens, num_ranks)
    result_types = [result((capacity, *leaf.shape[1:]), leaf.dtype) for leaf in x_leaves]
    result_types.append(result((capacity, num_topk), int32))
    if topk_weights is not None:
        result_types.append(result((capacity, num_topk), jnp.float32))
    result_types += [
        result((), int32), result((num_experts // num_ranks,), int32), result((), int32), result((), int32),
        result((capacity,), int32), result(routing, jnp.bool_), result(routing, int32), result(routing, int32),
    ]
    operands = (*x_leaves, topk_idx) + (() if topk_weights is None else (topk_weights,))
    outs = list(jax.ffi.ffi_call(DISPATCH_TARGET, result_types)(
        *operands, num_payloads=np.int64(len(x_leaves)), num_experts=np.int64(num_experts),
        expert_alignment=np.int64(expert_alignment), **params.attributes(),
    ))
    recv_leaves = tuple(outs[:len(x_leaves)])
    outs = outs[len(x_leaves):]
    recv_topk_idx = outs.pop(0)
    recv_topk_weights = None if topk_weights is None else outs.pop(0)
    num_recv, per_expert, dropped, invalid, recv_src_index, is_token_in_rank, _send_offset, send_row = outs
    handle = IntranodeHandle(recv_src_index, is_token_in_rank, send_row)
    return (recv_leaves, recv_topk_idx, recv_topk_weights, num_recv, per_expert, dropped, invalid, handle)


def cached_dispatch(leaf, handle, *, params: KernelParams) -> jax.Array:
    """Dispatch new data [T, ...] along the routing of `handle` -> [C, ...]."""
    capacity = handle.recv_src_index.shape[0]
    result_type = jax.typeof(leaf).update(shape=(capacity, *leaf.shape[1:]), dtype=leaf.dtype)
    return jax.ffi.ffi_call(CACHED_DISPATCH_TARGET, result_type)(leaf, handle.recv_src_index, **params.attributes())


def combine(y, handle: IntranodeHandle, *, params: KernelParams, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """y [C, ...] -> [T, ...] of out_dtype: each token's rows summed in float32 in rank order, plus `bias` in
    float32, cast once."""
    if not isinstance(handle, IntranodeHandle):
        raise TypeError("jax_ep.combine (cuda): the handle must come from a dispatch of the cuda backend, got "
                        f"{type(handle).__name__}")
    # The kernel reads f32/bf16/f16 and writes y's type or f32; other types widen to f32 first, exactly as
    # the float32 sum would (the xla backend's semantics).
    if y.dtype not in _FLOAT_TYPES:
        y = y.astype(jnp.float32)
    if bias is not None and bias.dtype not in (y.dtype, jnp.float32):
        bias = bias.astype(jnp.float32)
    kernel_out = out_dtype if out_dtype in (y.dtype, jnp.float32) else jnp.float32
    num_tokens = handle.send_row.shape[0]
    result_type = jax.typeof(y).update(shape=(num_tokens, *y.shape[1:]), dtype=kernel_out)
    operands = (y, handle.send_row) + (() if bias is None else (bias,))
    out = jax.ffi.ffi_call(COMBINE_TARGET, result_type)(*operands, **params.attributes())
    return out.astype(out_dtype)
