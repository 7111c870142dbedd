"""GPU tests: marked `gpu`, skipped where there is no CUDA GPU.

What runs where. Tests whose ranks are the GPUs of one process (one process driving several GPUs through peer
access) need that many GPUs in the process and skip below it (conftest.mesh_of). Every multi-rank suite also
runs as R `jax.distributed` processes through test_multiprocess_gpu.py, process p owning GPU p mod n, so on a
machine with fewer GPUs than ranks the processes share GPUs (CUDA IPC and NVSHMEM work within one device): a
correctness run, not a performance one.

Markers, for choosing what runs together (tests/gpu/run.sh): `processes` (starts R jax.distributed processes),
`bounded_wait` (a rank that waits in vain and traps its GPU context: such tests run one after another, so that no
trap lands beside another test's kernels), `many_ranks` (32 to 64 processes on the GPUs).
"""
import os

import jax
import pytest
from process_harness import SHARED_GPU_ENV

_HERE = os.path.dirname(__file__)
# Set by the multi-process launcher: whether this run's processes share GPUs.
RANKS_SHARE_GPUS = os.environ.get(SHARED_GPU_ENV) == "1"
# XLA's collectives on GPUs are NCCL's, which refuses two ranks on one GPU: with shared GPUs the xla backend cannot
# run across the processes, and the tests compare the cuda backend with the NumPy oracle alone. (strict's agreement
# on the counts goes through the cuda backend's own kernels.)
needs_nccl = pytest.mark.skipif(RANKS_SHARE_GPUS, reason="XLA's collectives (the xla backend's) are NCCL's, which "
                                                         "refuses two ranks on one GPU (this run's ranks share GPUs)")


def cuda_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_configure(config):
    config.addinivalue_line("markers", "processes: starts R jax.distributed processes, one per rank")
    config.addinivalue_line("markers", "bounded_wait: a rank waits in vain and traps its GPU context (run these "
                                       "one after another)")
    config.addinivalue_line("markers", "many_ranks: 32 to 64 processes on the GPUs")


def pytest_collection_modifyitems(config, items):
    gpus = len(cuda_devices())
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.gpu)
            if gpus == 0:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))
