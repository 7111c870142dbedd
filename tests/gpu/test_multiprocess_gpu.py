"""The cuda backend with one process per GPU (ARCHITECTURE.md §2): R `jax.distributed` processes on localhost,
each owning one GPU, one global EP mesh; the Buffer maps its peers' memory through CUDA IPC handles exchanged
in the key-value store. Each process runs tests/gpu/test_intranode.py and test_low_latency.py (through
mp_worker.py), so the whole oracle/xla/gradient/determinism suites hold in this process model too; a second test leaves one process out
of a dispatch and checks that the others fail within the timeout, naming the op and the absent rank.
The internode mode runs only in this process model: its suite (test_internode.py) runs as R processes, R=4 as
2 nodes x 2 GPUs (NVSHMEM between the "nodes"), and its bounded-wait test leaves one process out likewise."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu.conftest import cuda_devices

WORKER = Path(__file__).resolve().parent / "mp_worker.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
RANKS = [2, 4]
SUITE_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(mode: str, R: int, extra: list[str], timeout_s: float, tmp_path) -> tuple[list[int | None], list[str]]:
    """Runs R worker processes; returns their exit codes (None: killed at the deadline) and outputs."""
    if len(cuda_devices()) < R:
        pytest.skip(f"needs {R} GPUs")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *sys.path]), PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every process sees every GPU (CUDA IPC between them) and owns one
    procs, logs = [], []
    for pid in range(R):
        log = open(tmp_path / f"{mode}{R}_{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, str(pid), str(R), str(port), *extra],
                                      cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
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
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return codes, outputs


def report(codes, outputs) -> str:
    return "\n".join(f"--- process {p} (exit {c}) ---\n{o[-4000:]}" for p, (c, o) in enumerate(zip(codes, outputs)))


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("suite", ["test_intranode.py", "test_low_latency.py"])
def test_suite_one_process_per_gpu(suite, R, tmp_path):
    codes, outputs = launch("pytest", R, [str(Path(__file__).parent / suite), "-x"], SUITE_TIMEOUT_S, tmp_path)
    assert codes == [0] * R, report(codes, outputs)
    for out in outputs:  # the suite ran (only the tests that start their own single-process worker skip)
        summary = re.search(r"(\d+) passed(?:, (\d+) skipped)?", out)
        assert summary and int(summary.group(1)) >= 25 and int(summary.group(2) or 0) <= 4, report(codes, outputs)


@pytest.mark.parametrize("R", RANKS)
def test_process_that_never_joins_times_out(R, tmp_path):
    """The last process never runs the dispatch: every other one raises within a bounded time, and its record
    names the op, itself and the rank it waited for."""
    codes, outputs = launch("timeout", R, [], 120, tmp_path)
    assert None not in codes[:-1], report(codes, outputs)
    for rank, out in enumerate(outputs[:-1]):
        raised = [line for line in out.splitlines() if line.startswith("RAISED after")]
        assert raised, report(codes, outputs)
        assert float(raised[0].split()[2]) < 60, raised[0]
        records = [line for line in out.splitlines() if line.startswith("RECORD")]
        assert records and f"dispatch timed out on rank {rank}" in records[0], report(codes, outputs)
        assert f"waiting for rank {R - 1} to publish its inputs" in records[0], records[0]


@pytest.mark.parametrize("R", RANKS)
def test_nvshmem_bootstrap_and_puts(R, tmp_path):
    """NVSHMEM starts from a unique id passed through the key-value store, one PE per process, and a device-side
    put reaches the next PE."""
    from jax_ep import nvshmem

    if not nvshmem.available():
        pytest.skip("built without NVSHMEM")
    codes, outputs = launch("nvshmem", R, [], 180, tmp_path)
    assert codes == [0] * R, report(codes, outputs)
    for rank, out in enumerate(outputs):
        assert f"RING {rank} {(rank - 1) % R}" in out, report(codes, outputs)


@pytest.mark.parametrize("R", RANKS)
def test_internode_suite(R, tmp_path):
    """tests/gpu/test_internode.py as R processes: R=4 as 2 nodes x 2 GPUs and 4 x 1, R=2 as 2 x 1."""
    from jax_ep import internode

    if not internode.available():
        pytest.skip("built without NVSHMEM (no internode kernels)")
    codes, outputs = launch("pytest", R, [str(Path(__file__).parent / "test_internode.py"), "-x"], SUITE_TIMEOUT_S,
                            tmp_path)
    assert codes == [0] * R, report(codes, outputs)
    for out in outputs:
        summary = re.search(r"(\d+) passed(?:, (\d+) skipped)?", out)
        assert summary and int(summary.group(1)) >= 28 and summary.group(2) is None, report(codes, outputs)


@pytest.mark.parametrize("R", RANKS)
def test_internode_process_that_never_joins_times_out(R, tmp_path):
    """The last process creates the internode Buffer (R/2 ranks per node) but never runs the dispatch: every
    other one raises within a bounded time with a record naming the op and itself; the absent rank's node peers
    and its peers on the same rail (same local index), which wait for it directly, name it."""
    from jax_ep import internode

    if not internode.available():
        pytest.skip("built without NVSHMEM (no internode kernels)")
    codes, outputs = launch("internode_timeout", R, [], 150, tmp_path)
    assert None not in codes[:-1], report(codes, outputs)
    per_node, absent = max(R // 2, 1), R - 1
    for rank, out in enumerate(outputs[:-1]):
        raised = [line for line in out.splitlines() if line.startswith("RAISED after")]
        assert raised and float(raised[0].split()[2]) < 60, report(codes, outputs)
        records = [line for line in out.splitlines() if line.startswith("RECORD")]
        assert records and f"internode dispatch timed out on rank {rank}" in records[0], report(codes, outputs)
        if rank // per_node == absent // per_node or rank % per_node == absent % per_node:
            assert f"waiting for rank {absent} " in records[0], records[0]
