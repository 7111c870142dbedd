"""Bad-input checks (docs/design.md, "Bad input"): clear errors naming the argument and the expected value,
raised while tracing, before anything runs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.config import FP8_GROUP, HIDDEN_ALIGNMENT


def _desc(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def num_ranks(op: str, axis_name: str, buffer_ranks: int) -> int:
    """The EP axis size (checked against the Buffer's), or an error explaining that the op belongs inside
    shard_map over that axis."""
    try:
        size = int(jax.lax.axis_size(axis_name))
    except (NameError, KeyError, ValueError) as err:
        raise ValueError(
            f"jax_ep.{op}: call it inside jax.shard_map over the Buffer's axis {axis_name!r} ({err})"
        ) from None
    if size != buffer_ranks:
        raise ValueError(f"jax_ep.{op}: the shard_map axis {axis_name!r} has {size} ranks, the Buffer was made "
                         f"for {buffer_ranks}")
    return size


def topk_idx(op: str, idx, num_experts: int, num_tokens: int | None = None) -> None:
    if idx.ndim != 2 or idx.dtype != jnp.int32 or idx.shape[1] < 1:
        raise TypeError(f"jax_ep.{op}: topk_idx must be int32 [num_tokens, num_topk >= 1], got {_desc(idx)}")
    if num_tokens is not None and idx.shape[0] != num_tokens:
        raise ValueError(f"jax_ep.{op}: topk_idx has {idx.shape[0]} tokens, x has {num_tokens}")
    if not isinstance(idx, jax.core.Tracer):  # concrete values can be checked before launch
        values = np.asarray(idx)
        bad = values[(values < -1) | (values >= num_experts)]
        if bad.size:
            raise ValueError(f"jax_ep.{op}: topk_idx holds ids outside [-1, {num_experts}): {bad[:8].tolist()}")


def topk_weights(op: str, weights, idx) -> None:
    if weights is None:
        return
    if weights.dtype != jnp.float32 or weights.shape != idx.shape:
        raise TypeError(f"jax_ep.{op}: topk_weights must be float32 {list(idx.shape)} like topk_idx, got {_desc(weights)}")


def num_experts(op: str, value, num_ranks: int) -> int:
    if value is None:
        raise ValueError(f"jax_ep.{op}: num_experts is required (pass it or set it on the Buffer)")
    if not is_int(value):
        raise TypeError(f"jax_ep.{op}: num_experts must be an integer, got {value!r} ({type(value).__name__})")
    if value <= 0 or value % num_ranks:
        raise ValueError(f"jax_ep.{op}: num_experts must be a positive multiple of the {num_ranks} EP ranks, got {value}")
    return int(value)


def hidden(op: str, name: str, h: int) -> None:
    if h <= 0 or h % HIDDEN_ALIGNMENT:
        raise ValueError(f"jax_ep.{op}: {name} hidden size must be a positive multiple of {HIDDEN_ALIGNMENT}, got {h}")


def payload(op: str, x) -> tuple[int, int]:
    """x [T, H] floating, or the FP8 pair (e4m3 [T, H], float32 scales [T, H/128]); returns (T, H)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"jax_ep.{op}: an FP8 x is the pair (x_e4m3, scales), got {len(x)} arrays")
        values, scales = x
        if values.ndim != 2 or values.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"jax_ep.{op}: x_e4m3 must be float8_e4m3fn [T, H], got {_desc(values)}")
        hidden(op, "x", values.shape[1])
        expected = (values.shape[0], values.shape[1] // FP8_GROUP)
        if scales.dtype != jnp.float32 or scales.shape != expected:
            raise TypeError(f"jax_ep.{op}: FP8 scales must be float32 {list(expected)}, got {_desc(scales)}")
        return values.shape
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jax_ep.{op}: x must be a floating [num_tokens, hidden] array, got {_desc(x)}")
    hidden(op, "x", x.shape[1])
    return x.shape


def positive(op: str, name: str, value) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"jax_ep.{op}: {name} must be a positive integer, got {value}")
    return int(value)


def exact(op: str, name: str, array, dtype, shape) -> None:
    if array.dtype != jnp.dtype(dtype) or tuple(array.shape) != tuple(shape):
        raise TypeError(f"jax_ep.{op}: {name} must be {jnp.dtype(dtype).name}{list(shape)}, got {_desc(array)}")


def fp8_groups(op: str, hidden_size: int, use_ue8m0: bool) -> None:
    """FP8 casts need whole 128-channel groups; UE8M0 packs four groups per int32."""
    group = 4 * FP8_GROUP if use_ue8m0 else FP8_GROUP
    if hidden_size % group:
        what = "use_ue8m0=True (four 128-channel scales per int32)" if use_ue8m0 else "an FP8 cast"
        raise ValueError(f"jax_ep.{op}: {what} needs hidden to be a multiple of {group}, got {hidden_size}")


def some_tokens(op: str, num_tokens: int) -> None:
    """T is static and equal on all ranks, so T = 0 means no tokens anywhere; XLA's sharding pass also rejects
    a shard_map whose operands are all empty (jax 0.11)."""
    if num_tokens < 1:
        raise ValueError(f"jax_ep.{op}: {op} needs at least one token per rank, got {num_tokens}")
