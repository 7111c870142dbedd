"""python -m jax_ep.bench soak on CPU, tiny: the steps run, every step's outputs equal the first's bit for bit,
and the JSON holds the memory readings (the figures mean nothing on CPU; the GPU figures are in the issue note)."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jax_ep import bench  # noqa: E402


def test_soak_record(tmp_path):
    path = tmp_path / "soak.json"
    assert bench.main(["soak", "--ranks", "4", "--steps", "30", "--bitwise-steps", "10", "--tokens", "16",
                       "--hidden", "128", "--experts", "8", "--topk", "2", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert (record["num_ranks"], record["steps"], record["bitwise_steps"]) == (4, 30, 10)
    assert record["bitwise_identical"] is True
    assert len(record["device_bytes"]) == 2 and len(record["host_rss_bytes"]) == 2
    assert record["host_rss_bytes"][0] > 0


def test_soak_block_record(tmp_path):
    """--block: the Flax MoE block's training step in two chunks, every step's gradients the first's bits."""
    pytest.importorskip("flax")  # an optional dependency (the test extra has it)
    path = tmp_path / "soak-block.json"
    assert bench.main(["soak", "--block", "--num-chunks", "2", "--dispatcher", "xla", "--ranks", "4", "--steps",
                       "12", "--bitwise-steps", "12", "--tokens", "16", "--hidden", "128", "--d-ff", "64",
                       "--experts", "8", "--topk", "2", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert (record["mode"], record["dispatcher"], record["num_chunks"]) == ("block", "xla", 2)
    assert (record["steps"], record["bitwise_steps"], record["bitwise_identical"]) == (12, 12, True)


def test_block_options_go_with_block():
    with pytest.raises(SystemExit, match="--num-chunks: only with --block"):
        bench.main(["soak", "--num-chunks", "2", "--ranks", "2", "--steps", "1"])


def test_block_refuses_ranks_sharing_a_gpu(capsys):
    """--block with more processes than GPUs stops before launching: the block's step needs XLA's (NCCL's)
    collectives, which refuse two ranks on one GPU (seen on one H200 as "Duplicate GPU detected")."""
    with pytest.raises(SystemExit):
        bench.main(["soak", "--block", "--processes", "2", "--gpus", "1", "--allow-shared-gpu", "--steps", "1"])
    assert "NCCL's, which refuse two ranks on one GPU" in capsys.readouterr().err


def test_comparison_is_per_rank_and_by_bits():
    """soak's comparison: each rank's flag says whether its own shards kept their bits (a change on one rank clears
    that rank's flag only; -0.0 differs from 0.0; a nan equals itself), with replicated leaves compared on every rank."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ep.bench import soak

    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    rows[5, 1] = np.nan

    def tree(rows, scalar):
        return dict(rows=jax.device_put(rows, NamedSharding(mesh, P("ep"))),
                    scalar=jax.device_put(np.float32(scalar), NamedSharding(mesh, P())))

    first = tree(rows, 0.0)
    flags, still_equal = soak._comparison(mesh, first)
    assert np.asarray(still_equal(flags, tree(rows.copy(), 0.0), first)).tolist() == [True] * 4
    changed = rows.copy()
    changed[4, 0] = np.float32(12.000001)  # rank 2's rows are 4 and 5
    assert np.asarray(still_equal(flags, tree(changed, 0.0), first)).tolist() == [True, True, False, True]
    assert np.asarray(still_equal(flags, tree(rows.copy(), -0.0), first)).tolist() == [False] * 4
    cleared = still_equal(flags, tree(changed, 0.0), first)
    assert np.asarray(still_equal(cleared, tree(rows.copy(), 0.0), first)).tolist() == [True, True, False, True]
