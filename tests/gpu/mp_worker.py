"""One process of the one-process-per-GPU GPU tests (test_multiprocess_gpu.py); not a pytest module.

usage: python mp_worker.py MODE PROCESS_ID NUM_PROCESSES PORT GPU [PYTEST ARGS...]

Joins `jax.distributed` on 127.0.0.1:PORT owning GPU GPU only (local_device_ids; the launcher gives process p
GPU p mod n, so processes may share a GPU), so the EP axis of the global mesh has one rank per process and the
cuda backend exchanges CUDA IPC handles through the key-value store. MODE:
  pytest   run pytest with the remaining arguments (every process runs the same tests in the same order:
           each test is one collective program); exits with pytest's code.
  timeout  every process but the last runs a dispatch that the last never joins; prints RAISED when the op
           failed within a bounded time and RECORD lines with the timeout records, then exits without
           teardown (the trapped GPU's context is dead). The last process waits meanwhile; all leave together
           (conftest.leave_together).
  nvshmem  bootstraps NVSHMEM through the key-value store and runs its ring check; prints
           "RING <rank> <value read>".
  ll_third_send  every process runs three low-latency dispatch sends before the first receive
           (test_low_latency.third_send_worker): each third send waits for a credit that never comes and
           times out; prints RAISED and RECORD lines as `timeout` does, then exits without teardown.
The low-latency transport follows $JAX_EP_LL_TRANSPORT, which the launcher sets for the NVSHMEM runs.
  internode_timeout  as timeout, with an internode Buffer (NUM_PROCESSES / 2 ranks per node).
"""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_timeout(process_id: int, num_processes: int, ranks_per_node: int | None = None) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from gpu.conftest import bounded_wait_timeout_s

    R = num_processes
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", backend="cuda", config=jax_ep.Config(timeout_s=bounded_wait_timeout_s()),
                        ranks_per_node=ranks_per_node, num_rdma_bytes=None if ranks_per_node is None else 64 << 20)
    if process_id == R - 1:  # never joins; stays alive (its memory mapped by the others) until they are done
        from gpu.conftest import leave_together

        leave_together(0)
    T, H, K, E = 16, 128, 2, 2 * R
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = rng.integers(0, E, (R * T, K)).astype(np.int32)
    sharding = NamedSharding(mesh, P("ep"))
    x, idx = (jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in (x, idx))
    fn = jax.jit(jax.shard_map(lambda x, idx: jax_ep.dispatch(buf, x, idx, num_experts=E).recv_x, mesh=mesh,
                               in_specs=P("ep"), out_specs=P("ep")))
    from gpu.test_intranode import report_timeout

    report_timeout(lambda: fn(x, idx), buf)


def main(mode: str, process_id: int, num_processes: int, port: int, gpu: int, pytest_args: list[str]) -> int:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, local_device_ids=[gpu], initialization_timeout=120)
    sys.path.insert(0, str(TESTS))
    if mode == "timeout":
        run_timeout(process_id, num_processes)
    if mode == "ll_third_send":
        from gpu.test_low_latency import third_send_worker

        third_send_worker(num_processes)  # exits the process
    if mode == "internode_timeout":
        run_timeout(process_id, num_processes, ranks_per_node=max(num_processes // 2, 1))
    if mode == "nvshmem":
        from jax_ep import nvshmem

        nvshmem.initialize()
        print(f"RING {process_id} {nvshmem.ring_check()}", flush=True)
        from gpu.conftest import leave_together

        leave_together(0)
    import pytest

    code = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(TESTS.parent), *pytest_args])
    sys.stdout.flush()
    from gpu.conftest import leave_together

    leave_together(int(code))


if __name__ == "__main__":
    if len(sys.argv) < 6:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:]))
