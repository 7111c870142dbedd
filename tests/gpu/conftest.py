"""GPU tests: marked `gpu`, skipped where there are fewer than 2 CUDA GPUs."""
import os

import jax
import pytest

_HERE = os.path.dirname(__file__)


def cuda_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    gpus = len(cuda_devices())
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.gpu)
            if gpus < 2:
                item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {gpus}"))
