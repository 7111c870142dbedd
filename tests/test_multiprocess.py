"""Multi-process test (docs/design.md, "Tests"): 4 `jax.distributed` processes on localhost, 2 virtual CPU
devices each, gloo collectives, one global 8-rank EP mesh. Each process runs tests/multiprocess_worker.py,
which checks its own shards of dispatch -> (recv_x * 2) -> combine against a NumPy reference."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"
REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_PROCESSES = 4
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # conftest.py set XLA_FLAGS for 8 devices in this process; each worker has its own 2.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_dispatch_combine_across_processes(tmp_path):
    port = _free_port()
    env = _worker_env()
    procs, logs = [], []
    for pid in range(NUM_PROCESSES):
        log = open(tmp_path / f"worker{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(pid), str(NUM_PROCESSES), str(port)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        ))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = []
    try:
        for pid, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                timed_out.append(pid)
    finally:
        for proc in procs:  # stragglers (a hung peer, or leftovers after a failure)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for pid, log in enumerate(logs):
        log.seek(0)
        outputs.append(f"--- process {pid} (exit {procs[pid].returncode}) ---\n{log.read()}")
        log.close()
    report = "\n".join(outputs)
    assert not timed_out, f"processes {timed_out} still ran after {TIMEOUT_S} s and were killed\n{report}"
    assert all(p.returncode == 0 for p in procs), f"a worker failed\n{report}"
