"""What the intranode and internode normal-mode kernels share on the Python side: the attributes every call
carries, the dispatch FFI calls of both layouts (their operands and the results every dispatch kernel writes), the
types the combine kernels read and write, the expert-major methods around each mode's combine calls, and the
limits."""
from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

from jax_ep import _native
from jax_ep.backends.cuda import runtime
from jax_ep.backends.xla import XlaHandle

# Top-k entries per token of a normal-mode dispatch (csrc/kernel_limits.h): one warp lane each.
MAX_TOPK = _native.limit("normal_max_topk")
# Experts of an expert-major dispatch that the expert-major kernels take (more: the composed path).
MAX_EXPERT_MAJOR_EXPERTS = _native.limit("expert_major_max_experts")
# jax_ep's side streams per device (xla_ffi/side_streams.cc), and the target that makes XLA's stream wait for one.
MAX_SIDE_STREAMS = _native.limit("max_side_streams")
JOIN_TARGET = _native.target("side_stream_join")
# Row types the combine kernels read directly.
KERNEL_FLOAT_TYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

int32 = jnp.int32


def kernel_attributes(buffer_id: int, config) -> dict:
    """The FFI attributes of every normal-mode call: the Buffer's id in the native runtime, the SMs its kernel
    occupies and the bound on its waits."""
    return dict(buffer_id=np.int64(buffer_id), num_sms=np.int64(config.num_sms),
                timeout_ns=np.int64(runtime.timeout_ns(config)))


class SideStreamCalls:
    """The normal-mode calls traced inside one side_stream(index): their operands and results, which join() keeps
    alive and waits for, and their Buffers."""

    def __init__(self, index: int):
        self.index = index
        self.operands: list = []
        self.results: list = []
        self.buffer_ids: set[int] = set()


# The calls being traced onto a side stream (None: XLA's stream); set by side_stream().
_side_stream_calls = contextvars.ContextVar("jax_ep_side_stream_calls", default=None)
# The Buffers (ids) whose side calls an overlap has started and not yet joined, while its compute is traced.
_started_buffers = contextvars.ContextVar("jax_ep_started_buffers", default=frozenset())


def call(target: str, result_types, *operands, attributes: dict):
    """The FFI call of normal-mode target `target` on XLA's stream, or, traced inside side_stream(), its twin's on
    jax_ep's side stream (docs/design.md, "Side streams"), noted for join()."""
    calls = _side_stream_calls.get()
    buffer_id = int(attributes["buffer_id"])
    if calls is None:
        if buffer_id in _started_buffers.get():
            raise ValueError("jax_ep overlap: the compute calls an op of the Buffer whose ops the start left running "
                             "on a side stream; both would take the same call of that Buffer. Call it after the "
                             "overlap, or on another Buffer")
        return jax.ffi.ffi_call(target, result_types)(*operands, **attributes)
    results = jax.ffi.ffi_call(_native.side_stream_twin(target), result_types)(
        *operands, **attributes, side_stream=np.int64(calls.index))
    calls.operands += jax.tree.leaves(operands)
    calls.results += jax.tree.leaves(results)
    calls.buffer_ids.add(buffer_id)
    return results


@contextlib.contextmanager
def side_stream(index: int = 1):
    """Inside, the cuda backend's normal-mode kernel calls traced launch on jax_ep's side stream `index` (1 to
    MAX_SIDE_STREAMS) of their device once XLA's stream has reached them, and return at once. Yields the calls'
    SideStreamCalls; `overlap` is the way to use it (their results are not written, and their operands still read,
    until a join)."""
    if not 1 <= index <= MAX_SIDE_STREAMS:
        raise ValueError(f"jax_ep side_stream: index must be 1 to {MAX_SIDE_STREAMS}, got {index}")
    calls = SideStreamCalls(index)
    token = _side_stream_calls.set(calls)
    try:
        yield calls
    finally:
        _side_stream_calls.reset(token)


def _is_side_call(eqn) -> bool:
    return eqn.primitive.name == "ffi_call" and _native.is_side_stream_twin(eqn.params["target_name"])


def _has_side_calls_inside(eqn) -> bool:
    """Whether a side-stream call is traced in a body of `eqn` (a nested jit, custom_vjp, control flow)."""
    return any(_is_side_call(inner) or _has_side_calls_inside(inner)
               for jaxpr in jax_core.jaxprs_in_params(eqn.params) for inner in jaxpr.eqns)


def check_start(start, start_args, index: int) -> None:
    """Refuses a `start` that does more than make the cuda backend's calls and return their results. An XLA op that
    reads one of their results would run on XLA's stream before the side stream writes it; a call inside a nested
    jit (or any function with a body of its own: custom_vjp, control flow) would stay in that function's cache with
    its side stream, for callers outside an overlap too (jit's cache does not see the side-stream context)."""
    with side_stream(index):
        jaxpr = jax.make_jaxpr(start)(*start_args).jaxpr
    written_on_side = set()
    for eqn in jaxpr.eqns:
        if _is_side_call(eqn):
            written_on_side.update(eqn.outvars)
        elif _has_side_calls_inside(eqn):
            raise ValueError(f"jax_ep overlap: start traces a {eqn.primitive.name} (a nested jit, custom_vjp or "
                             "control flow); make the backend's calls directly in it")
        elif any(isinstance(v, jax_core.Var) and v in written_on_side for v in eqn.invars):
            raise ValueError(f"jax_ep overlap: start computes {eqn.primitive.name} on a result of its side-stream "
                             "calls, which would run before the side stream writes it; do it after the overlap")
    if not written_on_side:
        raise ValueError("jax_ep overlap: start made no call of the cuda backend's normal-mode ops")
    if not all(isinstance(v, jax_core.Var) and v in written_on_side for v in jaxpr.outvars):
        raise ValueError("jax_ep overlap: start must return only results of its side-stream calls, as they are")


def overlap(start, start_args, compute, compute_args, index: int = 1):
    """(start(*start_args), compute(*compute_args)), the first on jax_ep's side stream `index` while XLA runs the
    second (docs/design.md, "Side streams"). `start` may only make the cuda backend's own normal-mode calls
    directly and return their results (check_start refuses anything else); `compute` may not call ops of the
    Buffers that `start` used. Not differentiable. In order: the calls are launched on the side stream once every
    argument of start is ready (they pass through an optimization barrier together); the compute
    follows them (its arguments pass through an optimization barrier with every result and operand of the calls);
    the join makes XLA's stream wait for the side stream and hands back the results in place, holding every other
    result and operand until then, so that XLA reuses none of their memory while a kernel still reads or writes
    it; the compute's results pass through a last barrier with the join's, so that whatever reads them comes
    after the join."""
    check_start(start, start_args, index)
    # Every call after every argument: XLA would otherwise launch a call whose own operands are ready early, beside
    # whatever its stream runs then (a persistent kernel, whose blocks on the SMs the call takes would start only
    # when it ends: measured on two H200s, a grouped matmul 129 us slower).
    start_args = jax.lax.optimization_barrier(start_args)
    with side_stream(index) as calls:
        started = start(*start_args)
    leaves, tree = jax.tree.flatten(started)
    # Each array once among the join's operands (a value twice would make XLA copy it for the aliasing, before
    # the join): the started results first, then the calls' other results and their operands.
    position: dict[int, int] = {}
    side = []
    for array in leaves + calls.results + calls.operands:
        if id(array) not in position:
            position[id(array)] = len(side)
            side.append(array)
    num_results = len({id(leaf) for leaf in leaves})
    compute_args, side = jax.lax.optimization_barrier((compute_args, side))
    token = _started_buffers.set(_started_buffers.get() | calls.buffer_ids)
    try:
        computed = compute(*compute_args)
    finally:
        _started_buffers.reset(token)
    computed, side = jax.lax.optimization_barrier((computed, side))
    # A side effect: XLA must keep the join even where nothing reads what it returns.
    joined = jax.ffi.ffi_call(JOIN_TARGET, [jax.typeof(r) for r in side[:num_results]], has_side_effect=True,
                              input_output_aliases={i: i for i in range(num_results)})(
        *side, side_stream=np.int64(index))
    computed, joined = jax.lax.optimization_barrier((computed, joined))
    return tree.unflatten([joined[position[id(leaf)]] for leaf in leaves]), computed


def row_bytes(leaf) -> int:
    """Bytes of one row (token) of `leaf` [T, ...]."""
    return int(np.prod(leaf.shape[1:], dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def check_dispatch(num_ranks: int, num_tokens: int, num_topk: int) -> None:
    if num_topk > MAX_TOPK:
        raise ValueError(f"jax_ep.dispatch (cuda): at most {MAX_TOPK} top-k entries per token, got {num_topk}")
    if num_ranks * num_tokens >= 2**31 - 1:
        raise ValueError(f"jax_ep.dispatch (cuda): ranks * tokens must fit int32, got {num_ranks} * {num_tokens}")


def _call_dispatch_kernel(target, result_types, x_leaves, topk_idx, topk_weights, attributes, num_experts,
                          expert_alignment):
    """A dispatch kernel's FFI call (either layout, either mode): (the received leaves, the other results)."""
    operands = (*x_leaves, topk_idx) + (() if topk_weights is None else (topk_weights,))
    outs = list(call(target, result_types, *operands, attributes=dict(
        attributes, num_payloads=np.int64(len(x_leaves)), num_experts=np.int64(num_experts),
        expert_alignment=np.int64(expert_alignment))))
    return tuple(outs[:len(x_leaves)]), outs[len(x_leaves):]


def call_dispatch(target: str, x_leaves, topk_idx, topk_weights, handle_types, *, attributes: dict, num_ranks,
                  num_experts, capacity, expert_alignment):
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
    recv_leaves, outs = _call_dispatch_kernel(target, result_types, x_leaves, topk_idx, topk_weights, attributes,
                                              num_experts, expert_alignment)
    recv_topk_idx = outs.pop(0)
    recv_topk_weights = None if topk_weights is None else outs.pop(0)
    common, extra = outs[:6], outs[6:]
    return (recv_leaves, recv_topk_idx, recv_topk_weights, *common), tuple(extra)


def call_expert_major_dispatch(target: str, x_leaves, topk_idx, topk_weights, handle_types, *, attributes: dict,
                               num_ranks, num_experts, capacity, expert_alignment, num_sms):
    """The expert-major dispatch FFI call (intranode or internode kernels): its operands, the results every
    expert-major dispatch kernel writes and then results of `handle_types` ((shape, dtype) pairs). Returns (recv
    leaves, recv_weights or None, group sizes, offsets, kept, dropped, invalid ids, rows needed, recv_src_index,
    is_token_in_rank, pair_row, topk_row, rows_end, the results of handle_types)."""
    num_tokens, num_topk = topk_idx.shape
    local = num_experts // num_ranks
    aval = jax.typeof(x_leaves[0])

    def result(shape, dtype):
        return aval.update(shape=shape, dtype=dtype)

    items = num_ranks * num_tokens
    result_types = [result((capacity, *leaf.shape[1:]), leaf.dtype) for leaf in x_leaves]
    if topk_weights is not None:
        result_types.append(result((capacity,), jnp.float32))
    result_types += [result((local,), int32), result((local,), int32)]  # group sizes, offsets
    result_types += [result((), int32)] * 4  # kept, dropped, invalid ids, rows needed
    result_types += [result((capacity,), int32), result((num_tokens, num_ranks), jnp.bool_),
                     result((items, min(num_topk, local)), int32), result((items, num_topk), int32),
                     result((1,), int32),  # rows_end ([1]: a handle's arrays all have a leading axis)
                     result((num_sms, num_experts), int32),  # scratch: a row per block
                     *(result(shape, dtype) for shape, dtype in handle_types)]
    recv, outs = _call_dispatch_kernel(target, result_types, x_leaves, topk_idx, topk_weights, attributes,
                                       num_experts, expert_alignment)
    weights = None if topk_weights is None else outs.pop(0)
    common, extra = outs[:11], outs[12:]  # outs[11]: the scratch
    return (recv, weights, *common, tuple(extra))


class ExpertMajorKernels:
    """Backend methods of the expert-major layout (jax_ep.backends.Backend) that both kernel families share: which
    sizes they take, the combine and its backward for any float type, and the backward's call. Each family gives
    `_expert_major_combine_call(y, weights, pair_row, handle, bias, kernel_out)` (y float32, bfloat16 or float16,
    bias and kernel_out as combine_kernel_types gives them) and `_expert_major_combine_backward_operands(d_out, y,
    handle)`: its backward target and the operands before the weights, once it checked the call fits its memory
    (d_out of y's type, rows of whole 16-byte vectors), and names the type of its handles' `rows`,
    `expert_major_rows_type`."""

    expert_major_rows_type: type

    def check_expert_major_handle(self, op: str, handle) -> None:
        """Refuses an expert-major handle of the other kernel family (intranode or internode)."""
        if not isinstance(handle.rows, self.expert_major_rows_type):
            mode = "internode" if self.internode else "intranode"
            raise TypeError(f"jax_ep.{op}: this expert-major handle comes from the other kernel family than this "
                            f"Buffer's ({mode}); pass it to ops of the Buffer whose dispatch made it")

    def runs_expert_major_kernels(self, num_experts, num_topk):
        return self.num_ranks > 1 and num_experts <= MAX_EXPERT_MAJOR_EXPERTS and num_topk <= MAX_TOPK

    def expert_major_combine(self, y, weights, pair_row, handle, *, bias=None, out_dtype=jnp.float32):
        self.check_expert_major_handle("combine", handle)
        if y.dtype not in KERNEL_FLOAT_TYPES:
            # The kernels read float32, bfloat16 and float16 rows. Other types' partials are made here, rounded to
            # y's dtype, and go home as float32 rows (which hold them exactly), each received token's its one pair.
            from jax_ep.expert_major import partial_sums, received_items

            capacity = y.shape[0]
            kept = jnp.where((pair_row >= 0) & (pair_row < capacity), pair_row, capacity)
            partial = partial_sums(y, weights, kept).astype(y.dtype).astype(jnp.float32)
            return self.expert_major_combine(partial, None, received_items(pair_row), handle, bias=bias,
                                             out_dtype=out_dtype)
        y, bias, kernel_out = combine_kernel_types(y, bias, out_dtype)
        return self._expert_major_combine_call(y, weights, pair_row, handle, bias, kernel_out).astype(out_dtype)

    def expert_major_combine_backward(self, d_out, y, weights, handle):
        self.check_expert_major_handle("combine", handle)
        if y.dtype not in KERNEL_FLOAT_TYPES:  # the kernels read float32, bfloat16 and float16 rows
            d_y, d_weights = self.expert_major_combine_backward(d_out.astype(jnp.float32), y.astype(jnp.float32),
                                                                weights, handle)
            return d_y.astype(y.dtype), d_weights
        if row_bytes(y) % 16:  # ops.combine takes hidden sizes that are multiples of 128: never here
            raise ValueError("jax_ep combine backward: y's rows must be whole 16-byte vectors, got "
                             f"{y.shape} {y.dtype}")
        target, operands = self._expert_major_combine_backward_operands(d_out.astype(y.dtype), y, handle)
        aval = jax.typeof(y)
        result_types = [aval.update(shape=y.shape, dtype=y.dtype)]  # d_y, then d_weights with weights
        if weights is not None:
            result_types.append(aval.update(shape=(y.shape[0],), dtype=jnp.float32))
        outs = call(target, result_types, *operands, *(() if weights is None else (weights,)),
                    attributes=dict(self._attributes(), weighted=np.int64(weights is not None)))
        return outs[0], (None if weights is None else outs[1])


def all_gather(backend, x):
    """x [n, ...] of every rank -> [R*n, ...] in rank order, by the backend's cached dispatch along a handle that
    sends every row to every rank (row i of the result: rank i // n's row i % n). One rank: x itself."""
    if backend.num_ranks == 1:
        return x
    rows = backend.num_ranks * x.shape[0]
    # zeros_like: the handle varies over the shard_map axes as x does.
    source = jnp.zeros_like(x, int32, shape=(rows,)) + jnp.arange(rows, dtype=int32)
    everywhere = jnp.ones_like(x, jnp.bool_, shape=(x.shape[0], backend.num_ranks))
    return backend.cached_dispatch(x, XlaHandle(source, everywhere))


def combine_kernel_types(y, bias, out_dtype):
    """(y, bias, the kernel's output dtype) as the combine kernels take them: they read f32/bf16/f16 rows and
    write y's type or f32; other types widen to f32 first, exactly as the float32 sum would (the xla backend's
    semantics), and the caller casts the kernel's output to out_dtype."""
    if y.dtype not in KERNEL_FLOAT_TYPES:
        y = y.astype(jnp.float32)
    if bias is not None and bias.dtype not in (y.dtype, jnp.float32):
        bias = bias.astype(jnp.float32)
    return y, bias, out_dtype if out_dtype in (y.dtype, jnp.float32) else jnp.float32
