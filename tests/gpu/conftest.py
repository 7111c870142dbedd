"""GPU tests: marked `gpu`, skipped where there is no CUDA GPU.

What runs where. Tests whose ranks are the GPUs of one process (one process driving several GPUs through peer
access) need that many GPUs in the process and skip below it (`one_process_gpus`). Every multi-rank suite also
runs as R `jax.distributed` processes through test_multiprocess_gpu.py, process p owning GPU p mod n, so on a
machine with fewer GPUs than ranks the processes share GPUs (CUDA IPC and NVSHMEM work within one device): a
correctness run, not a performance one.
"""
import itertools
import os
import pickle
import time
from pathlib import Path

import jax
import numpy as np
import pytest

_HERE = os.path.dirname(__file__)
# Set by test_multiprocess_gpu.py's launcher: whether its processes share GPUs, and a folder they all see.
RANKS_SHARE_GPUS = os.environ.get("JAX_EP_TEST_SHARED_GPU") == "1"
GATHER_DIR_ENV = "JAX_EP_TEST_GATHER_DIR"
GATHER_TIMEOUT_MS = 300_000
# The bounded-wait tests' timeout, and how much later each further process of a multi-process run times out: on a
# GPU the processes share, contexts trapping at the same moment can leave one process's program never returning
# (seen with 4 processes on one H200), so their traps are spread out.
TIMEOUT_S = 2.0
TIMEOUT_STAGGER_S = 1.0
EXIT_BARRIER_MS = 60_000  # how long a finished process waits for the others before it leaves
EXIT_GRACE_S = 2.0        # how long process 0 outlives the barrier, so that the others are gone first
# XLA's collectives on GPUs are NCCL's, which refuses two ranks on one GPU: with shared GPUs the xla backend cannot
# run across the processes, and the tests compare the cuda backend with the NumPy oracle alone. (strict's agreement
# on the counts goes through the cuda backend's own kernels.)
needs_nccl = pytest.mark.skipif(RANKS_SHARE_GPUS, reason="XLA's collectives (the xla backend's) are NCCL's, which "
                                                         "refuses two ranks on one GPU (this run's ranks share GPUs)")
_gather_calls = itertools.count()


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


def gather_to_every_process(tree):
    """The global arrays of `tree` (sharded over their leading axis) whole, as NumPy arrays, on every process of a
    multi-process run: each process writes its shards to a file in $JAX_EP_TEST_GATHER_DIR (the launcher's
    processes share a host) and reads the others' after a barrier. Not an XLA collective, which NCCL would refuse
    for ranks sharing a GPU."""
    from jax._src import distributed

    call, me = next(_gather_calls), jax.process_index()  # every process gathers the same sequence of trees
    directory = Path(os.environ[GATHER_DIR_ENV])
    leaves, treedef = jax.tree.flatten(tree)
    mine = [[(shard.index, np.asarray(shard.data)) for shard in leaf.addressable_shards] for leaf in leaves]
    written = directory / f"gather{call}_{me}.pkl"
    with open(written.with_suffix(".tmp"), "wb") as f:
        pickle.dump(mine, f)
    written.with_suffix(".tmp").rename(written)
    distributed.global_state.client.wait_at_barrier(f"jax_ep_test_gather{call}", GATHER_TIMEOUT_MS)
    whole = [np.empty(leaf.shape, leaf.dtype) for leaf in leaves]
    for process in range(jax.process_count()):
        with open(directory / f"gather{call}_{process}.pkl", "rb") as f:
            for out, shards in zip(whole, pickle.load(f)):
                for index, data in shards:
                    out[index] = data
    return jax.tree.unflatten(treedef, whole)


def bounded_wait_timeout_s() -> float:
    """The Buffer timeout of this process in the bounded-wait tests."""
    return TIMEOUT_S + jax.process_index() * TIMEOUT_STAGGER_S


def leave_together(code: int) -> None:
    """Ends a process of a multi-process run without jax.distributed's shutdown (a failed peer may never reach
    its barrier, and a trapped GPU context cannot be torn down). A process still running when another one exits
    aborts (the coordination service reports the exit as a crash, and process 0 hosts that service): so the
    processes first meet at a barrier bounded by EXIT_BARRIER_MS, and process 0 leaves last."""
    from jax._src import distributed

    try:
        distributed.global_state.client.wait_at_barrier("jax_ep_test_exit", EXIT_BARRIER_MS)
    except Exception as e:  # noqa: BLE001 -- a peer that failed or hangs: leave anyway, the launcher reports it
        print(f"leave_together: exit barrier: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    if jax.process_index() == 0:
        time.sleep(EXIT_GRACE_S)
    os._exit(code)


def pytest_collection_modifyitems(config, items):
    gpus = len(cuda_devices())
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.gpu)
            if gpus == 0:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))
