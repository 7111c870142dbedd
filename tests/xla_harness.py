"""What the property tests of the public ops on the `xla` backend share (test_ops_xla, test_expert_major, test_grads,
test_layout_ffi): the rank counts, exact comparison and the random routing cases of hypothesis (the mesh, Buffers
and jit(shard_map) of a body are every suite's: conftest.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import oracle as O
from hypothesis import HealthCheck
from hypothesis import strategies as st

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RANKS = [1, 2, 4, 8]


def as_f32(a):
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.kind == "f" or a.dtype in (O.BF16, O.E4M3) else a


def assert_same(actual, expected, what: str):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(as_f32(actual), as_f32(expected), err_msg=what)


@dataclass(frozen=True)
class Case:
    R: int
    T: int
    H: int
    K: int
    E: int
    mode: str
    p_neg: float
    p_invalid: float
    seed: int

    @property
    def L(self) -> int:
        return self.E // self.R

    def rng(self, salt: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, salt])

    def topk_idx(self) -> np.ndarray:
        return O.make_topk_idx(self.rng(1), self.R, self.T, self.K, self.E, self.mode, self.p_neg, self.p_invalid)

    def topk_weights(self) -> np.ndarray:
        return self.rng(2).standard_normal((self.R, self.T, self.K), dtype=np.float32)


@st.composite
def cases(draw, max_T: int = 200, Hs=(128, 256), Ks=(1, 8), max_L: int = 4, p_invalid=(0.0, 0.0, 0.05), min_T: int = 1):
    R = draw(st.sampled_from(RANKS))
    return Case(
        R=R,
        T=draw(st.one_of(st.just(min_T), st.integers(max(min_T, 1), 16), st.integers(17, max_T))),
        H=draw(st.sampled_from(Hs)),
        K=draw(st.integers(*Ks)),
        E=R * draw(st.integers(1, max_L)),
        mode=draw(st.sampled_from(O.ROUTING_MODES)),
        p_neg=draw(st.sampled_from([0.0, 0.2, 0.6])),
        p_invalid=draw(st.sampled_from(p_invalid)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def capacity_for(c: Case, idx, choice: str):
    """A static capacity: default (None), above R*T, exactly the largest need, or below it (drops)."""
    _, need = O.routing(idx, c.E)
    top = int(need.max(initial=0))
    if choice == "default" or c.T == 0:
        return None
    if choice == "over":
        return c.R * c.T + 3
    if choice == "exact":
        return max(top, 1)
    return max(top // 2, 1) if choice == "half" else max(top - 1, 1)
