"""GPU tests: marked `gpu`, skipped where there is no CUDA GPU.

What runs where. Tests whose ranks are the GPUs of one process (one process driving several GPUs through peer
access) need that many GPUs in the process and skip below it (`one_process_gpus`). Every multi-rank suite also
runs as R `jax.distributed` processes through test_multiprocess_gpu.py, process p owning GPU p mod n, so on a
machine with fewer GPUs than ranks the processes share GPUs (CUDA IPC and NVSHMEM work within one device): a
correctness run, not a performance one.
"""
import os

import jax
import pytest

_HERE = os.path.dirname(__file__)


def cuda_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def one_process_gpus(R: int):
    """The first R GPUs of this process's EP mesh; skips, saying where the same ranks run instead, when the
    process has fewer (one process per GPU: jax.devices() are every process's GPUs, R of them)."""
    devices = cuda_devices()
    if len(devices) < R:
        pytest.skip(f"needs {R} GPUs in one process (one process driving {R} GPUs, peer access between them), "
                    f"{len(devices)} present; test_multiprocess_gpu.py runs these ranks as {R} processes")
    return devices[:R]


def pytest_collection_modifyitems(config, items):
    gpus = len(cuda_devices())
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.gpu)
            if gpus == 0:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))
