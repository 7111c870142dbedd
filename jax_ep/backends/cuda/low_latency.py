"""The `cuda` backend's low-latency mode: the kernels of csrc/low_latency_*.cu through `jax.ffi.ffi_call`
(docs/design.md, "Low-latency dispatch", "Low-latency combine", "Low-latency kernels").

Per-rank functions (inside `shard_map` over the EP axis), one FFI call per half. A send returns a `token`
(uint32 scalar: the call number the kernels keep on the device) that its receive consumes, so XLA orders the
two halves by data dependency and may schedule other work between them.

Buffer sets and credits: call c of an op writes into buffer set c % 2 of the receivers, after every
receiver finished receiving call c - 2 (a credit the send waits for). So at most two calls of one op (two
dispatches, or two combines) may be between their send and their receive on a rank; a third send waits
for a credit that never comes and fails after `Config.timeout_s` with an error naming the credit wait
(`Buffer.errors()`). Receives may run in any order.

Gradients: each receive half differentiates through the xla implementation of the whole op, recomputed in the
backward pass (the kernels move the same values, so the gradients are the xla backend's). x / y and the routing
enter the receive as operands for that purpose only; the sends see them through `stop_gradient`.

Handle: `CudaLowLatencyHandle` extends the `xla` backend's `LowLatencyHandle` (same first two fields, bit
for bit) with `src_topk_index`: where in its source token's top-k row each row's expert first appears;
the expert side returns each output row into the source's slot (token, that top-k entry). The `xla`
combine accepts this handle; the CUDA combine needs it (an `xla` handle lacks the field).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native
from jax_ep._cotangents import zero_cotangent
from jax_ep.backends import LowLatencyCast, xla
from jax_ep.backends.cuda import runtime
from jax_ep.config import FP8_GROUP, LOW_LATENCY_MAX_TOPK

DISPATCH_SEND_TARGET = _native.target("low_latency_dispatch_send")
DISPATCH_RECV_TARGET = _native.target("low_latency_dispatch_recv")
COMBINE_SEND_TARGET = _native.target("low_latency_combine_send")
COMBINE_RECV_TARGET = _native.target("low_latency_combine_recv")
MASK_TARGET = _native.target("low_latency_mask")

# Limits of the low-latency kernels (csrc/kernel_limits.h): ranks of a group, experts of a Buffer (ids travel as
# int16), and top-k entries of one dispatch, tokens * top-k (the send keeps the routing in shared memory);
# LOW_LATENCY_MAX_TOPK is in config.
MAX_RANKS = _native.limit("max_low_latency_ranks")
MAX_EXPERTS = _native.limit("low_latency_max_experts")
MAX_ENTRIES = _native.limit("low_latency_max_entries")
# A masked peer's word in a rank's LL header: this bit | the dispatches the rank had started when it masked the peer.
MASKED_BIT = _native.limit("low_latency_masked_bit")
# The FFI attributes' enums (csrc/api.h, through _C): what the dispatch rows carry, how the LL region is reached
# (Buffer.low_latency_transport), the combine's row format (compression=, None for "none").
PAYLOADS = _native.enum("low_latency_payload")
TRANSPORTS = _native.enum("low_latency_transport")
COMPRESSIONS = _native.enum("low_latency_compression")

int32 = jnp.int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CudaLowLatencyHandle:
    src_token_index: jax.Array  # int32 [L, R*M]: source token of each row, -1 for unused rows
    layout_range: jax.Array  # int32 [L, R, 2]: (first row, row count) per (local expert, source rank)
    src_topk_index: jax.Array  # int32 [L, R*M]: first top-k entry of the row's expert in its source token; -1
    num_tokens: int = dataclasses.field(metadata={"static": True})  # T of the dispatch (see LowLatencyHandle)


@dataclasses.dataclass(frozen=True)
class LowLatencyParams:
    """Static parameters of every low-latency call: its FFI attributes (the Buffer's rank state, how its LL region
    is reached, `transport` a csrc LowLatencyTransport, and the sizes of that region) and the EP axis where the
    gradients' xla recomputation runs."""

    buffer_id: int
    transport: int
    ll_offset: int
    num_max_tokens: int
    num_experts: int
    timeout_ns: int
    mask_on_timeout: bool  # Config(on_timeout="mask")
    axis_name: str
    num_ranks: int

    def attributes(self) -> dict:
        return {name: np.int64(getattr(self, name))
                for name in ("buffer_id", "transport", "ll_offset", "num_max_tokens", "num_experts", "timeout_ns",
                             "mask_on_timeout")}


def available() -> bool:
    return _native.has_target(DISPATCH_SEND_TARGET, "cuda")


def check_usable(op: str, offset: int | None, num_experts: int) -> None:
    """Raises a clear error when a Buffer whose low-latency region starts at `offset` of its workspace (None: it
    has none) cannot run low-latency op `op` with `num_experts` experts."""
    if not available():
        raise RuntimeError(f"jax_ep.{op}: this build has no CUDA low-latency kernels (rebuild with nvcc on the "
                           "PATH) ; use a Buffer with backend='xla'")
    if offset is None:
        raise RuntimeError(f"jax_ep.{op}: the cuda Buffer has no low-latency region; create it with "
                           "num_max_dispatch_tokens_per_rank, hidden and num_experts")
    align = _native.limit("low_latency_align")
    if offset % align:
        raise RuntimeError(f"jax_ep.{op}: the low-latency region's offset {offset} is not {align}-byte aligned")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"jax_ep.{op} (cuda): at most {MAX_EXPERTS} experts, the Buffer has {num_experts}")


def check_topk(op: str, num_topk: int) -> None:
    if num_topk > LOW_LATENCY_MAX_TOPK:
        raise ValueError(f"jax_ep.{op} (cuda): at most {LOW_LATENCY_MAX_TOPK} top-k entries per token, got {num_topk}")


def _payload(use_fp8: bool, use_ue8m0: bool) -> int:
    return PAYLOADS["bf16" if not use_fp8 else "fp8_ue8m0" if use_ue8m0 else "fp8"]


# ---- dispatch -------------------------------------------------------------------------------------------------

def dispatch_send(x, topk_idx, *, params: LowLatencyParams, cast: LowLatencyCast):
    """Casts and writes this rank's rows into the receivers' slots. Returns the state `dispatch_recv` takes."""
    num_tokens, num_topk = topk_idx.shape
    check_topk("low_latency_dispatch", num_topk)
    if num_tokens * num_topk > MAX_ENTRIES:
        raise ValueError(f"jax_ep.low_latency_dispatch (cuda): at most {MAX_ENTRIES} top-k entries per rank (tokens * "
                         f"top-k, e.g. {MAX_ENTRIES // LOW_LATENCY_MAX_TOPK} * {LOW_LATENCY_MAX_TOPK}), got "
                         f"{num_tokens} * {num_topk}")
    aval = jax.typeof(x)
    result_types = (aval.update(shape=(), dtype=jnp.uint32), aval.update(shape=(), dtype=int32))
    token, invalid = jax.ffi.ffi_call(DISPATCH_SEND_TARGET, result_types)(
        jax.lax.stop_gradient(x), topk_idx, payload=np.int64(_payload(cast.use_fp8, cast.use_ue8m0)),
        round_scale=np.int64(cast.round_scale), **params.attributes())
    return token, invalid, x, topk_idx


def dispatch_recv(state, *, params: LowLatencyParams, cast: LowLatencyCast):
    """Packs the received rows. Returns (recv leaves, recv_count [L], CudaLowLatencyHandle, invalid_ids)."""
    token, invalid, x, topk_idx = state
    return (*_dispatch_recv(params, cast, token, x, topk_idx), invalid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_recv(params: LowLatencyParams, cast: LowLatencyCast, token, x, topk_idx):
    num_ranks, hidden = params.num_ranks, x.shape[1]
    experts_per_rank = params.num_experts // num_ranks
    rows = (experts_per_rank, num_ranks * params.num_max_tokens)
    aval = jax.typeof(token)
    payload = [aval.update(shape=(*rows, hidden), dtype=jnp.float8_e4m3fn if cast.use_fp8 else jnp.bfloat16)]
    if cast.use_fp8:
        payload.append(aval.update(shape=(*rows, hidden // (4 * FP8_GROUP)), dtype=int32) if cast.use_ue8m0
                       else aval.update(shape=(*rows, hidden // FP8_GROUP), dtype=jnp.float32))
    result_types = (*payload, aval.update(shape=(experts_per_rank,), dtype=int32), aval.update(shape=rows, dtype=int32),
                    aval.update(shape=rows, dtype=int32), aval.update(shape=(experts_per_rank, num_ranks, 2), dtype=int32))
    outs = jax.ffi.ffi_call(DISPATCH_RECV_TARGET, result_types)(
        token, hidden=np.int64(hidden), payload=np.int64(_payload(cast.use_fp8, cast.use_ue8m0)),
        **params.attributes())
    recv = tuple(outs[:len(payload)])
    recv_count, src_token_index, src_topk_index, layout_range = outs[len(payload):]
    return recv, recv_count, CudaLowLatencyHandle(src_token_index, layout_range, src_topk_index, x.shape[0])


def _dispatch_recv_fwd(params, cast, token, x, topk_idx):
    return _dispatch_recv(params, cast, token, x, topk_idx), (token, x, topk_idx)


def _dispatch_recv_bwd(params, cast, residual, cotangent):
    token, x, topk_idx = residual

    def xla_dispatch(x):
        state = xla.low_latency_dispatch_send(
            x, topk_idx, axis_name=params.axis_name, num_experts=params.num_experts, use_fp8=cast.use_fp8,
            round_scale=cast.round_scale, use_ue8m0=cast.use_ue8m0)
        return xla.low_latency_dispatch_recv(state, axis_name=params.axis_name, num_ranks=params.num_ranks,
                                             num_experts=params.num_experts, num_max_tokens=params.num_max_tokens)[0]

    _, vjp = jax.vjp(xla_dispatch, x)
    (d_x,) = vjp(tuple(cotangent[0]))
    return zero_cotangent(token), d_x, zero_cotangent(topk_idx)


_dispatch_recv.defvjp(_dispatch_recv_fwd, _dispatch_recv_bwd)


# ---- combine --------------------------------------------------------------------------------------------------

def combine_send(y, handle, topk_idx, topk_weights, *, params: LowLatencyParams, compression=None):
    """Returns every valid row of y [L, R*M, H] to its source rank (LogFMT-encoded with compression="logfmt").
    Returns the state `combine_recv` takes."""
    check_topk("low_latency_combine", topk_idx.shape[1])
    if not isinstance(handle, CudaLowLatencyHandle):
        raise TypeError("jax_ep.low_latency_combine (cuda): the handle must come from a low_latency_dispatch of the "
                        f"cuda backend, got {type(handle).__name__}")
    sent_y, sent_handle = jax.lax.stop_gradient((y, handle))
    result_type = jax.typeof(y).update(shape=(), dtype=jnp.uint32)
    token = jax.ffi.ffi_call(COMBINE_SEND_TARGET, result_type)(
        sent_y, sent_handle.src_token_index, sent_handle.src_topk_index, sent_handle.layout_range,
        **params.attributes(), compression=np.int64(COMPRESSIONS[compression or "none"]))
    return token, y, handle, topk_idx, topk_weights


def combine_recv(state, *, params: LowLatencyParams, compression=None):
    """out[t] = sum_k topk_weights[t, k] * (row of expert topk_idx[t, k] for t), float32 in k order, bf16 [T, H].
    The gradients are those of the uncompressed combine (the rows' encoding counts as the identity)."""
    return _combine_recv(params, compression, *state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine_recv(params: LowLatencyParams, compression, token, y, handle, topk_idx, topk_weights):
    check_topk("low_latency_combine", topk_idx.shape[1])
    result_type = jax.typeof(topk_weights).update(shape=(topk_idx.shape[0], y.shape[-1]), dtype=jnp.bfloat16)
    return jax.ffi.ffi_call(COMBINE_RECV_TARGET, result_type)(token, topk_idx, topk_weights, **params.attributes(),
                                                              compression=np.int64(COMPRESSIONS[compression or "none"]))


def _combine_recv_fwd(params, compression, token, y, handle, topk_idx, topk_weights):
    out = _combine_recv(params, compression, token, y, handle, topk_idx, topk_weights)
    return out, (token, y, handle, topk_idx, topk_weights)


def _combine_recv_bwd(params, compression, residual, cotangent):
    token, y, handle, topk_idx, topk_weights = residual

    def xla_combine(y, topk_weights):
        returned = xla.low_latency_combine_send(y, handle, topk_idx.shape[0], axis_name=params.axis_name,
                                                num_ranks=params.num_ranks)
        return xla.low_latency_combine_recv(returned, topk_idx, topk_weights, num_experts=params.num_experts)

    _, vjp = jax.vjp(xla_combine, y, topk_weights)
    d_y, d_weights = vjp(cotangent)
    return zero_cotangent(token), d_y, zero_cotangent(handle), zero_cotangent(topk_idx), d_weights


_combine_recv.defvjp(_combine_recv_fwd, _combine_recv_bwd)


# ---- masked ranks (Config(on_timeout="mask"); jax_ep.masks, docs/design.md "Masked ranks") -----------------------

def read_mask(buffer_id: int, transport: int, ll_offset: int, axis_name: str, num_ranks: int):
    """bool [R] (per rank, inside shard_map): the peers this rank masks, read from its LL header on the GPU when the
    program runs (a side effect: never merged with another read or moved across the LL kernels it depends on)."""
    aval = jax.typeof(jax.lax.axis_index(axis_name)).update(shape=(num_ranks,), dtype=int32)
    masked = jax.ffi.ffi_call(MASK_TARGET, aval, has_side_effect=True)(
        buffer_id=np.int64(buffer_id), transport=np.int64(transport), ll_offset=np.int64(ll_offset))
    return masked != 0


class DeviceRankMasks:
    """The masks of a cuda Backend's ranks (the `xla` backend's RankMasks, same methods): each rank's view is in its
    LL header on its GPU, where its kernels read it at every wait and a wait past the bound sets it; the host reads
    and writes it between calls (nothing of the Buffer running)."""

    def __init__(self, backend):
        self._backend = backend

    def _devices(self, ranks) -> list[tuple[int, int]]:
        """(CUDA ordinal, EP rank) of this process's devices whose EP rank is in `ranks`."""
        mesh, wanted = self._backend.mesh, set(ranks)
        axis = mesh.axis_names.index(self._backend.axis_name)
        return [(int(d.local_hardware_id), index[axis]) for index, d in np.ndenumerate(mesh.devices)
                if d.process_index == jax.process_index() and index[axis] in wanted]

    def _views(self, ranks):
        """(ordinal, rank, masked words [R], dispatches started) per device of `ranks`."""
        b = self._backend
        b.require_low_latency_region("masked ranks")
        devices = self._devices(ranks)
        words = _native._C.low_latency_masks(b.buffer_id, [o for o, _ in devices], TRANSPORTS[b.low_latency_transport],
                                             b.low_latency_offset)
        return [(o, r, list(w[:-1]), w[-1]) for (o, r), w in zip(devices, words)]

    def mask(self, peers, ranks) -> None:
        b = self._backend
        for ordinal, rank, words, started in self._views(ranks):
            for p in peers:
                if p != rank and words[p] == 0:
                    words[p] = MASKED_BIT | started
            _native._C.low_latency_set_masks(b.buffer_id, ordinal, TRANSPORTS[b.low_latency_transport],
                                             b.low_latency_offset, words)

    def unmask(self, peers, ranks) -> None:
        raise ValueError("jax_ep.Buffer.unmask_ranks: on the cuda backend a rank is let back in by "
                         "Buffer.reset_low_latency() on every process (the kernels' call numbers and credits restart "
                         "together)")

    def masked(self, ranks) -> dict[int, dict[int, int]]:
        views = {}
        for _, rank, words, _ in self._views(ranks):
            views.setdefault(rank, {}).update({p: int(w) & (MASKED_BIT - 1) for p, w in enumerate(words) if w})
        return {r: views.get(r, {}) for r in ranks}


# ---- bounded-wait records and the benchmark's trace ---------------------------------------------------------------

def errors(buffer_id: int, ordinals) -> list[str]:
    """One line per device (CUDA ordinals of this process) whose low-latency kernel timed out (op, rank, peer,
    call)."""
    return list(_native._C.low_latency_errors(buffer_id, list(ordinals)))


KERNELS = ("dispatch send", "dispatch recv", "combine send", "combine recv")  # csrc LowLatencyKernel order


def trace(buffer_id: int, ordinals, transport: str, offset: int, reset: bool = False) -> list[dict[str, dict]]:
    """Per device (CUDA ordinals of this process) of the Buffer whose low-latency region is reached by `transport`
    at `offset`: for each LL kernel, its trace of its recent calls (a ring of
    `_C.limits()["low_latency_trace_calls"]` slots; csrc/low_latency_state.h, LowLatencyTrace) as {field: int64 array
    over the ring's slots} with the fields `call`, `units` and the %globaltimer instants `first_start`,
    `last_start`, `first_flag`, `last_flag`, `end` (ns, comparable within one GPU only; a slot holds a finished call
    when end > first_start > 0), and `phases`: {phase: ns summed over `units`}. `reset` prepares every slot
    afterwards: call it before the calls to measure, while none of the buffer's kernels runs (the benchmark's
    breakdown)."""
    _native.require_instrumentation("the low-latency kernels' trace")
    common, phases = _native._C.low_latency_trace_fields()
    rings = _native._C.low_latency_trace(buffer_id, list(ordinals), TRANSPORTS[transport], offset, reset)
    devices = []
    for words in rings:
        # Instants are below 2**63 ns: as int64 they subtract exactly; a minimum never set reads -1.
        slots = np.asarray(words, np.uint64).view(np.int64).reshape(len(KERNELS), -1, len(common) + len(phases[0]))
        devices.append({kernel: {**{name: slots[k, :, i] for i, name in enumerate(common)},
                                 "phases": {name: slots[k, :, len(common) + i] for i, name in enumerate(phases[k])
                                            if name != "-"}}
                        for k, kernel in enumerate(KERNELS)})
    return devices


# ---- the low-latency ops of a cuda backend ------------------------------------------------------------------------

class LowLatencyOps:
    """The low-latency methods of a cuda Backend (intranode or internode): the Backend has `buffer_id`, `mesh`,
    `axis_name`, `config`, `num_ranks`, and `low_latency_transport` and `low_latency_offset` (where its region
    is reached, None without one)."""

    def check_low_latency(self, op, *, num_experts):
        check_usable(op, self.low_latency_offset, num_experts)

    def _low_latency_params(self, num_experts: int, num_max_tokens: int) -> LowLatencyParams:
        return LowLatencyParams(self.buffer_id, TRANSPORTS[self.low_latency_transport], self.low_latency_offset,
                                num_max_tokens, num_experts, runtime.timeout_ns(self.config),
                                self.config.on_timeout == "mask", self.axis_name, self.num_ranks)

    def low_latency_dispatch_send(self, x, topk_idx, *, num_experts, num_max_tokens, cast: LowLatencyCast):
        return dispatch_send(x, topk_idx, params=self._low_latency_params(num_experts, num_max_tokens), cast=cast)

    # masked: unused here: the kernels read each rank's masks on its GPU at every wait (DeviceRankMasks).
    def low_latency_dispatch_recv(self, state, *, num_experts, num_max_tokens, cast: LowLatencyCast, masked=None):
        return dispatch_recv(state, params=self._low_latency_params(num_experts, num_max_tokens), cast=cast)

    def low_latency_combine_send(self, y, handle, topk_idx, topk_weights, *, num_experts, num_max_tokens,
                                 compression=None, masked=None):
        return combine_send(y, handle, topk_idx, topk_weights, compression=compression,
                            params=self._low_latency_params(num_experts, num_max_tokens))

    def low_latency_combine_recv(self, state, *, num_experts, num_max_tokens, compression=None):
        return combine_recv(state, compression=compression,
                            params=self._low_latency_params(num_experts, num_max_tokens))

    @property
    def masks(self) -> DeviceRankMasks:
        return DeviceRankMasks(self)

    def low_latency_mask(self, op):
        return read_mask(self.buffer_id, TRANSPORTS[self.low_latency_transport], self.low_latency_offset,
                         self.axis_name, self.num_ranks)

    def reset_low_latency(self, *, num_max_tokens, hidden, num_experts, resets: int) -> None:
        """Every rank of this process back to a new Buffer's low-latency state (call numbers, credits, flags, no
        masks), between two barriers of every process of the Buffer (the `resets`-th reset): no rank resets while
        another still runs, and none calls again before all reset."""
        self.require_low_latency_region("reset_low_latency")
        processes = sorted({d.process_index for d in self.mesh.devices.flat})
        key = f"{self.collective_name}/low_latency_reset/{resets}/{{}}/{{}}".format
        timeout_s = self.config.host_timeout_s

        def barrier(step: str) -> None:
            if self.collective_name is not None and len(processes) > 1:  # else no group spans processes
                runtime.require_published(runtime.exchange({key(step, jax.process_index()): "1"},
                                                           [key(step, p) for p in processes], timeout_s),
                                          [f"process {p}" for p in processes], "reach Buffer.reset_low_latency",
                                          timeout_s)

        barrier("before")
        for ordinal in runtime.local_ordinals(self.mesh):
            _native._C.low_latency_reset(self.buffer_id, ordinal, TRANSPORTS[self.low_latency_transport],
                                         self.low_latency_offset, num_max_tokens, hidden, num_experts)
        barrier("after")

    def low_latency_errors(self) -> list[str]:
        """The low-latency kernels' timeout records of this process's devices."""
        return errors(self.buffer_id, runtime.local_ordinals(self.mesh))

    def require_low_latency_region(self, what: str) -> None:
        if self.low_latency_offset is None:
            raise ValueError(f"jax_ep.Buffer.{what}: this Buffer has no low-latency region (create it with "
                             "num_max_dispatch_tokens_per_rank, hidden and num_experts on the cuda backend)")

    def low_latency_trace(self, reset: bool = False) -> list[dict[str, dict]]:
        """The low-latency kernels' trace of their recent calls per local device (see `trace`)."""
        self.require_low_latency_region("low_latency_trace")
        return trace(self.buffer_id, runtime.local_ordinals(self.mesh), self.low_latency_transport,
                     self.low_latency_offset, reset)
