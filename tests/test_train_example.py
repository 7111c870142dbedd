"""python -m jax_ep.examples.train_moe, tiny: a few training steps per CPU dispatcher (the loss falls, the
expert-parallel run tracks the dense reference, the plot is written). The block's benchmark is
tests/test_bench_moe.py."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from jax_ep.examples import train_moe  # noqa: E402

TINY = ["--d-model", "128", "--d-ff", "64", "--experts", "8", "--topk", "2"]


def test_training_loss_falls(tmp_path):
    plot = tmp_path / "loss.png"
    losses = train_moe.main(["--steps", "12", "--batch", "16", "--seq", "32", "--layers", "1", "--remat",
                             "--dispatchers", "xla,none", "--plot", str(plot), *TINY])
    assert set(losses) == {"xla", "none"}
    for dispatcher, curve in losses.items():
        assert len(curve) == 12 and np.isfinite(curve).all(), dispatcher
        assert curve[-1] < curve[0] - 1.0, f"{dispatcher}: {curve}"
    # Equal to float32 rounding on CPU; on GPUs float32 matmuls run in TF32, which the two programs round apart.
    np.testing.assert_allclose(losses["xla"], losses["none"], rtol=1e-2)
    assert plot.read_bytes().startswith(b"\x89PNG")

