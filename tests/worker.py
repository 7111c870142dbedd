"""The one worker of the tests that start processes (tests/process_harness.py launches it); not a pytest module.

usage: python tests/worker.py MODE --ranks R [-- ARGS...]
       python tests/worker.py MODE --process ID --processes N --port PORT [--gpu GPU] [-- ARGS...]

The first form is one process driving R devices. The second is process ID of N `jax.distributed` processes on
127.0.0.1:PORT, owning GPU GPU only (local_device_ids; the cuda backend exchanges CUDA IPC handles through the
key-value store), or without --gpu the virtual CPU devices its launcher gave it in XLA_FLAGS, with gloo
collectives; its ranks are its devices in the global mesh. MODE:
  pytest      pytest with ARGS (with several processes every one runs the same tests in the same order: each test
              is one collective program); exits with pytest's code.
  xla_check   (CPU processes) dispatch -> (recv_x * 2) -> combine on the xla backend; each process checks the
              shards it holds against the NumPy oracle (same inputs in every process). Exits 0, or 1 naming what
              differed.
  timeout     a dispatch that one rank never joins: in one process only rank 0 runs it, with one process per GPU
              the last process never calls it. Prints RAISED when the op failed within a bounded time and RECORD
              lines with the Buffer's timeout records, then exits without teardown (the trapped GPU's context is
              dead).
  internode_timeout  as timeout (one process per GPU), on an internode Buffer of N / 2 ranks per node.
  third_send  three low-latency dispatch sends before the first receive: each third send waits for a credit that
              never comes and times out; prints RAISED and RECORD lines as timeout does. The transport follows
              $JAX_EP_LL_TRANSPORT and $JAX_EP_TEST_RANKS_PER_NODE, which the launcher sets.
  masked_ranks  (one process per GPU) Config(on_timeout="mask"): masks set by hand, a reset, the last process
              away for some steps and back (masked_ranks_go_on); prints MASKED lines; exits 0, or 1 if any differed.
  nvshmem     (one process per GPU) bootstraps NVSHMEM through the key-value store and runs its ring check;
              prints "RING <rank> <value read>".
With several processes every mode but xla_check (which shuts jax.distributed down) ends in
process_harness.leave_together: no process exits while another still runs (the coordination service would take
that for a crash).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

# The bounded-wait tests' timeout, and how much later each further process of a multi-process run times out: on a
# GPU the processes share, contexts trapping at the same moment can leave one process's program never returning
# (seen with 4 processes on one H200), so their traps are spread out.
TIMEOUT_S = 2.0
TIMEOUT_STAGGER_S = 1.0
# xla_check's shapes: a few tokens per rank, two experts per rank.
CHECK_TOKENS, CHECK_HIDDEN, CHECK_TOPK, CHECK_EXPERTS_PER_RANK, CHECK_SEED = 4, 128, 3, 2, 20240611


def bounded_wait_timeout_s() -> float:
    """The Buffer timeout of this process in the bounded-wait modes."""
    import jax

    return TIMEOUT_S + jax.process_index() * TIMEOUT_STAGGER_S


def report_timeout(run, buf) -> None:
    """Runs `run()`, which should fail: prints RAISED and the time it took, then the Buffer's timeout records;
    exits without teardown (the trapped GPU's context is dead), with one process per rank once every process
    is done."""
    import jax

    from process_harness import leave_together

    start = time.perf_counter()
    try:
        jax.block_until_ready(run())
        print("NO ERROR", flush=True)
    except Exception as err:  # noqa: BLE001 - any XLA runtime error is the expected outcome
        print(f"RAISED after {time.perf_counter() - start:.1f} s: {str(err)[:300]}", flush=True)
    for line in buf.errors():
        print("RECORD", line, flush=True)
    if jax.process_count() > 1:
        leave_together(0)
    os._exit(0)


def rank_zero_alone_times_out(R: int) -> None:
    """One process: rank 0 alone runs a dispatch (see report_timeout)."""
    import jax
    import jax.numpy as jnp
    from conftest import flat, mesh_of, spmd

    import jax_ep
    from gpu.gpu_harness import make_case

    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="cuda", config=jax_ep.Config(timeout_s=bounded_wait_timeout_s()))
    x, idx, _ = make_case(R, 16, 128, 2, 2 * R)

    def body(x, idx):
        # A while loop with a rank-dependent trip count (1 on rank 0, else 0): unlike a cond, XLA cannot turn it
        # into a select that runs the op everywhere; the op's input depends on the carry so it is not hoisted.
        def step(_, total):
            dependent_idx = idx + (total.astype(jnp.float32) * 0).astype(jnp.int32)
            return total + jax_ep.dispatch(buf, x, dependent_idx, num_experts=2 * R).num_recv_tokens

        trips = (jax.lax.axis_index("ep") == 0).astype(jnp.int32)
        return jax.lax.fori_loop(0, trips, step, idx[0, 0] * 0)[None]

    report_timeout(lambda: spmd(R, body)(flat(x), flat(idx)), buf)


def last_process_absent_times_out(R: int, ranks_per_node: int | None = None) -> None:
    """One process per GPU: every process but the last runs a dispatch (see report_timeout); the last creates the
    Buffer and never joins, staying alive (its memory mapped by the others) until they are done."""
    import jax
    from conftest import mesh_of, spmd

    import jax_ep
    from process_harness import leave_together

    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="cuda", config=jax_ep.Config(timeout_s=bounded_wait_timeout_s()),
                        ranks_per_node=ranks_per_node, num_rdma_bytes=None if ranks_per_node is None else 64 << 20)
    if jax.process_index() == R - 1:
        leave_together(0)
    T, H, K, E = 16, 128, 2, 2 * R
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = rng.integers(0, E, (R * T, K)).astype(np.int32)
    fn = spmd(R, lambda x, idx: jax_ep.dispatch(buf, x, idx, num_experts=E).recv_x, gather=False)
    report_timeout(lambda: fn(x, idx), buf)


def third_send_times_out(R: int) -> None:
    """Three low-latency dispatch sends before the first receive, on every rank (see report_timeout)."""
    import jax
    import jax.numpy as jnp
    from conftest import flat, ll_buffer, spmd

    import jax_ep
    from gpu.gpu_harness import make_ll_inputs

    # The ops refuse a third send while tracing; this worker tests what the kernels do if one comes anyway.
    jax_ep.ops.MAX_LOW_LATENCY_IN_FLIGHT = 3
    T, H, K, E, M = 8, 128, 2, 2 * R, 8
    buf = ll_buffer(R, M, H, E, "cuda", timeout_s=bounded_wait_timeout_s())
    x, idx, _, _, _ = make_ll_inputs(R, T, H, K, E, M)

    def body(x, idx):
        sends = [jax_ep.low_latency_dispatch_send(buf, jnp.roll(x, i, axis=0), idx, use_fp8=False) for i in range(3)]
        # Ties the first receive's input to the third send, so XLA cannot run that receive earlier.
        first, _ = jax.lax.optimization_barrier((sends[0], sends[2]))
        return sum(jax_ep.low_latency_dispatch_recv(buf, p).recv_count for p in (first, sends[1], sends[2]))

    report_timeout(lambda: spmd(R, body, gather=False)(flat(x), flat(idx)), buf)


# masked_ranks: steps run while the last process is away, and the bound on the time they may take all together
# (the first waits for the absent rank up to the Buffer's timeout, the others wait for nothing).
MASKED_STEPS, MASKED_STEPS_EXTRA_S = 3, 1.0


def masked_ranks_go_on(process_id: int, R: int) -> int:
    """One process per GPU, a cuda Buffer with Config(on_timeout="mask"); each process checks its ranks' results
    against the NumPy oracle (prints MASKED lines, returns 0 or 1):
    1. ranks 2i and 2i + 1 mask one another by hand: results as the oracle's with those masks, read back by
       masked_ranks (one-sided masks are tested with one process: tests/gpu/test_low_latency.py);
    2. Buffer.reset_low_latency on every process: full results;
    3. the last process stops calling: the others run MASKED_STEPS steps, all within timeout_s + MASKED_STEPS_EXTRA_S,
       each from the second on as the oracle's with the last rank masked (the first masks it by timing out, so its
       dispatch counts no entry as masked); then the last process comes back and runs one step (its waits on the
       others time out: it masks the ranks it waited for, without trapping), every process resets, and one step gives
       full results again."""
    import jax
    import oracle as O
    from conftest import LL_RANKS_PER_NODE, mesh_of, spmd
    from jax._src import distributed

    import jax_ep
    from gpu.gpu_harness import make_ll_inputs

    T, H, K, E, M = 8, 128, 2, 2 * R, 8
    nodes = dict(ranks_per_node=LL_RANKS_PER_NODE, num_rdma_bytes=0) if LL_RANKS_PER_NODE else {}
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="cuda", num_max_dispatch_tokens_per_rank=M, hidden=H, num_experts=E,
                        config=jax_ep.Config(timeout_s=TIMEOUT_S, on_timeout="mask"), num_nvl_bytes=0, **nodes)
    x, idx, w, y, _ = make_ll_inputs(R, T, H, K, E, M)
    me, last = jax.process_index(), R - 1

    def body(x, idx, w, y):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return d.recv_count, d.num_masked[None], jax_ep.low_latency_combine(buf, y, idx, w, d.handle)

    step = spmd(R, body, gather=False)
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731

    def run_and_check(what: str, masked, check_masked_count: bool = True) -> int:
        count, num_masked, out = jax.block_until_ready(step(flat(x), flat(idx), flat(w), flat(y)))
        exp = O.low_latency_dispatch(x, idx, E, M, masked=masked)
        acc, mag = O.low_latency_combine(y, idx, w, E, exp, masked=masked)
        got_count, got_masked = np.asarray(count.addressable_data(0)), int(num_masked.addressable_data(0)[0])
        got = np.asarray(out.addressable_data(0)).astype(np.float32)
        bad = []
        if not np.array_equal(got_count, exp.recv_count[me]):
            bad.append(f"recv_count {got_count.tolist()} want {exp.recv_count[me].tolist()}")
        if check_masked_count and got_masked != exp.num_masked[me]:
            bad.append(f"num_masked {got_masked} want {exp.num_masked[me]}")
        if not np.all(np.abs(got - acc[me]) <= 2.0**-8 * np.abs(acc[me]) * 1.01 + 1e-5 * mag[me] + 1e-30):
            bad.append("combined rows differ")
        print(f"MASKED {what} rank {me}: " + ("ok" if not bad else "; ".join(bad)), flush=True)
        return int(bool(bad))

    failures = run_and_check("unmasked", None)
    hand = np.zeros((R, R), bool)
    for r in range(0, R - 1, 2):  # both ends of each pair: no rank waits for a masked one
        hand[r, r + 1] = hand[r + 1, r] = True
    buf.mask_ranks(np.flatnonzero(hand[me]).tolist())
    failures += run_and_check("by hand", hand)
    seen = set(buf.masked_ranks()[me])
    want = set(np.flatnonzero(hand[me] | hand[:, me]))
    print(f"MASKED read back rank {me}: {sorted(seen)} want {sorted(want)}", flush=True)
    failures += seen != want
    buf.reset_low_latency()
    failures += run_and_check("after reset", None)

    client = distributed.global_state.client
    away = np.zeros((R, R), bool)
    away[:, last] = away[last, :] = True
    np.fill_diagonal(away, False)
    if me != last:
        start = time.monotonic()
        for i in range(MASKED_STEPS):
            failures += run_and_check(f"last rank away, step {i}", away, check_masked_count=i > 0)
        elapsed = time.monotonic() - start
        print(f"MASKED rank {me}: {MASKED_STEPS} steps with the last rank away in {elapsed:.2f} s", flush=True)
        failures += elapsed > TIMEOUT_S + MASKED_STEPS_EXTRA_S
        failures += set(buf.masked_ranks()[me]) != {last}
        client.key_value_set(f"masked_steps_done/{me}", "1")
    else:
        for p in range(last):
            client.blocking_key_value_get(f"masked_steps_done/{p}", 120_000)
        start = time.monotonic()
        jax.block_until_ready(step(flat(x), flat(idx), flat(w), flat(y)))  # every wait on the others times out
        print(f"MASKED rank {me}: back for one step in {time.monotonic() - start:.2f} s, masking "
              f"{sorted(buf.masked_ranks()[me])}", flush=True)
        failures += not set(buf.masked_ranks()[me]) or not set(buf.masked_ranks()[me]) <= set(range(last))
    buf.reset_low_latency()
    failures += run_and_check("after the last rank's return and a reset", None)
    return int(failures > 0)


def check_dispatch_combine_on_xla(process_id: int) -> int:
    """xla_check: returns 0 when every shard this process holds equals the oracle's, else 1 (what differed on
    stderr)."""
    import jax
    import oracle as O
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    devices = jax.devices()
    R, T, K = len(devices), CHECK_TOKENS, CHECK_TOPK
    E = R * CHECK_EXPERTS_PER_RANK
    mesh = Mesh(np.array(devices), ("ep",))
    sharding = NamedSharding(mesh, P("ep"))
    # Global inputs [R*T, ...]: -1 entries, one token routed nowhere, one with both experts on rank 0 (received
    # there once).
    rng = np.random.default_rng(CHECK_SEED)
    x = rng.standard_normal((R * T, CHECK_HIDDEN)).astype(np.float32)
    topk_idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    topk_idx[rng.random((R * T, K)) < 0.25] = -1
    topk_idx[1] = -1
    topk_idx[2] = [0, 1, -1]
    topk_weights = rng.random((R * T, K)).astype(np.float32)

    per_rank = lambda a: a.reshape(R, T, *a.shape[1:])  # noqa: E731
    ref = O.dispatch(per_rank(x), per_rank(topk_idx), per_rank(topk_weights), E)
    combined_x, combined_w = O.combine(np.float32(2) * ref.recv_x[0], ref.routing, ref.recv_topk_weights)
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731 - [R, C, ...] -> [R*C, ...]
    want = dict(recv_x=flat(ref.recv_x[0]), recv_topk_idx=flat(ref.recv_topk_idx),
                recv_topk_weights=flat(ref.recv_topk_weights), num_recv_tokens=ref.num_recv_tokens,
                num_dropped=np.zeros(R, np.int32), invalid_ids=np.zeros(R, np.int32), combined_x=flat(combined_x),
                combined_weights=flat(combined_w))

    buffer = jax_ep.Buffer(mesh, "ep", backend="xla", num_experts=E)

    def body(x, topk_idx, topk_weights):
        out = jax_ep.dispatch(buffer, x, topk_idx, topk_weights, strict=True)
        combined = jax_ep.combine(buffer, out.recv_x * 2, out.handle, topk_weights=out.recv_topk_weights)
        return dict(recv_x=out.recv_x, recv_topk_idx=out.recv_topk_idx, recv_topk_weights=out.recv_topk_weights,
                    num_recv_tokens=out.num_recv_tokens[None], num_dropped=out.num_dropped[None],
                    invalid_ids=out.invalid_ids[None], combined_x=combined.x, combined_weights=combined.topk_weights)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    global_array = lambda v: jax.make_array_from_callback(v.shape, sharding, lambda index: v[index])  # noqa: E731
    got = jax.block_until_ready(step(global_array(x), global_array(topk_idx), global_array(topk_weights)))
    normal = _compare_shards(process_id, "dispatch -> combine", got, want, devices)

    # The low-latency ops with masked ranks (docs/design.md, "Masked ranks"): every even rank masks the next one,
    # each process setting the masks of its own ranks; the masks are asymmetric, so the odd ranks still send.
    M = T
    masked = np.zeros((R, R), bool)
    for r in range(0, R, 2):
        masked[r, (r + 1) % R] = r != (r + 1) % R
    ll_x = rng.standard_normal((R, T, CHECK_HIDDEN)).astype(np.float32).astype(O.BF16)
    ll_idx = per_rank(topk_idx)
    ll_y = rng.standard_normal((R, E // R, R * M, CHECK_HIDDEN)).astype(np.float32).astype(O.BF16)
    exp = O.low_latency_dispatch(ll_x, ll_idx, E, M, masked=masked)
    acc, _ = O.low_latency_combine(ll_y, ll_idx, per_rank(topk_weights), E, exp, masked=masked)
    ll_want = dict(recv_count=flat(exp.recv_count[..., None]), num_masked=exp.num_masked,
                   combined=flat(acc.astype(O.BF16)))
    ll_buffer = jax_ep.Buffer(mesh, "ep", backend="xla", config=jax_ep.Config(on_timeout="mask"),
                              num_max_dispatch_tokens_per_rank=M, hidden=CHECK_HIDDEN, num_experts=E)
    for r in ll_buffer.masked_ranks():  # this process's ranks
        ll_buffer.mask_ranks(np.flatnonzero(masked[r]).tolist(), on=r)

    def ll_body(x, topk_idx, topk_weights, y):
        res = jax_ep.low_latency_dispatch(ll_buffer, x, topk_idx, use_fp8=False)
        return dict(recv_count=res.recv_count[:, None], num_masked=res.num_masked[None],
                    combined=jax_ep.low_latency_combine(ll_buffer, y, topk_idx, topk_weights, res.handle))

    ll_step = jax.jit(jax.shard_map(ll_body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    ll_got = jax.block_until_ready(ll_step(global_array(flat(ll_x)), global_array(topk_idx),
                                           global_array(topk_weights), global_array(flat(ll_y))))
    return max(normal, _compare_shards(process_id, "masked low-latency dispatch -> combine", ll_got, ll_want,
                                       devices))


def _compare_shards(process_id: int, what: str, got: dict, want: dict, devices) -> int:
    """0 when every shard of `got` this process holds equals `want`'s (global arrays), else 1 (what differed on
    stderr)."""
    import jax

    failures, checked = [], 0
    for name, array in got.items():
        for shard in array.addressable_shards:
            expected, actual = want[name][shard.index], np.asarray(shard.data)
            checked += 1
            if actual.dtype != expected.dtype or not np.array_equal(actual, expected):
                bad = np.argwhere(actual != expected)[:4].tolist() if actual.shape == expected.shape else "shape"
                failures.append(
                    f"{name} on rank {devices.index(shard.device)} (device {shard.device}): got "
                    f"{actual.dtype}{list(actual.shape)}, want {expected.dtype}{list(expected.shape)}; first "
                    f"differing positions {bad}\n  got  {actual.ravel()[:8]}\n  want {expected.ravel()[:8]}")
    local = [d.id for d in jax.local_devices()]
    if failures:
        print(f"process {process_id} (devices {local}), {what}: {len(failures)} of {checked} shards differ:",
              file=sys.stderr)
        for line in failures:
            print("  " + line, file=sys.stderr)
        return 1
    print(f"process {process_id} (devices {local}), {what}: all {checked} shards match the oracle")
    return 0


def run_pytest(args: list[str]) -> int:
    import pytest

    code = int(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(TESTS.parent), *args]))
    sys.stdout.flush()
    return code


def one_process(mode: str, num_ranks: int, args: list[str]) -> int:
    if mode == "pytest":
        return run_pytest(args)
    if mode == "timeout":
        rank_zero_alone_times_out(num_ranks)  # exits the process
    if mode == "third_send":
        third_send_times_out(num_ranks)  # exits the process
    raise SystemExit(f"worker: mode {mode} runs with one process per rank only")


def process_of_several(mode: str, process_id: int, num_processes: int, port: int, gpu: int | None,
                       args: list[str]) -> int:
    import jax

    if gpu is None:  # CPU devices: XLA's collectives across processes are gloo's
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120,
                               **({} if gpu is None else dict(local_device_ids=[gpu])))
    if mode == "xla_check":
        try:
            return check_dispatch_combine_on_xla(process_id)
        finally:
            jax.distributed.shutdown()
    from process_harness import leave_together

    R = len(jax.devices())
    if mode == "timeout":
        last_process_absent_times_out(R)
    if mode == "internode_timeout":
        last_process_absent_times_out(R, ranks_per_node=max(R // 2, 1))
    if mode == "third_send":
        third_send_times_out(R)
    if mode == "masked_ranks":
        leave_together(masked_ranks_go_on(process_id, R))
    if mode == "nvshmem":
        from jax_ep import nvshmem

        nvshmem.initialize()
        print(f"RING {process_id} {nvshmem.ring_check()}", flush=True)
        leave_together(0)
    leave_together(run_pytest(args))


def main(argv: list[str]) -> int:
    args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["pytest", "xla_check", "timeout", "internode_timeout", "third_send",
                                         "nvshmem", "masked_ranks"])
    parser.add_argument("--ranks", type=int, help="one process driving this many devices")
    parser.add_argument("--process", type=int, help="this process's index among --processes")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--port", type=int, help="the coordinator's port on 127.0.0.1")
    parser.add_argument("--gpu", type=int, help="the GPU this process owns (none: CPU devices)")
    opts = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if opts.process is None:
        return one_process(opts.mode, opts.ranks, args)
    return process_of_several(opts.mode, opts.process, opts.processes, opts.port, opts.gpu, args)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
