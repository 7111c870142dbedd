"""LogFMT-10: a 10-bit logarithmic format for bfloat16 rows, the compressed payload of the low-latency combine
(this module for the xla backend and the tests; csrc/logfmt.cuh codes the same format in the cuda kernels).

A row of H bfloat16 values (H a multiple of BLOCK) is cut into blocks of BLOCK consecutive values. Per block:

* magnitudes below 2^-126 (subnormal numbers, which GPU arithmetic flushes to zero) count as zero;
* amax = the largest magnitude, amin = the smallest non-zero magnitude, raised to amax * 2^-MAX_OCTAVES (at least
  2^-126) when it is smaller (both bfloat16, so exact copies of input magnitudes or power-of-two multiples of them);
  step = log2(amax / amin) / (MAX_CODE - 1), in float32 (logarithms of ratios to amin, at most MAX_OCTAVES, keep
  float32's rounding of them small);
* each value x gets a 10-bit code: bit 9 its sign, bits 0-8 a magnitude code q:
  q = 0 for x == 0 and for |x| below amin * 2^(-step / 2) (flushed to zero), else
  q = 1 + round(log2(|x| / amin) / step), clipped to [1, MAX_CODE];
* decoding gives sign * amin * 2^((q - 1) * step) for q > 0 (exactly amin for q = 1 and amax for q = MAX_CODE), 0
  for q == 0 (float32).

Storage of a row of B = H / BLOCK blocks, uint32 words: first each block's 128 codes as a little-endian bit stream of
40 words (code i in bits [10i, 10i + 10)), block after block (B * 40 words: each block's codes start 16-byte
aligned, as the cuda kernels load them), then per block one word holding amax (low 16 bits) and amin (high 16
bits) as bfloat16 bit patterns (B words): WORDS_PER_BLOCK = 41 words, 164 bytes per 128 values (256 as bfloat16:
64 %). An all-zero block is all-zero words.

Error, for a value x of a block whose step is s: a non-zero |x| >= amin * 2^(-s/2) decodes within a factor
2^(s/2) of x (relative error at most 2^(s/2) - 1, plus float32 rounding: at most FLOAT32_SLACK); the
block's step is at most MAX_OCTAVES / (MAX_CODE - 1) = 32/510 octaves, so the relative error is at most 2.2 %, and
far less when a block spans few octaves (normally distributed values: about 12 octaves, 0.8 %). A value flushed to
zero is below max(amin * 2^(-s/2), 2^-126) <= max(amax * 2^-32, 2^-126) in magnitude: values more than 32 octaves
below their block's largest are lost. Signs are kept; zeros decode as +0.
A block holding an infinity or a NaN decodes to NaN everywhere (nothing is dropped silently).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 128               # values per block
CODE_BITS = 10            # bits per value: a sign and MAGNITUDE_BITS
MAGNITUDE_BITS = CODE_BITS - 1
MAX_CODE = (1 << MAGNITUDE_BITS) - 1  # magnitude codes 1 .. MAX_CODE; 0 is zero
MAX_OCTAVES = 32          # a block spans at most this many octaves below its largest magnitude
# Magnitudes below float32's (and bfloat16's) smallest normal number count as zero: GPU arithmetic flushes them.
SMALLEST_NORMAL = 2.0 ** -126
# What float32 arithmetic adds to the format's relative error: exponents (q - 1) * step up to MAX_OCTAVES = 2^5 are
# rounded to 2^-19 (half a unit), a relative 2^-19 * ln 2 in the value, plus exp2's and the product's roundings.
FLOAT32_SLACK = 4e-6
CODE_WORDS = BLOCK * CODE_BITS // 32  # 40 uint32 words of codes per block
WORDS_PER_BLOCK = CODE_WORDS + 1      # and one word of (amax, amin)
_CODES_PER_GROUP = 16     # 16 codes = 160 bits = 5 words: the packing's repeating unit
_WORDS_PER_GROUP = _CODES_PER_GROUP * CODE_BITS // 32


def check_hidden(hidden: int) -> None:
    if hidden % BLOCK:
        raise ValueError(f"LogFMT compresses rows in blocks of {BLOCK} values: hidden {hidden} is not a multiple")


def words_per_row(hidden: int) -> int:
    """uint32 words of one encoded row of `hidden` values."""
    check_hidden(hidden)
    return hidden // BLOCK * WORDS_PER_BLOCK


def bytes_per_row(hidden: int, compressed: bool) -> int:
    """Bytes of one row of `hidden` values: bfloat16, or LogFMT-encoded."""
    return 4 * words_per_row(hidden) if compressed else 2 * hidden


def _block_scale(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(amax, amin) per block of `magnitude` [..., BLOCK] (float32, exact bfloat16 values), as bfloat16."""
    amax = jnp.max(magnitude, axis=-1)
    smallest = jnp.min(jnp.where(magnitude > 0, magnitude, jnp.inf), axis=-1)
    floor = jnp.maximum((amax * 2.0 ** -MAX_OCTAVES).astype(jnp.bfloat16).astype(jnp.float32), SMALLEST_NORMAL)
    amin = jnp.where(amax > 0, jnp.maximum(smallest, floor), 0.0)
    return amax.astype(jnp.bfloat16), amin.astype(jnp.bfloat16)


def _step(amax: jax.Array, amin: jax.Array) -> jax.Array:
    """Octaves between codes, of blocks from their bfloat16 amax and amin, computed alike by encoder and decoder."""
    return jnp.log2(amax.astype(jnp.float32) / amin.astype(jnp.float32)) / (MAX_CODE - 1)


def _pack(codes: jax.Array) -> jax.Array:
    """uint32 codes [..., BLOCK] (CODE_BITS each) -> [..., CODE_WORDS] words, code i in bits [10i, 10i + 10)."""
    groups = codes.reshape(*codes.shape[:-1], BLOCK // _CODES_PER_GROUP, _CODES_PER_GROUP)
    words = [jnp.zeros(groups.shape[:-1], jnp.uint32) for _ in range(_WORDS_PER_GROUP)]
    for i in range(_CODES_PER_GROUP):
        word, shift = divmod(i * CODE_BITS, 32)
        code = groups[..., i]
        words[word] = words[word] | (code << shift)
        if shift + CODE_BITS > 32:  # the code's high bits continue in the next word
            words[word + 1] = words[word + 1] | (code >> (32 - shift))
    return jnp.stack(words, axis=-1).reshape(*codes.shape[:-1], CODE_WORDS)


def _unpack(words: jax.Array) -> jax.Array:
    """Inverse of _pack: [..., CODE_WORDS] -> uint32 codes [..., BLOCK]."""
    groups = words.reshape(*words.shape[:-1], BLOCK // _CODES_PER_GROUP, _WORDS_PER_GROUP)
    codes = []
    for i in range(_CODES_PER_GROUP):
        word, shift = divmod(i * CODE_BITS, 32)
        code = groups[..., word] >> shift
        if shift + CODE_BITS > 32:
            code = code | (groups[..., word + 1] << (32 - shift))
        codes.append(code & ((1 << CODE_BITS) - 1))
    return jnp.stack(codes, axis=-1).reshape(*words.shape[:-1], BLOCK)


def encode(x: jax.Array) -> jax.Array:
    """bfloat16 [..., H] -> uint32 [..., words_per_row(H)] (see the module docstring)."""
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"LogFMT encodes bfloat16 values, got {x.dtype}")
    check_hidden(x.shape[-1])
    lead = x.shape[:-1]
    blocks = x.reshape(*lead, x.shape[-1] // BLOCK, BLOCK).astype(jnp.float32)
    magnitude = jnp.abs(blocks)
    magnitude = jnp.where(magnitude < SMALLEST_NORMAL, 0.0, magnitude)
    amax, amin = _block_scale(magnitude)
    step, amin32 = _step(amax, amin)[..., None], amin.astype(jnp.float32)[..., None]
    # A block of equal magnitudes has step 0: every non-zero value is amin exactly (code 1).
    position = jnp.where(step > 0, jnp.log2(jnp.maximum(magnitude, amin32) / amin32) / jnp.where(step > 0, step, 1.0),
                         0.0)
    magnitude_code = jnp.clip(jnp.round(position), 0, MAX_CODE - 1).astype(jnp.uint32) + 1
    flushed = (magnitude == 0) | (magnitude < amin32 * jnp.exp2(-step / 2))
    magnitude_code = jnp.where(flushed, jnp.uint32(0), magnitude_code)
    sign = (lax.bitcast_convert_type(blocks, jnp.uint32) >> 31) << MAGNITUDE_BITS
    codes = jnp.where(magnitude_code > 0, sign | magnitude_code, jnp.uint32(0))
    # A non-finite block: NaN scale words make every value of the block decode to NaN.
    finite = jnp.all(jnp.isfinite(blocks), axis=-1)
    amax = jnp.where(finite, amax, jnp.bfloat16(jnp.nan))
    scale = (lax.bitcast_convert_type(amax, jnp.uint16).astype(jnp.uint32)
             | (lax.bitcast_convert_type(amin, jnp.uint16).astype(jnp.uint32) << 16))
    return jnp.concatenate([_pack(codes).reshape(*lead, -1), scale], axis=-1)


def decode(words: jax.Array, hidden: int) -> jax.Array:
    """uint32 [..., words_per_row(hidden)] -> float32 [..., hidden]."""
    if words.dtype != jnp.uint32 or words.shape[-1] != words_per_row(hidden):
        raise ValueError(f"LogFMT rows of {hidden} values are uint32 [..., {words_per_row(hidden)}], got "
                         f"{words.dtype} {words.shape}")
    lead, num_blocks = words.shape[:-1], hidden // BLOCK
    codes = _unpack(words[..., :num_blocks * CODE_WORDS].reshape(*lead, num_blocks, CODE_WORDS))
    scale = words[..., num_blocks * CODE_WORDS:]
    amax = lax.bitcast_convert_type((scale & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)
    amin = lax.bitcast_convert_type((scale >> 16).astype(jnp.uint16), jnp.bfloat16)
    step = _step(amax, amin)[..., None]
    amin32 = amin.astype(jnp.float32)[..., None]
    magnitude_code = codes & MAX_CODE
    value = amin32 * jnp.exp2((magnitude_code.astype(jnp.float32) - 1) * step)
    # The ends of the range are amin and amax exactly (float32's exp2(log2(a)) can be off by one unit).
    value = jnp.where(magnitude_code == 1, amin32, value)
    value = jnp.where(magnitude_code == MAX_CODE, amax.astype(jnp.float32)[..., None], value)
    value = jnp.where(magnitude_code > 0, value, 0.0)
    value = jnp.where((codes >> MAGNITUDE_BITS) != 0, -value, value)
    value = jnp.where(jnp.isnan(amax.astype(jnp.float32))[..., None], jnp.nan, value)
    return value.reshape(*lead, hidden)
