"""The native CPU FFI layout handler (`jax_ep_layout`, used by get_dispatch_layout on CPU) against the oracle."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402

import numpy as np  # noqa: E402
import oracle as O  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from conftest import buffer, ranks, spmd  # noqa: E402
from xla_harness import RANKS, SETTINGS, Case, assert_same, cases  # noqa: E402

import jax_ep  # noqa: E402

LAYOUT_TARGET = "jax_ep_layout"


def test_layout_target_registered():
    assert jax_ep._native.available(), f"native extension did not load: {jax_ep._native.import_error()}"
    assert jax_ep._native.has_target(LAYOUT_TARGET, "cpu")


@functools.cache
def layout_fn(R: int, E: int):
    buf = buffer(R, "xla")

    def body(idx):
        lay = jax_ep.get_dispatch_layout(buf, idx, num_experts=E)
        return lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank, lay.invalid_ids[None]

    return spmd(R, body)


def check_layout(c: Case, idx: np.ndarray):
    flat_idx = idx.reshape(c.R * c.T, c.K)
    fn = layout_fn(c.R, c.E)
    per_rank, per_expert, in_rank, invalid = fn(flat_idx)
    exp = O.layout(idx, c.E)
    assert_same(ranks(per_rank, c.R), exp.num_tokens_per_rank, "num_tokens_per_rank")
    assert_same(ranks(per_expert, c.R), exp.num_tokens_per_expert, "num_tokens_per_expert")
    assert_same(ranks(in_rank, c.R), exp.is_token_in_rank, "is_token_in_rank")
    assert_same(invalid, exp.invalid_ids, "invalid_ids")
    return fn


def test_layout_lowers_to_ffi_handler():
    """On CPU the layout is the native custom call, not a pure-JAX fallback."""
    R, E = 2, 4
    hlo = layout_fn(R, E).lower(np.zeros((R * 5, 3), np.int32)).as_text()
    assert LAYOUT_TARGET in hlo, "get_dispatch_layout did not lower to the jax_ep_layout custom call"


@settings(max_examples=20, **SETTINGS)
@given(c=cases(max_T=200, p_invalid=(0.0, 0.05, 0.3)))
def test_layout_matches_oracle(c):
    check_layout(c, c.topk_idx())


@pytest.mark.parametrize("R", RANKS)
def test_layout_edges(R):
    E, K = 2 * R, 5
    # T = 0
    check_layout(Case(R, 0, 128, K, E, "uniform", 0.0, 0.0, 0), np.zeros((R, 0, K), np.int32))
    # duplicates: every entry the same expert, counted once per expert and once per rank
    c = Case(R, 7, 128, K, E, "skewed", 0.0, 0.0, 1)
    idx = np.full((R, 7, K), E - 1, np.int32)
    check_layout(c, idx)
    # every kind of invalid id, all -1 rows, and extremes of int32
    idx = np.array([[E, -2, -1, 0, 2**31 - 1], [-(2**31), -1, -1, -1, -1], [E - 1, E + 7, E - 1, -3, 0]], np.int32)
    idx = np.broadcast_to(idx, (R, 3, K)).copy()
    check_layout(Case(R, 3, 128, K, E, "uniform", 0.0, 0.0, 2), idx)
    assert O.layout(idx, E).invalid_ids[0] == 6
