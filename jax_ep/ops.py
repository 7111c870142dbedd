"""The public ops, for use inside `jax.shard_map` over a Buffer's EP axis (docs/design.md, "Semantics").

Each op checks its inputs while tracing, then calls the backend object the Buffer chose at creation
(`Buffer.backend_impl`, jax_ep.backends: the `cuda` kernels through `jax.ffi.ffi_call`, or the portable `xla`
backend). Normal-mode dispatch and combine carry `custom_vjp` rules: d dispatch = combine of the cotangents,
d combine = cached dispatch of the cotangent.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, _native, expert_major
from jax_ep._cotangents import typed_like, types_of, zero_cotangent
from jax_ep.backends import Backend, LowLatencyCast, xla
from jax_ep.buffer import Buffer
from jax_ep.types import (
    CombineResult,
    DispatchLayout,
    DispatchResult,
    ExpertMajorDispatchResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

LAYOUT_TARGET = _native.target("layout")


def _is_fp8_pair(x) -> bool:
    return isinstance(x, (tuple, list))


def _leaves(x) -> tuple:
    return tuple(x) if _is_fp8_pair(x) else (x,)


def _like(x, leaves):
    return tuple(leaves) if _is_fp8_pair(x) else leaves[0]


def _given(value, default):
    """An argument when given (0 included), else the Buffer's setting."""
    return default if value is None else value


def _check_buffer(op: str, buffer) -> None:
    """The ops take the Buffer first: a call that left it out would otherwise fail on its second argument."""
    if not isinstance(buffer, Buffer):
        raise TypeError(f"jax_ep.{op}: the first argument must be the jax_ep.Buffer (jax_ep.{op}(buffer, ...)), got "
                        f"{type(buffer).__name__}")


def _check_normal_handle(op: str, handle) -> None:
    if isinstance(handle, expert_major.ExpertMajorHandle):
        return
    if not (hasattr(handle, "recv_src_index") and hasattr(handle, "is_token_in_rank")):
        raise TypeError(f"jax_ep.{op}: handle must be the handle of a jax_ep.dispatch (DispatchResult.handle), got "
                        f"{type(handle).__name__}")


STRICT_MODES = (False, True, "checkify")


def _raise_on_counts(op: str, backend: Backend, mode, counts) -> None:
    """`strict`: turns positive device-side counts (dropped tokens, invalid ids) on any rank into the same
    run-time error on every rank. counts: [(template, count, fields)]: the template names the count `{n}`, its
    `{rank}` and the fields, a dict of further int32 scalars of this rank. The ranks first gather each other's
    values (with the backend's own all-gather): were only the ranks with a positive count to raise, the others
    would wait for them in the next collective until XLA aborts the process.

    mode True: a jax.debug.callback raises RuntimeError (JAX reports it after XLA's callback-error prefix).
    mode "checkify": a jax.experimental.checkify check per count and rank; the caller wraps the jitted function in
    checkify.checkify, and err.throw() raises with jax_ep's message first."""
    columns = [dict(n=count, **fields) for _, count, fields in counts]
    flat = [value for column in columns for value in column.values()]
    gathered = backend.all_gather(jnp.stack(flat)[None])  # [R, len(flat)]
    starts = np.cumsum([0] + [len(column) for column in columns])
    prefix = f"jax_ep.{op}(strict={mode!r}): "

    def values_of(per_rank, i, rank):  # count i's values on `rank`, by name
        return dict(zip(columns[i], per_rank[rank, starts[i]:starts[i + 1]]))

    if mode == "checkify":
        from jax.experimental import checkify

        for i, (template, _, _) in enumerate(counts):
            for rank in range(gathered.shape[0]):
                values = values_of(gathered, i, rank)
                placeholders = {name: "{" + name + "}" for name in values}
                checkify.check(values["n"] <= 0, prefix + template.format(rank=rank, **placeholders), **values)
        return

    def check(per_rank):
        problems = [template.format(rank=rank, **{k: int(v) for k, v in values_of(per_rank, i, rank).items()})
                    for i, (template, _, _) in enumerate(counts) for rank in range(per_rank.shape[0])
                    if per_rank[rank, starts[i]] > 0]
        if problems:
            raise RuntimeError(prefix + "; ".join(problems))

    jax.debug.callback(check, gathered)


# ---- layout ---------------------------------------------------------------------------------------------

def _layout_ffi(topk_idx, num_experts: int, num_ranks: int) -> DispatchLayout:
    aval = jax.typeof(topk_idx)
    result_types = (
        aval.update(shape=(num_ranks,), dtype=jnp.int32),
        aval.update(shape=(num_experts,), dtype=jnp.int32),
        aval.update(shape=(topk_idx.shape[0], num_ranks), dtype=jnp.bool_),
        aval.update(shape=(), dtype=jnp.int32),
    )
    outs = jax.ffi.ffi_call(LAYOUT_TARGET, result_types)(
        topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks)
    )
    return DispatchLayout(*outs)


def get_dispatch_layout(buffer: Buffer, topk_idx, num_experts: int | None = None) -> DispatchLayout:
    """Per-rank routing summary of `topk_idx` [T, K] (int32): tokens per rank and per expert (each counted
    once however many of its entries point there), `is_token_in_rank` [T, R] and `invalid_ids`.
    Runs the native FFI handler on platforms that have one (CPU, CUDA), else the `xla` implementation."""
    _check_buffer("get_dispatch_layout", buffer)
    buffer.check_alive()
    num_ranks = _checks.num_ranks("get_dispatch_layout", buffer.axis_name, buffer.num_ranks)
    num_experts = _checks.num_experts("get_dispatch_layout", _given(num_experts, buffer.num_experts), num_ranks)
    _checks.topk_idx("get_dispatch_layout", topk_idx, num_experts)
    portable = functools.partial(xla.layout, num_experts=num_experts, num_ranks=num_ranks)
    native = functools.partial(_layout_ffi, num_experts=num_experts, num_ranks=num_ranks)
    branches = {p: native for p in ("cpu", "cuda") if _native.has_target(LAYOUT_TARGET, p)}
    if not branches:
        return portable(topk_idx)
    return jax.lax.platform_dependent(topk_idx, default=portable, **branches)


# ---- normal dispatch / combine ---------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(spec, x, topk_idx, topk_weights):
    recv, recv_idx, recv_w, num_recv, per_expert, dropped, invalid, handle = spec.backend.dispatch(
        _leaves(x), topk_idx, topk_weights, num_experts=spec.num_experts, capacity=spec.capacity,
        expert_alignment=spec.expert_alignment)
    return DispatchResult(_like(x, recv), recv_idx, recv_w, num_recv, per_expert, dropped, invalid, handle)


def _dispatch_fwd(spec, x, topk_idx, topk_weights):
    out = _dispatch(spec, x, topk_idx, topk_weights)
    return out, (out.handle, out.recv_topk_idx, topk_idx, types_of(x), types_of(topk_weights))


# The backward rules type each cotangent like its primal (typed_like): x, the weights and what the backends compute
# from them may vary over different shard_map axes (a replicated x, say).
def _dispatch_bwd(spec, residual, cotangent):
    handle, recv_topk_idx, topk_idx, x_types, weights_types = residual
    d_x = jax.tree.map(lambda g, x: typed_like(spec.backend.combine(g, handle).astype(g.dtype), x),
                       cotangent.recv_x, x_types)
    d_weights = None
    if cotangent.recv_topk_weights is not None:
        # Only entries whose expert lives on the receiving rank carry the weight; the others are constant 0.
        kept = jnp.where(recv_topk_idx >= 0, cotangent.recv_topk_weights, 0.0)
        d_weights = typed_like(spec.backend.combine(kept, handle), weights_types)
    return d_x, zero_cotangent(topk_idx), d_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cached_dispatch(spec, x, handle):
    return jax.tree.map(lambda leaf: spec.backend.cached_dispatch(leaf, handle), x)


def _cached_dispatch_fwd(spec, x, handle):
    return _cached_dispatch(spec, x, handle), (handle, types_of(x))


def _cached_dispatch_bwd(spec, residual, cotangent):
    handle, x_types = residual
    d_x = jax.tree.map(lambda g, x: typed_like(spec.backend.combine(g, handle).astype(g.dtype), x), cotangent,
                       x_types)
    return d_x, zero_cotangent(handle)


_cached_dispatch.defvjp(_cached_dispatch_fwd, _cached_dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(spec, y, handle, topk_weights, bias):
    out = spec.backend.combine(y, handle, bias=bias, out_dtype=y.dtype)
    weights = None if topk_weights is None else spec.backend.combine(topk_weights, handle)
    return CombineResult(out, weights)


def _combine_fwd(spec, y, handle, topk_weights, bias):
    return _combine(spec, y, handle, topk_weights, bias), (handle, types_of(y), types_of(topk_weights),
                                                           types_of(bias))


def _combine_bwd(spec, residual, cotangent):
    handle, y_types, weights_types, bias_types = residual
    d_y = typed_like(spec.backend.cached_dispatch(cotangent.x, handle), y_types)
    d_weights = None if cotangent.topk_weights is None else typed_like(
        spec.backend.cached_dispatch(cotangent.topk_weights, handle), weights_types)
    d_bias = None if bias_types is None else typed_like(cotangent.x.astype(bias_types.dtype), bias_types)
    return d_y, zero_cotangent(handle), d_weights, d_bias


_combine.defvjp(_combine_fwd, _combine_bwd)

LAYOUTS = ("rank_major", "expert_major")
# Rows and row indices of a dispatch's outputs are int32.
MAX_ROWS = np.iinfo(np.int32).max


def _normal_spec(op: str, buffer: Buffer, num_experts, capacity=None,
                 expert_alignment=1) -> expert_major.NormalSpec:
    buffer.check_alive()
    num_ranks = _checks.num_ranks(op, buffer.axis_name, buffer.num_ranks)
    return expert_major.NormalSpec(
        backend=buffer.backend_impl, num_ranks=num_ranks,
        num_experts=0 if num_experts is None else _checks.num_experts(op, num_experts, num_ranks),
        capacity=0 if capacity is None else _checks.positive(op, "max_recv_tokens", capacity),
        expert_alignment=_checks.positive(op, "expert_alignment", expert_alignment),
    )


def dispatch(
    buffer: Buffer,
    x,
    topk_idx=None,
    topk_weights=None,
    *,
    num_experts: int | None = None,
    max_recv_tokens: int | None = None,
    expert_alignment: int = 1,
    strict: bool | str = False,
    handle: Any = None,
    layout: str = "rank_major",
) -> DispatchResult | ExpertMajorDispatchResult:
    """Sends token `t` to every rank that holds one of its top-k experts (once per rank).

    x: [T, H] floating, or the FP8 pair (x_e4m3 [T, H], scales float32 [T, H/128]), passed through.
    topk_idx: int32 [T, K] global expert ids, -1 for none. topk_weights: optional float32 [T, K].
    max_recv_tokens: the capacity C of the outputs (default R*T, which never drops).
    strict: raise at run time when tokens were dropped or ids were outside [-1, E), the same error on every rank:
    True (a RuntimeError raised from a jax.debug.callback, which JAX reports after XLA's callback-error text) or
    "checkify" (jax.experimental.checkify checks: wrap the jitted function in checkify.checkify and call
    err.throw(), which raises with jax_ep's message first).
    handle: the handle of an earlier dispatch: a cached dispatch of new data along the same routing
    (returns recv_x and the handle; other fields None).
    layout: "rank_major" (rows are received tokens, as above) or "expert_major" (rows are received (token, local
    expert) pairs grouped by expert, docs/design.md "Expert-major layout"; returns ExpertMajorDispatchResult;
    max_recv_tokens then counts pairs, default R*T*min(K, L) + L*(expert_alignment - 1), which never drops).
    """
    _check_buffer("dispatch", buffer)
    if layout not in LAYOUTS:
        raise ValueError(f"jax_ep.dispatch: layout must be one of {LAYOUTS}, got {layout!r}")
    if not any(strict is mode or (isinstance(strict, str) and strict == mode) for mode in STRICT_MODES):
        raise ValueError(f"jax_ep.dispatch: strict must be one of {STRICT_MODES}, got {strict!r}")
    if handle is not None:
        given = [name for name, value in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                                          ("num_experts", num_experts), ("max_recv_tokens", max_recv_tokens))
                 if value is not None] + (["expert_alignment"] if expert_alignment != 1 else []) + \
            (["strict"] if strict else []) + (["layout"] if layout != "rank_major" else [])
        if given:
            raise ValueError(f"jax_ep.dispatch: a cached dispatch (handle=) takes x alone, the routing comes from the "
                             f"handle; got {', '.join(given)} too")
        _check_normal_handle("dispatch", handle)
        spec = _normal_spec("dispatch", buffer, None)
        num_tokens, _ = _checks.payload("dispatch", x)
        if num_tokens != handle_num_tokens(handle):
            raise ValueError(f"jax_ep.dispatch: x has {num_tokens} tokens, the handle routes {handle_num_tokens(handle)}")
        if isinstance(handle, expert_major.ExpertMajorHandle):
            recv_x = _like(x, expert_major.cached_dispatch(spec.backend, _leaves(x), handle))
            return ExpertMajorDispatchResult(recv_x, None, None, None, None, None, None, handle)
        recv_x = _like(x, _cached_dispatch(spec, _leaves(x), handle))
        return DispatchResult(recv_x, None, None, None, None, None, None, handle)
    if topk_idx is None:
        raise ValueError("jax_ep.dispatch: topk_idx is required (or pass handle= for a cached dispatch)")
    num_tokens, _ = _checks.payload("dispatch", x)
    _checks.some_tokens("dispatch", num_tokens)
    num_experts = _given(num_experts, buffer.num_experts)
    if num_experts is None:
        raise ValueError("jax_ep.dispatch: num_experts is required (pass it or set it on the Buffer)")
    spec = _normal_spec("dispatch", buffer, num_experts, None, expert_alignment)
    _checks.topk_idx("dispatch", topk_idx, spec.num_experts, num_tokens)
    _checks.topk_weights("dispatch", topk_weights, topk_idx)
    if max_recv_tokens is not None:
        capacity = _checks.positive("dispatch", "max_recv_tokens", max_recv_tokens)
    elif layout == "expert_major":
        capacity = expert_major.default_capacity(spec.num_ranks, num_tokens, topk_idx.shape[1],
                                                 spec.num_experts // spec.num_ranks, spec.expert_alignment)
    else:
        capacity = spec.num_ranks * num_tokens
    spec = dataclasses.replace(spec, capacity=capacity)
    if layout == "expert_major":
        # Group offsets and pair rows are int32 on every backend: the padded groups must fit them.
        most_rows = max(capacity, expert_major.default_capacity(spec.num_ranks, num_tokens, topk_idx.shape[1],
                                                                spec.num_experts // spec.num_ranks,
                                                                spec.expert_alignment))
        if most_rows > MAX_ROWS:
            raise ValueError(f"jax_ep.dispatch: expert_alignment={spec.expert_alignment} and max_recv_tokens="
                             f"{capacity} let the expert-major rows reach {most_rows}, more than int32 row indices "
                             f"hold ({MAX_ROWS})")
        recv, weights, sizes, offsets, kept, dropped, invalid, em_handle, rows_needed = expert_major.dispatch(
            dataclasses.replace(spec, by_kernels=spec.backend.runs_expert_major_kernels(spec.num_experts,
                                                                                       topk_idx.shape[1])),
            _leaves(x), topk_idx, topk_weights)
        out = ExpertMajorDispatchResult(_like(x, recv), weights, kept, sizes, offsets, dropped, invalid, em_handle)
        what = "received (token, expert) pairs"
    else:
        out = _dispatch(spec, _leaves(x) if _is_fp8_pair(x) else x, topk_idx, topk_weights)
        what, rows_needed = "received tokens", capacity + out.num_dropped
    if strict:
        _raise_on_counts("dispatch", spec.backend, strict, [
            (f"{{n}} {what} did not fit max_recv_tokens={capacity} on rank {{rank}} (it needs max_recv_tokens >= "
             "{need})", out.num_dropped, dict(need=rows_needed)),
            (f"{{n}} top-k ids were outside [-1, {spec.num_experts}) (treated as -1) on rank {{rank}}",
             out.invalid_ids, {}),
        ])
    return out


def handle_num_tokens(handle) -> int:
    """The number of tokens per rank a normal-mode handle routes."""
    if isinstance(handle, expert_major.ExpertMajorHandle):
        return handle.num_tokens
    return handle.is_token_in_rank.shape[0]


def handle_capacity(handle) -> int:
    if isinstance(handle, expert_major.ExpertMajorHandle):
        return handle.capacity
    return handle.recv_src_index.shape[0]


def combine(buffer: Buffer, y, handle, topk_weights=None, bias=None, *, weights=None) -> CombineResult:
    """Brings rows back to their home rank and sums them: out[t] = sum over the ranks r that received t of
    y_r[row of t], unweighted, in float32 in rank order, cast to y's dtype. Padding rows are ignored.
    topk_weights [C, K] float32 are summed the same way; bias [T, H] is added in float32.

    With the handle of an expert-major dispatch, rows are (token, local expert) pairs: each rank first sums a
    token's pairs, weighted by `weights` float32 [C] (e.g. the dispatch's recv_weights; 1 when None), in float32 in
    ascending local expert and rounds that partial to y's dtype, and these partials are summed as above
    (docs/design.md, "Expert-major layout")."""
    _check_buffer("combine", buffer)
    _check_normal_handle("combine", handle)
    spec = _normal_spec("combine", buffer, None)
    capacity, num_tokens = handle_capacity(handle), handle_num_tokens(handle)
    expert_major_handle = isinstance(handle, expert_major.ExpertMajorHandle)
    if expert_major_handle and topk_weights is not None:
        raise ValueError("jax_ep.combine: an expert-major handle takes weights= (float32 [C], the rows' weights), "
                         "not topk_weights")
    if weights is not None and not expert_major_handle:
        raise ValueError("jax_ep.combine: weights= is for the handle of an expert-major dispatch; a rank-major "
                         "combine is unweighted (apply the weights to y first)")
    if weights is not None:
        _checks.exact("combine", "weights", weights, jnp.float32, (capacity,))
    if y.ndim != 2 or y.shape[0] != capacity or not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"jax_ep.combine: y must be floating [{capacity}, hidden] (the dispatch capacity), got "
                        f"{jnp.dtype(y.dtype).name}{list(y.shape)}")
    _checks.hidden("combine", "y", y.shape[1])
    if topk_weights is not None and (topk_weights.ndim != 2 or topk_weights.shape[0] != capacity):
        raise TypeError(f"jax_ep.combine: topk_weights must be float32 [{capacity}, num_topk], got {list(topk_weights.shape)}")
    if topk_weights is not None:
        _checks.exact("combine", "topk_weights", topk_weights, jnp.float32, (capacity, topk_weights.shape[1]))
    if bias is not None and (tuple(bias.shape) != (num_tokens, y.shape[1]) or not jnp.issubdtype(bias.dtype, jnp.floating)):
        raise TypeError(f"jax_ep.combine: bias must be floating [{num_tokens}, {y.shape[1]}], got "
                        f"{jnp.dtype(bias.dtype).name}{list(bias.shape)}")
    if expert_major_handle:
        return CombineResult(expert_major.combine(spec.backend, y, handle, weights, bias), None)
    return _combine(spec, y, handle, topk_weights, bias)


# ---- low latency -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _LowLatencySpec:
    """The Buffer's low-latency sizes, checked, as one op's halves use them (static)."""

    buffer_id: int  # the Buffer a pending half belongs to: its receive half must use the same one
    num_ranks: int
    num_experts: int
    num_max_tokens: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyPending:
    """The in-flight half of a split low-latency op: pass it to the matching `*_recv`."""

    state: Any
    spec: _LowLatencySpec = dataclasses.field(metadata=dict(static=True))
    cast: LowLatencyCast = dataclasses.field(default=LowLatencyCast(), metadata=dict(static=True))
    compression: str | None = dataclasses.field(default=None, metadata=dict(static=True))  # a combine's row format


# Sends of one low-latency op of a Buffer that may await their receive at once (the contract's double buffering;
# the cuda kernels alternate two buffer sets, and a third send would wait for a receive that cannot come first).
MAX_LOW_LATENCY_IN_FLIGHT = 2


class _Eager:
    """The scope of sends made outside any trace (a weakly referenceable key)."""


_EAGER = _Eager()
# trace (or _EAGER) -> {(buffer id, op): the pending sends not yet received, by id}. Weak both ways: a trace that
# ended, or a pending dropped unreceived, stops counting.
_in_flight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_send_order = itertools.count()  # sends numbered in the order they were traced (pending id -> number below)
_send_number: dict[int, int] = {}


def _waiting(op: str, pending: LowLatencyPending) -> weakref.WeakValueDictionary:
    leaf = jax.tree.leaves(pending.state)[0]
    scope = getattr(leaf, "_trace", None) or _EAGER  # the trace being built, for a traced send
    return _in_flight.setdefault(scope, {}).setdefault((pending.spec.buffer_id, op), weakref.WeakValueDictionary())


def _start_send(op: str, pending: LowLatencyPending) -> LowLatencyPending:
    """Counts `pending` among its Buffer's sends of `op` awaiting their receive in this trace; raises past the
    limit, on every backend, while tracing (a program that runs on one backend must not fail on another). A
    best-effort check: sends it cannot see together (e.g. each made inside its own jax.checkpoint) it does not
    count, and the cuda kernels' bounded wait still catches them."""
    waiting = _waiting(op, pending)
    if len(waiting) >= MAX_LOW_LATENCY_IN_FLIGHT:
        raise ValueError(f"jax_ep.{op}_send: {len(waiting)} sends of this Buffer already await their "
                         f"{op}_recv; at most {MAX_LOW_LATENCY_IN_FLIGHT} may (call a receive first)")
    waiting[id(pending)] = pending
    _send_number[id(pending)] = next(_send_order)
    return pending


def _finish_send(op: str, pending: LowLatencyPending) -> None:
    """A receive frees its send's place. A pending that JAX rebuilt (passed through an optimization barrier, or
    into a nested trace such as jax.checkpoint) is another object: then the oldest waiting send of this Buffer and
    op frees its place, in whichever live trace it waits."""
    waiting = _waiting(op, pending)
    if id(pending) in waiting:
        del waiting[id(pending)]
        return
    key = (pending.spec.buffer_id, op)
    tables = [table[key] for table in list(_in_flight.values()) if key in table and len(table[key])]
    entries = [(_send_number.get(send_id, -1), send_id, table) for table in tables for send_id in list(table.keys())]
    if entries:
        _, send_id, table = min(entries, key=lambda entry: entry[0])
        table.pop(send_id, None)


def _low_latency_spec(op: str, buffer: Buffer, num_tokens: int, hidden: int) -> _LowLatencySpec:
    buffer.check_alive()
    num_ranks = _checks.num_ranks(op, buffer.axis_name, buffer.num_ranks)
    missing = [n for n in ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts") if getattr(buffer, n) is None]
    if missing:
        raise ValueError(f"jax_ep.{op}: create the Buffer with {', '.join(missing)} for low-latency ops")
    _checks.some_tokens(op, num_tokens)
    if num_tokens > buffer.num_max_dispatch_tokens_per_rank:
        raise ValueError(f"jax_ep.{op}: {num_tokens} tokens exceed the Buffer's num_max_dispatch_tokens_per_rank="
                         f"{buffer.num_max_dispatch_tokens_per_rank}")
    if hidden != buffer.hidden:
        raise ValueError(f"jax_ep.{op}: hidden {hidden} differs from the Buffer's hidden={buffer.hidden}")
    num_experts = _checks.num_experts(op, buffer.num_experts, num_ranks)
    buffer.backend_impl.check_low_latency(op, num_experts=num_experts)
    return _LowLatencySpec(buffer.buffer_id, num_ranks, num_experts, buffer.num_max_dispatch_tokens_per_rank)


def _masked_entries(op: str, buffer: Buffer, topk_idx, spec: _LowLatencySpec):
    """(mask, topk_idx with its entries naming the experts of ranks this rank masks set to -1, how many), or
    (None, topk_idx, 0) on a Buffer that does not mask ranks (Config.on_timeout; jax_ep.masks)."""
    if buffer.config.on_timeout != "mask":
        return None, topk_idx, jnp.zeros((), jnp.int32)
    masked = buffer.backend_impl.low_latency_mask(op)
    ids, _ = xla.sanitize_ids(topk_idx, spec.num_experts)  # invalid ids stay as they are: counted as invalid
    to_masked = (ids >= 0) & masked[jnp.maximum(ids, 0) // (spec.num_experts // spec.num_ranks)]
    return masked, jnp.where(to_masked, -1, topk_idx), jnp.sum(to_masked, dtype=jnp.int32)


def low_latency_dispatch_send(buffer: Buffer, x, topk_idx, *, use_fp8: bool = True, round_scale: bool = False,
                              use_ue8m0: bool = False, cumulative_local_expert_recv_stats=None) -> LowLatencyPending:
    """Send half of `low_latency_dispatch`; computation can be scheduled before `low_latency_dispatch_recv`.

    At most two sends of one op (dispatch, or combine) of a Buffer may await their receive at once (two
    buffer sets): a third raises a ValueError while tracing, on every backend. Receives may come in any order."""
    op = "low_latency_dispatch"
    _check_buffer(op, buffer)
    if x.ndim != 2:
        raise TypeError(f"jax_ep.{op}: x must be bfloat16 [num_tokens, hidden], got {_checks._desc(x)}")
    _checks.exact(op, "x", x, jnp.bfloat16, x.shape)
    spec = _low_latency_spec(op, buffer, x.shape[0], x.shape[1])
    _checks.topk_idx(op, topk_idx, spec.num_experts, x.shape[0])
    if use_ue8m0 and not round_scale:
        raise ValueError(f"jax_ep.{op}: use_ue8m0=True needs round_scale=True")
    if use_fp8:
        _checks.fp8_groups(op, x.shape[1], use_ue8m0)
    if cumulative_local_expert_recv_stats is not None:
        _checks.exact(op, "cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, jnp.int32,
                      (spec.num_experts // spec.num_ranks,))
    cast = LowLatencyCast(bool(use_fp8), bool(use_fp8 and round_scale), bool(use_fp8 and use_ue8m0))
    masked, sent_idx, num_masked = _masked_entries(op, buffer, topk_idx, spec)
    state = buffer.backend_impl.low_latency_dispatch_send(x, sent_idx, num_experts=spec.num_experts,
                                                          num_max_tokens=spec.num_max_tokens, cast=cast)
    return _start_send(op, LowLatencyPending((state, cumulative_local_expert_recv_stats, masked, num_masked), spec,
                                             cast))


def _check_pending(op: str, buffer: Buffer, pending: LowLatencyPending) -> None:
    _check_buffer(op, buffer)
    buffer.check_alive()
    if not isinstance(pending, LowLatencyPending) or pending.spec.buffer_id != buffer.buffer_id:
        raise ValueError(f"jax_ep.{op}: pass the LowLatencyPending that the send half returned for this Buffer")


def low_latency_dispatch_recv(buffer: Buffer, pending: LowLatencyPending) -> LowLatencyDispatchResult:
    """Receive half of `low_latency_dispatch`."""
    _check_pending("low_latency_dispatch_recv", buffer, pending)
    _finish_send("low_latency_dispatch", pending)
    state, stats, masked, num_masked = pending.state
    recv, recv_count, handle, invalid = buffer.backend_impl.low_latency_dispatch_recv(
        state, num_experts=pending.spec.num_experts, num_max_tokens=pending.spec.num_max_tokens, cast=pending.cast,
        masked=masked)
    stats = None if stats is None else stats + recv_count
    return LowLatencyDispatchResult(tuple(recv) if pending.cast.use_fp8 else recv[0], recv_count, handle, stats,
                                    invalid, num_masked)


def low_latency_dispatch(buffer: Buffer, x, topk_idx, *, use_fp8: bool = True, round_scale: bool = False,
                         use_ue8m0: bool = False, cumulative_local_expert_recv_stats=None) -> LowLatencyDispatchResult:
    """Decode-time dispatch: each local expert receives its tokens packed by (source rank, source token).

    x: bfloat16 [T, H] with T <= the Buffer's num_max_dispatch_tokens_per_rank (M). Returns recv_x
    [L, R*M, H] (BF16, or with use_fp8 the pair (e4m3, scales)), recv_count [L], the handle for combine and,
    when given, the statistics plus this call's counts."""
    pending = low_latency_dispatch_send(buffer, x, topk_idx, use_fp8=use_fp8, round_scale=round_scale,
                                        use_ue8m0=use_ue8m0,
                                        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats)
    return low_latency_dispatch_recv(buffer, pending)


COMBINE_COMPRESSIONS = (None, *xla.COMBINE_CODECS)


def low_latency_combine_send(buffer: Buffer, y, topk_idx, topk_weights, handle: LowLatencyHandle, *,
                             compression: str | None = None) -> LowLatencyPending:
    """Send half of `low_latency_combine`."""
    op = "low_latency_combine"
    _check_buffer(op, buffer)
    spec = _low_latency_spec(op, buffer, topk_idx.shape[0], y.shape[-1])
    if compression not in COMBINE_COMPRESSIONS:
        raise ValueError(f"jax_ep.{op}: compression must be one of {COMBINE_COMPRESSIONS}, got {compression!r}")
    experts_per_rank = spec.num_experts // spec.num_ranks
    _checks.exact(op, "y", y, jnp.bfloat16, (experts_per_rank, spec.num_ranks * spec.num_max_tokens, buffer.hidden))
    _checks.topk_idx(op, topk_idx, spec.num_experts)
    _checks.exact(op, "topk_weights", topk_weights, jnp.float32, topk_idx.shape)
    if not (hasattr(handle, "src_token_index") and hasattr(handle, "num_tokens")):
        raise TypeError(f"jax_ep.{op}: handle must be the handle of a jax_ep.low_latency_dispatch "
                        f"(LowLatencyDispatchResult.handle), got {type(handle).__name__}")
    _checks.exact(op, "handle.src_token_index", handle.src_token_index, jnp.int32, y.shape[:2])
    if topk_idx.shape[0] != handle.num_tokens:
        raise ValueError(f"jax_ep.{op}: topk_idx has {topk_idx.shape[0]} tokens, the handle's low_latency_dispatch "
                         f"sent {handle.num_tokens} (combine takes the dispatch's tokens)")
    # Entries naming a masked rank's experts add nothing: -1 to the backend (their weights get no gradient).
    masked, summed_idx, _ = _masked_entries(op, buffer, topk_idx, spec)
    state = buffer.backend_impl.low_latency_combine_send(y, handle, summed_idx, topk_weights,
                                                         num_experts=spec.num_experts,
                                                         num_max_tokens=spec.num_max_tokens, compression=compression,
                                                         masked=masked)
    return _start_send(op, LowLatencyPending(state, spec, compression=compression))


def low_latency_combine_recv(buffer: Buffer, pending: LowLatencyPending):
    """Receive half of `low_latency_combine`: bfloat16 [T, H]."""
    _check_pending("low_latency_combine_recv", buffer, pending)
    _finish_send("low_latency_combine", pending)
    return buffer.backend_impl.low_latency_combine_recv(pending.state, num_experts=pending.spec.num_experts,
                                                        num_max_tokens=pending.spec.num_max_tokens,
                                                        compression=pending.compression)


def low_latency_combine(buffer: Buffer, y, topk_idx, topk_weights, handle: LowLatencyHandle, *,
                        compression: str | None = None):
    """out[t] = sum_k topk_weights[t, k] * (expert k's output row for t), float32 in k order, bfloat16 [T, H].

    compression="logfmt": the expert rows travel LogFMT-encoded (jax_ep.logfmt: 10 bits per value, 64 % of the
    bfloat16 bytes; each row value within a relative 2^(s/2) - 1 of its own, s its block's step, at most 2.2 %)
    and are decoded to float32 before the sum, on every backend and transport. It saves bytes on the wire and
    costs encoding time: worth it where the link bounds the combine (between nodes)."""
    return low_latency_combine_recv(buffer, low_latency_combine_send(buffer, y, topk_idx, topk_weights, handle,
                                                                     compression=compression))
