"""How tests start processes: one launcher per process model, both running tests/worker.py, and what the launched
processes do together.

- run_in_fresh_process: one process driving the devices, started afresh (XLA_FLAGS apply only when a backend
  starts; a bounded wait's trap leaves the CUDA context dead).
- launch_processes: R `jax.distributed` processes on localhost, one per rank or group of ranks (docs/design.md,
  "Tests"): on GPUs process p owns GPU p mod n of the n present, so with fewer GPUs than processes they share
  GPUs (CUDA IPC and NVSHMEM work within one device); on CPU each has the virtual devices its XLA_FLAGS give it
  and gloo collectives.
The launched processes gather results through files (gather_to_every_process: not an XLA collective, which NCCL
would refuse for ranks sharing a GPU) and leave together (leave_together).
"""
from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "worker.py"
# Set by launch_processes: whether its processes share GPUs, and a folder they all see.
SHARED_GPU_ENV = "JAX_EP_TEST_SHARED_GPU"
GATHER_DIR_ENV = "JAX_EP_TEST_GATHER_DIR"
GATHER_TIMEOUT_MS = 300_000
EXIT_BARRIER_MS = 60_000  # how long a finished process waits for the others before it leaves
EXIT_GRACE_S = 2.0        # how long process 0 outlives the barrier, so that the others are gone first
_gather_calls = itertools.count()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(env_extra: dict | None) -> dict[str, str]:
    """This process's environment, the checkout and this process's import path first on PYTHONPATH (jax_ep even
    where it is not installed, and the test helpers), unbuffered output, and `env_extra`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *sys.path]), PYTHONUNBUFFERED="1",
                **(env_extra or {}))


def run_in_fresh_process(mode: str, num_ranks: int, args=(), env_extra: dict | None = None,
                         timeout_s: float = 300) -> subprocess.CompletedProcess:
    """tests/worker.py MODE in a fresh process driving `num_ranks` devices, with `env_extra` added to its
    environment and `args` after `--`; skips the test where this process has fewer devices (so has the new one)."""
    from conftest import mesh_of

    mesh_of(num_ranks)
    return subprocess.run([sys.executable, str(WORKER), mode, "--ranks", str(num_ranks), "--", *args], cwd=REPO_ROOT,
                          env=worker_env(env_extra), capture_output=True, text=True, timeout=timeout_s)


def launch_processes(mode: str, num_processes: int, log_dir: Path, timeout_s: float, args=(),
                     env_extra: dict | None = None, gpus: int = 0) -> tuple[list[int | None], list[str]]:
    """Runs tests/worker.py MODE as `num_processes` jax.distributed processes, with `env_extra` added to their
    environment and `args` after `--`: on `gpus` GPUs (process p owning GPU p mod gpus), or with gpus=0 on CPU
    devices. Returns their exit codes (None: killed at the deadline, `timeout_s` from the start) and outputs; their
    logs stay in `log_dir`."""
    port = free_port()
    gather_dir = log_dir / "gather"
    gather_dir.mkdir(parents=True, exist_ok=True)
    env = worker_env({GATHER_DIR_ENV: str(gather_dir), **(env_extra or {})})
    if gpus:
        env[SHARED_GPU_ENV] = str(int(num_processes > gpus))
        env.pop("CUDA_VISIBLE_DEVICES", None)  # every process sees every GPU (CUDA IPC between them) and owns one
    # stdout and stderr go to separate files, so that a library's log line on stderr never splits a line the
    # worker prints (the tests parse its RECORD and RAISED lines).
    procs, logs = [], []
    for pid in range(num_processes):
        out = open(log_dir / f"{mode}{num_processes}_{pid}.out", "w+")
        err = open(log_dir / f"{mode}{num_processes}_{pid}.err", "w+")
        logs.append((out, err))
        device = ["--gpu", str(pid % gpus)] if gpus else []
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, "--process", str(pid), "--processes",
                                       str(num_processes), "--port", str(port), *device, "--", *args],
                                      cwd=REPO_ROOT, env=env, stdout=out, stderr=err))
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
    outputs = []
    for out, err in logs:
        text = []
        for log in (err, out):  # stdout last: the report shows the tail
            log.seek(0)
            text.append(log.read())
            log.close()
        outputs.append("\n".join(text))
    return codes, outputs


def report(codes, outputs) -> str:
    return "\n".join(f"--- process {p} (exit {c}) ---\n{o[-4000:]}" for p, (c, o) in enumerate(zip(codes, outputs)))


def gather_to_every_process(tree):
    """The global arrays of `tree` (sharded over their leading axis) whole, as NumPy arrays, on every process of a
    multi-process run: each process writes its shards to a file in $JAX_EP_TEST_GATHER_DIR (the launcher's
    processes share a host) and reads the others' after a barrier."""
    import jax
    import numpy as np
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


def leave_together(code: int) -> None:
    """Ends a process of a multi-process run without jax.distributed's shutdown (a failed peer may never reach
    its barrier, and a trapped GPU context cannot be torn down). A process still running when another one exits
    aborts (the coordination service reports the exit as a crash, and process 0 hosts that service): so the
    processes first meet at a barrier bounded by EXIT_BARRIER_MS, and process 0 leaves last."""
    import jax
    from jax._src import distributed

    try:
        distributed.global_state.client.wait_at_barrier("jax_ep_test_exit", EXIT_BARRIER_MS)
    except Exception as e:  # noqa: BLE001 -- a peer that failed or hangs: leave anyway, the launcher reports it
        print(f"leave_together: exit barrier: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    if jax.process_index() == 0:
        time.sleep(EXIT_GRACE_S)
    sys.stdout.flush()
    os._exit(code)
