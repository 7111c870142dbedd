"""The cuda backend with one process per rank (docs/design.md, "Process models"): R `jax.distributed` processes on
localhost, process p owning GPU p mod n of the n present, one global EP mesh; the Buffer maps its peers' memory
through CUDA IPC handles exchanged in the key-value store. With fewer GPUs than ranks the processes share GPUs
(CUDA IPC and NVSHMEM work within one device): every suite here runs on a one-GPU machine, for correctness (the
timings of shared GPUs mean nothing). Each process runs tests/gpu/test_intranode.py and test_low_latency.py
(tests/worker.py, mode pytest), so the whole oracle/xla/gradient/determinism suites hold in this process model too,
test_low_latency.py once more with the NVSHMEM low-latency transport forced (JAX_EP_LL_TRANSPORT=nvshmem: the
low-latency regions are NVSHMEM symmetric memory, rows travel as NVSHMEM puts), and both files' jitted loops with
every op captured into CUDA graphs. Bounded waits: one test leaves one process out of a dispatch and checks that
the others fail within the timeout, naming the op and the absent rank; another sends a third low-latency
dispatch before the first receive on every rank (both transports) and checks that each fails within the
timeout, naming the credit wait.
The internode mode runs only in this process model: its suite (test_internode.py) runs as R processes, R=4 as
2 nodes x 2 GPUs and 4 x 1 (NVSHMEM between the "nodes"), R=2 as 2 x 1, and its bounded-wait test leaves one
process out likewise. The low-latency suite runs on internode Buffers too (stores inside a "node", NVSHMEM puts
between nodes): 4 processes as 2 x 2 and 4 x 1, 8 processes as 4 x 2 (where the GPUs' memory holds them), and the
third-send bounded wait on 2 nodes.

Ranks: $JAX_EP_TEST_RANKS (default "2 4"; e.g. "2 4 8"); a rank count whose processes would not fit in the
GPUs' memory (PROCESS_GPU_BYTES each) is skipped. With $JAX_EP_TEST_SUITE_LOG set, each suite appends one line
to that file: its name, R, process 0's pytest summary and skip reasons (tests/gpu/run.sh prints them)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from process_harness import launch_processes, report

from gpu.conftest import cuda_devices, needs_nccl
from gpu.gpu_harness import FORCED_COMMAND_BUFFER_FLAGS, needs_instrumentation, needs_one_process
from jax_ep import environment

pytestmark = pytest.mark.processes
RANKS = [int(r) for r in os.environ.get("JAX_EP_TEST_RANKS", "2 4").split()]
SUITE_TIMEOUT_S = 420
# GPU memory one test process may take (XLA allocating on demand, its Buffers, NVSHMEM's symmetric heap): bounds
# how many processes share a GPU.
PROCESS_GPU_BYTES = 8 << 30
# The environment of the workers with NVSHMEM: no NVLink multicast; XLA allocates on demand, leaving room for
# NVSHMEM's symmetric heap, sized for the suite's Buffers, which live together (jax_ep would size it for the first).
NVSHMEM_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NVSHMEM_SYMMETRIC_SIZE": "2G"}
# ... per low-latency transport of an intranode Buffer.
TRANSPORT_ENV = {
    "peer_stores": {},
    "nvshmem": {"JAX_EP_LL_TRANSPORT": "nvshmem", **NVSHMEM_ENV},
}

# Why a test of the suites may skip when each rank is a process.
SUITE_SKIPS = tuple(mark.kwargs["reason"] for mark in (needs_one_process, needs_nccl, needs_instrumentation))

# The most NVSHMEM PEs seen to start on one GPU (nvidia-nvshmem-cu13 on one H200: 48 processes start, 64 abort inside
# nvshmemx_init_attr before jax_ep allocates anything).
NVSHMEM_MAX_PES_PER_GPU = 48


def internode_env(ranks_per_node: int) -> dict:
    """The workers' environment for the low-latency suite on internode Buffers of `ranks_per_node` ranks per node."""
    return {"JAX_EP_TEST_RANKS_PER_NODE": str(ranks_per_node), **NVSHMEM_ENV}


def needs_nvshmem(transport: str) -> None:
    from jax_ep import nvshmem

    if transport == "nvshmem" and not nvshmem.available():
        pytest.skip("built without NVSHMEM")


def launch(mode: str, R: int, args: list[str], timeout_s: float, tmp_path, env_extra: dict | None = None,
           process_gpu_bytes: int = PROCESS_GPU_BYTES) -> tuple[list[int | None], list[str]]:
    """tests/worker.py MODE as R processes on the GPUs (process_harness.launch_processes), each taking up to
    `process_gpu_bytes` of its GPU: skips where they would not fit in the GPUs' memory."""
    gpus = cuda_devices()
    per_gpu = -(-R // len(gpus))
    memory = (gpus[0].memory_stats() or {}).get("bytes_limit")
    if memory and per_gpu * process_gpu_bytes > memory:
        pytest.skip(f"{R} processes on {len(gpus)} GPUs: {per_gpu} per GPU of {memory / 2**30:.0f} GiB, each may "
                    f"take {process_gpu_bytes / 2**30:.1f} GiB")
    return launch_processes(mode, R, tmp_path, timeout_s, args, env_extra, gpus=len(gpus))


def skipped_tests(output: str) -> list[tuple[int, str]]:
    """(how many, reason) of each line of a pytest run's -rs summary of skipped tests."""
    return [(int(count), reason) for count, reason in re.findall(r"^SKIPPED \[(\d+)\] \S+ (.*)$", output, re.M)]


def suite_summaries(name: str, R: int, codes, outputs) -> list[re.Match | None]:
    """Each process's pytest summary ("N passed, M skipped"); with $JAX_EP_TEST_SUITE_LOG set, appends a line with
    process 0's summary and skip reasons to that file."""
    summaries = [re.search(r"(\d+) passed(?:, (\d+) skipped)?", out) for out in outputs]
    log = os.environ.get("JAX_EP_TEST_SUITE_LOG")
    if log:
        reasons = sorted({reason for _, reason in skipped_tests(outputs[0])})
        result = summaries[0].group(0) if summaries[0] else f"no summary (exit codes {codes})"
        with open(log, "a") as f:
            f.write(f"{name} R={R} ({R} processes): {result}" + "".join(f"\n    skipped: {r}" for r in reasons) + "\n")
    return summaries


def assert_suite_passed(name: str, R: int, codes, outputs, min_passed: int, max_skipped: int = 0,
                        allowed_skips: tuple[str, ...] = ()) -> None:
    """Every process exited 0 and passed at least `min_passed` tests; it skipped at most `max_skipped` tests, or
    (with `allowed_skips`) any number, each for one of those reasons."""
    summaries = suite_summaries(name, R, codes, outputs)
    assert codes == [0] * R, report(codes, outputs)
    for summary, output in zip(summaries, outputs):
        assert summary and int(summary.group(1)) >= min_passed, report(codes, outputs)
        if allowed_skips:
            skipped = skipped_tests(output)
            # Every skip has its line (else a change in pytest's output would let any skip through).
            assert sum(count for count, _ in skipped) == int(summary.group(2) or 0), report(codes, outputs)
            unexpected = [reason for _, reason in skipped if reason not in allowed_skips]
            assert not unexpected, f"skipped for reasons not allowed here: {unexpected}\n" + report(codes, outputs)
        else:
            assert int(summary.group(2) or 0) <= max_skipped, report(codes, outputs)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("suite, transport", [("test_intranode.py", "peer_stores"),
                                              ("test_low_latency.py", "peer_stores"),
                                              ("test_low_latency.py", "nvshmem")])
def test_suite_one_process_per_gpu(suite, transport, R, tmp_path):
    """The suite in every process; the low-latency suite on each transport (its first test checks that its
    Buffers use the transport asked for)."""
    needs_nvshmem(transport)
    codes, outputs = launch("pytest", R, [str(Path(__file__).parent / suite), "-x"], SUITE_TIMEOUT_S, tmp_path,
                            TRANSPORT_ENV[transport])
    # The suite ran: only the tests of one process driving the GPUs skip (their counterparts are in this file) and,
    # with shared GPUs, those that need XLA's collectives across the processes (NCCL, see needs_nccl: the one that
    # mixes the backends' handles in one program).
    assert_suite_passed(f"{suite} {transport}", R, codes, outputs, min_passed=25, allowed_skips=SUITE_SKIPS)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("method", ["push", "pull"])
def test_jitted_loops_with_forced_command_buffers(method, R, tmp_path):
    """The intranode and low-latency jitted loops with every op captured into CUDA graphs (min graph size 1, loops
    included), the combine pushing or pulling: call numbers, flags and tickets live on the device, so graph
    replay stays in step across processes."""
    files = [str(Path(__file__).parent / f) for f in ("test_intranode.py", "test_low_latency.py")]
    env = {"XLA_FLAGS": FORCED_COMMAND_BUFFER_FLAGS, environment.COMBINE: method}
    codes, outputs = launch("pytest", R, [*files, "-x", "-k", "jitted_loop_default_flags"], SUITE_TIMEOUT_S, tmp_path,
                            env)
    assert_suite_passed(f"jitted loops, forced command buffers, combine {method}", R, codes, outputs, min_passed=2,
                        max_skipped=0)


@pytest.mark.bounded_wait
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


@pytest.mark.bounded_wait
@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("transport", [*TRANSPORT_ENV, "internode"])
def test_low_latency_third_send_times_out(transport, R, tmp_path):
    """Every process sends three low-latency dispatches before the first receive: each third send waits for a
    credit that only that receive gives, so every process fails within a bounded time (its Buffer's timeout
    plus start-up), and its record names the op, itself and the credit wait. On both transports of an intranode
    Buffer, and on an internode Buffer of 2 nodes."""
    needs_nvshmem("nvshmem" if transport == "internode" else transport)
    env = internode_env(max(R // 2, 1)) if transport == "internode" else TRANSPORT_ENV[transport]
    codes, outputs = launch("third_send", R, [], 150, tmp_path, env)
    assert None not in codes, report(codes, outputs)
    for rank, out in enumerate(outputs):
        raised = [line for line in out.splitlines() if line.startswith("RAISED after")]
        assert raised and float(raised[0].split()[2]) < 60, report(codes, outputs)
        records = [line for line in out.splitlines() if line.startswith("RECORD")]
        assert records and f"low_latency_dispatch (send) timed out on rank {rank}" in records[0], report(codes, outputs)
        assert "to finish receiving call 1 (a credit" in records[0], records[0]


@pytest.mark.bounded_wait
@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("transport", [*TRANSPORT_ENV, "internode"])
def test_low_latency_masked_ranks_go_on(transport, R, tmp_path):
    """Config(on_timeout="mask") on the cuda kernels (tests/worker.py masked_ranks_go_on): masks set by hand, a
    reset, the last process away for some steps (the others go on within the bound plus a second, with the
    oracle's results for that rank masked) and back; no process traps, and every result matches the oracle. On
    both transports of an intranode Buffer, and on an internode Buffer of 2 nodes."""
    needs_nvshmem("nvshmem" if transport == "internode" else transport)
    env = internode_env(max(R // 2, 1)) if transport == "internode" else TRANSPORT_ENV[transport]
    codes, outputs = launch("masked_ranks", R, [], 240, tmp_path, env)
    assert codes == [0] * R, report(codes, outputs)
    for out in outputs:  # (a process's exit code says whether its checks passed; its lines say which ran)
        assert sum(line.startswith("MASKED") for line in out.splitlines()) >= 5, out


@pytest.mark.parametrize("R, ranks_per_node", [(4, 2), (4, 1), (8, 2)])
def test_low_latency_internode_suite(R, ranks_per_node, tmp_path):
    """tests/gpu/test_low_latency.py on internode Buffers of R / ranks_per_node nodes: rows, flags and credits go
    by plain stores to the ranks of a node and by NVSHMEM puts and signals to the others (the combine's rows
    through its staging rows)."""
    needs_nvshmem("nvshmem")
    codes, outputs = launch("pytest", R, [str(Path(__file__).parent / "test_low_latency.py"), "-x"], SUITE_TIMEOUT_S,
                            tmp_path, internode_env(ranks_per_node))
    assert_suite_passed(f"test_low_latency.py internode {R // ranks_per_node}x{ranks_per_node}", R, codes, outputs,
                        min_passed=25, allowed_skips=SUITE_SKIPS)


@pytest.mark.many_ranks
@pytest.mark.parametrize("R", [32, 48, 64])
def test_low_latency_internode_many_ranks(R, tmp_path):
    """Up to the most ranks the low-latency kernels take (low_latency.MAX_RANKS, 64), as nodes of 8: dispatch
    (BF16 and every FP8 mode) and combine against the oracle, and the compressed combine, at small shapes (the
    whole suite would not fit a 10-minute run with this many processes on one GPU), with small heaps."""
    from jax_ep.backends.cuda import low_latency

    needs_nvshmem("nvshmem")
    assert R <= low_latency.MAX_RANKS
    per_gpu = -(-R // len(cuda_devices()))
    if per_gpu > NVSHMEM_MAX_PES_PER_GPU:
        pytest.skip(f"{per_gpu} processes on one GPU: NVSHMEM's initialisation aborts above "
                    f"{NVSHMEM_MAX_PES_PER_GPU} PEs per GPU (measured: 64 on one H200 abort, 48 run)")
    tests = "test_buffer_transport_follows_the_setting or test_small_shapes_every_mode"
    env = {**internode_env(8), "NVSHMEM_SYMMETRIC_SIZE": "256M", "NVSHMEM_DEBUG": "WARN"}
    codes, outputs = launch("pytest", R, [str(Path(__file__).parent / "test_low_latency.py"), "-x", "-k", tests],
                            270, tmp_path, env, process_gpu_bytes=3 << 29)
    assert_suite_passed(f"test_low_latency.py internode {R // 8}x8 (two tests)", R, codes, outputs, min_passed=2,
                        max_skipped=0)


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
    from jax_ep.backends.cuda import internode

    if not internode.available():
        pytest.skip("built without NVSHMEM (no internode kernels)")
    codes, outputs = launch("pytest", R, [str(Path(__file__).parent / "test_internode.py"), "-x"], SUITE_TIMEOUT_S,
                            tmp_path)
    # With shared GPUs the two comparisons with the xla backend skip (they need XLA's collectives, NCCL's, which
    # refuse two ranks on one GPU).
    shared = R > len(cuda_devices())
    assert_suite_passed("test_internode.py", R, codes, outputs, min_passed=28,
                        allowed_skips=(needs_nccl.kwargs["reason"],) if shared else ())


@pytest.mark.bounded_wait
@pytest.mark.parametrize("R", RANKS)
def test_internode_process_that_never_joins_times_out(R, tmp_path):
    """The last process creates the internode Buffer (R/2 ranks per node) but never runs the dispatch: every
    other one raises within a bounded time with a record naming the op and itself; the absent rank's node peers
    and its peers on the same rail (same local index), which wait for it directly, name it."""
    from jax_ep.backends.cuda import internode

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
