"""Multi-process test (docs/design.md, "Tests"): 4 `jax.distributed` processes on localhost, 2 virtual CPU
devices each, gloo collectives, one global 8-rank EP mesh. Each process runs tests/worker.py (mode xla_check),
which checks its own shards of dispatch -> (recv_x * 2) -> combine, and of a low-latency dispatch -> combine with
masked ranks set by each process for its own ranks, against the NumPy oracle."""
from __future__ import annotations

from process_harness import launch_processes, report

NUM_PROCESSES = 4
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 180


def test_dispatch_combine_across_processes(tmp_path):
    # conftest.py set XLA_FLAGS for 8 devices in this process; each worker has its own 2.
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}", "JAX_PLATFORMS": "cpu"}
    codes, outputs = launch_processes("xla_check", NUM_PROCESSES, tmp_path, TIMEOUT_S, env_extra=env)
    timed_out = [pid for pid, code in enumerate(codes) if code is None]
    assert not timed_out, (f"processes {timed_out} still ran after {TIMEOUT_S} s and were killed\n"
                           f"{report(codes, outputs)}")
    assert codes == [0] * NUM_PROCESSES, f"a worker failed\n{report(codes, outputs)}"
