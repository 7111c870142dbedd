"""FP8 (e4m3) casts with one scale per 128 channels, as the low-latency dispatch and FP8 payloads use."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.config import FP8_GROUP

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # keeps the scale of an all-zero group finite


def per_token_cast_to_fp8(x: jax.Array, *, round_scale: bool = False, use_ue8m0: bool = False):
    """x [..., H] -> (e4m3 [..., H], scales). Per 128 channels: amax = max|x| (at least 1e-4),
    scale = amax * float32(1/448), rounded up to a power of two with `round_scale`; values are x / scale.
    Scales are float32 [..., H/128], or with `use_ue8m0` (needs `round_scale`) the biased exponent bytes
    of the scales packed four per int32 [..., H/512], group 4w+i in byte i (little-endian)."""
    if use_ue8m0 and not round_scale:
        raise ValueError("jax_ep: use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two only)")
    hidden = x.shape[-1]
    group = 4 * FP8_GROUP if use_ue8m0 else FP8_GROUP
    if hidden % group:
        raise ValueError(f"jax_ep.per_token_cast_to_fp8: hidden must be a multiple of {group}, got {hidden}")
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], hidden // FP8_GROUP, FP8_GROUP)
    amax = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), AMAX_FLOOR)
    # Multiply by the float32 reciprocal, as DeepEP does: one rule on every platform (XLA may rewrite a
    # division by a constant into this multiplication on some backends and not on others).
    scale = amax * jnp.float32(1.0 / FP8_MAX)
    if round_scale:
        # 2**ceil(log2(scale)) exactly, from the binary exponent (exp2/log2 are inexact for small scales).
        mantissa, exponent = jnp.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
        scale = jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    x_fp8 = (groups / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(x.shape)
    if not use_ue8m0:
        return x_fp8, scale
    exponent = (jax.lax.bitcast_convert_type(scale, jnp.uint32) >> 23) & 0xFF
    exponent = exponent.reshape(*exponent.shape[:-1], hidden // (4 * FP8_GROUP), 4)
    shifts = jnp.arange(4, dtype=jnp.uint32) * 8
    packed = jnp.sum(exponent << shifts, axis=-1, dtype=jnp.uint32)
    return x_fp8, jax.lax.bitcast_convert_type(packed, jnp.int32)
