"""LogFMT-10 (jax_ep.logfmt) against its NumPy oracle (tests/oracle.py) and its documented error bound: random data,
zeros, huge and tiny values, mixed signs, blocks spanning more octaves than the format keeps, non-finite values; the
bit packing; the sizes."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from jax_ep import logfmt

BF16 = ml_dtypes.bfloat16
roundtrip = jax.jit(lambda x: logfmt.decode(logfmt.encode(x), x.shape[-1]))


def check_within_bound(x: np.ndarray, decoded: np.ndarray) -> tuple[float, float]:
    """Every value kept within a factor 2^(step/2) (relative error 2^(step/2) - 1) or flushed to zero below
    amin * 2^(-step/2), signs kept; returns (max, mean) relative error of the non-zero values."""
    _, step, amin = oracle.logfmt_roundtrip(x)
    v = x.astype(np.float64)
    decoded = decoded.astype(np.float64)
    flushed = (decoded == 0) & (v != 0)
    threshold = np.maximum(amin * np.exp2(-step / 2), oracle.LOGFMT_SMALLEST_NORMAL)
    assert np.all(np.abs(v[flushed]) < threshold[flushed] * (1 + 1e-6))
    kept = ~flushed
    slack = oracle.LOGFMT_FLOAT32_SLACK
    assert np.all(np.abs(decoded[kept] - v[kept]) <= (np.exp2(step[kept] / 2) - 1 + slack) * np.abs(v[kept]))
    assert np.all(np.sign(decoded[kept]) == np.sign(v[kept]))
    nonzero = v != 0
    rel = np.abs(decoded[nonzero] - v[nonzero]) / np.abs(v[nonzero])
    return float(rel.max(initial=0)), float(rel.mean()) if rel.size else 0.0


def run(x: np.ndarray) -> np.ndarray:
    return np.asarray(roundtrip(jnp.asarray(x)))


@pytest.mark.parametrize("shape", [(4, 256), (3, 7168), (2, 5, 128)])
def test_random_rows_within_the_bound_and_like_the_oracle(shape, capsys):
    x = np.random.default_rng(0).standard_normal(shape).astype(BF16)
    decoded = run(x)
    worst, mean = check_within_bound(x, decoded)
    assert worst <= 2.0 ** (16 / 510) - 1  # the format's bound at its widest span (32 octaves)
    expected, step, _ = oracle.logfmt_roundtrip(x)
    # float32 (jax_ep) and float64 (oracle) logarithms may round a value at a code boundary differently: one code.
    assert np.all(np.abs(decoded - expected) <= (np.exp2(step) - 1 + oracle.LOGFMT_FLOAT32_SLACK) * np.abs(expected))
    same_code = np.abs(decoded - expected) <= 1e-5 * np.abs(expected)
    assert np.mean(same_code) > 0.99
    with capsys.disabled():
        print(f"\nLogFMT normal data {shape}: max relative error {worst:.4%}, mean {mean:.4%}")


def test_zeros_encode_to_zero_words_and_decode_to_zero():
    x = np.zeros((2, 256), BF16)
    words = np.asarray(logfmt.encode(jnp.asarray(x)))
    assert words.shape == (2, logfmt.words_per_row(256)) and not words.any()
    assert not run(x).any()


@pytest.mark.parametrize("case", ["huge", "tiny", "subnormal", "mixed signs", "constant", "wide span", "sparse",
                                  "huge exponents", "tiny exponents"])
def test_special_values(case):
    rng = np.random.default_rng(1)
    base = rng.standard_normal((2, 256))
    x = {
        "huge": base * 1e37,                       # near bfloat16's largest finite value, 3.4e38
        "tiny": base * 1e-36,
        "subnormal": base * 1e-39,                 # bfloat16 subnormals
        "mixed signs": np.abs(base) * np.where(rng.random(base.shape) < 0.5, -1, 1),
        "constant": np.full(base.shape, -3.5),     # one magnitude per block: step 0, every value exact
        "wide span": base * np.exp2(rng.integers(-60, 60, base.shape)),  # more than 32 octaves: some flushed
        "sparse": base * (rng.random(base.shape) < 0.05),
        # Exponents far from 0, where float32 logarithms of the values themselves would round coarsely.
        "huge exponents": np.sign(base) * np.exp2(100 + rng.random(base.shape)),
        "tiny exponents": np.sign(base) * np.exp2(-120 + rng.random(base.shape)),
    }[case].astype(BF16)
    decoded = run(x)
    assert np.all(np.isfinite(decoded))
    check_within_bound(x, decoded)
    if case == "constant":
        np.testing.assert_array_equal(decoded, x.astype(np.float32))
    if case == "wide span":
        assert np.any((decoded == 0) & (x != 0)), "values more than 32 octaves below the block's largest flush"
    if case == "sparse":
        np.testing.assert_array_equal(decoded == 0, x == 0)


def test_non_finite_values_poison_only_their_block():
    x = np.random.default_rng(2).standard_normal((3, 384)).astype(BF16)
    x[0, 5] = np.inf
    x[2, 300] = np.nan
    decoded = run(x)
    assert np.all(np.isnan(decoded[0, :128])) and np.all(np.isnan(decoded[2, 256:]))
    finite_blocks = np.ones((3, 3), bool)
    finite_blocks[0, 0] = finite_blocks[2, 2] = False
    mask = np.repeat(finite_blocks, 128, axis=1)
    assert np.all(np.isfinite(decoded[mask]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-2.0 ** 100, 2.0 ** 100, width=32), min_size=128, max_size=128),
       st.integers(-40, 40))
def test_any_block_within_the_bound(values, octave):
    with np.errstate(over="ignore"):  # values scaled past bfloat16's range become inf: the else branch below
        x = (np.asarray(values) * 2.0 ** octave).astype(BF16)[None]
    if np.all(np.isfinite(x.astype(np.float32))):
        check_within_bound(x, run(x))
    else:  # scaled past bfloat16's range
        assert np.all(np.isnan(run(x)))


def test_bit_packing_round_trips_and_places_codes_in_order():
    codes = np.random.default_rng(3).integers(0, 1 << logfmt.CODE_BITS, (5, logfmt.BLOCK)).astype(np.uint32)
    words = np.asarray(logfmt._pack(jnp.asarray(codes)))
    np.testing.assert_array_equal(np.asarray(logfmt._unpack(jnp.asarray(words))), codes)
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    for i in (0, 3, 16, 127):  # code i in bits [10i, 10i + 10)
        assert np.array_equal(bits[:, 10 * i:10 * i + 10] @ (1 << np.arange(10)), codes[:, i])


def test_row_layout_codes_then_scales():
    """A row: every block's 40 code words, block after block, then one (amax, amin) word per block."""
    x = np.zeros((1, 256), BF16)
    x[0, 3], x[0, 200] = 1.5, -0.25  # one value per block: codes 1 (amin = amax), signs 0 and 1
    words = np.asarray(logfmt.encode(jnp.asarray(x)))[0]
    assert words.shape == (2 * 41,)
    code = lambda block, i: (int.from_bytes(words[40 * block:40 * block + 40].astype("<u4").tobytes(), "little")  # noqa: E731
                             >> (10 * i)) & 0x3FF
    assert code(0, 3) == 1 and code(1, 200 - 128) == (1 << 9) | 1
    assert sum(code(0, i) != 0 for i in range(128)) == 1
    scale = [(int(w) & 0xFFFF, int(w) >> 16) for w in words[80:]]
    as_bits = lambda v: int(np.asarray(v, BF16).view(np.uint16))  # noqa: E731
    assert scale == [(as_bits(1.5), as_bits(1.5)), (as_bits(0.25), as_bits(0.25))]


def test_sizes():
    from jax_ep.config import HIDDEN_ALIGNMENT
    assert HIDDEN_ALIGNMENT % logfmt.BLOCK == 0  # every Buffer's rows split into whole blocks
    assert logfmt.words_per_row(7168) == 56 * 41
    assert logfmt.bytes_per_row(7168, compressed=True) == 56 * 164
    assert logfmt.bytes_per_row(7168, compressed=False) == 2 * 7168
    with pytest.raises(ValueError, match="multiple"):
        logfmt.words_per_row(100)
    with pytest.raises(TypeError, match="bfloat16"):
        logfmt.encode(jnp.zeros((1, 128), jnp.float32))
