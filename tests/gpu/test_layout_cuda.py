"""The CUDA layout kernel (FFI target jax_ep_layout on the CUDA platform) against the NumPy oracle, on the GPUs of
one process (one rank per GPU; the kernel is local to each rank, so one GPU covers it with R=1)."""
import jax
import numpy as np
import oracle
import pytest
from conftest import mesh_of
from jax.sharding import PartitionSpec as P

import jax_ep


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
@pytest.mark.parametrize("num_tokens,num_topk,num_experts,mode", [
    (0, 8, 256, "uniform"), (1, 1, 8, "uniform"), (4096, 8, 256, "distinct"), (777, 6, 64, "dense_dups"),
    (300, 8, 32, "skewed"), (513, 4, 16, "one_rank"),
])
def test_cuda_layout_matches_oracle(num_ranks, num_tokens, num_topk, num_experts, mode):
    mesh = mesh_of(num_ranks)
    assert jax_ep._native.has_target("jax_ep_layout", "cuda"), "extension built without the CUDA layout kernel"
    buffer = jax_ep.Buffer(mesh, "ep")
    rng = np.random.default_rng(num_tokens * 31 + num_experts)
    idx = oracle.make_topk_idx(rng, num_ranks, num_tokens, num_topk, num_experts, mode, p_invalid=0.02)

    def body(topk_idx):
        lay = jax_ep.get_dispatch_layout(buffer, topk_idx, num_experts)
        return lay.num_tokens_per_rank[None], lay.num_tokens_per_expert[None], lay.is_token_in_rank[None], lay.invalid_ids[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    hlo = run.lower(idx.reshape(num_ranks * num_tokens, num_topk)).as_text()
    assert "jax_ep_layout" in hlo, "the layout did not lower to the FFI custom call"
    per_rank, per_expert, in_rank, invalid = jax.device_get(run(idx.reshape(num_ranks * num_tokens, num_topk)))
    expected = oracle.layout(idx, num_experts)
    np.testing.assert_array_equal(per_rank, expected.num_tokens_per_rank)
    np.testing.assert_array_equal(per_expert, expected.num_tokens_per_expert)
    np.testing.assert_array_equal(in_rank, expected.is_token_in_rank)
    np.testing.assert_array_equal(invalid, expected.invalid_ids)
