"""One process of the multi-process test (tests/test_multiprocess.py); not a pytest module.

usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Every process joins `jax.distributed` on 127.0.0.1:PORT with its own virtual CPU devices (the launcher sets
XLA_FLAGS and JAX_PLATFORMS) and gloo collectives, builds one global mesh of all devices on axis "ep",
runs dispatch -> (recv_x * 2) -> combine with the `xla` backend under jit + shard_map and checks the shards
it holds against a NumPy reference of docs/design.md ("Semantics") computed from the same global inputs (same seed in
every process). Exits 0 on success, 1 with a message naming what differed.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np

# The checkout's jax_ep even where it is not installed (it normally is, editable).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS_PER_RANK = 4
HIDDEN = 128
NUM_TOPK = 3
EXPERTS_PER_RANK = 2
SEED = 20240611


def make_inputs(num_ranks: int):
    """Deterministic global inputs: x float32 [R*T, H], topk_idx int32 [R*T, K] with -1 entries (one token
    routed nowhere, one with two experts on one rank), topk_weights float32 [R*T, K]."""
    num_experts = num_ranks * EXPERTS_PER_RANK
    total = num_ranks * TOKENS_PER_RANK
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((total, HIDDEN)).astype(np.float32)
    topk_idx = np.stack([rng.choice(num_experts, NUM_TOPK, replace=False) for _ in range(total)]).astype(np.int32)
    topk_idx[rng.random((total, NUM_TOPK)) < 0.25] = -1
    topk_idx[1] = -1  # sent nowhere
    topk_idx[2] = [0, 1, -1]  # both experts on rank 0: received there once
    topk_weights = rng.random((total, NUM_TOPK)).astype(np.float32)
    return x, topk_idx, topk_weights


def reference(x, topk_idx, topk_weights, num_ranks: int):
    """Per-rank expected outputs of dispatch -> (recv_x * 2) -> combine, from docs/design.md (independent of jax_ep)."""
    total = x.shape[0]
    capacity = num_ranks * TOKENS_PER_RANK  # the default max_recv_tokens
    valid = topk_idx >= 0
    rank_of = np.where(valid, topk_idx // EXPERTS_PER_RANK, -1)
    in_rank = np.stack([(rank_of == r).any(axis=1) for r in range(num_ranks)], axis=1)  # [R*T, R]

    recv_x = np.zeros((num_ranks, capacity, HIDDEN), np.float32)
    recv_idx = np.full((num_ranks, capacity, NUM_TOPK), -1, np.int32)
    recv_w = np.zeros((num_ranks, capacity, NUM_TOPK), np.float32)
    num_recv = np.zeros(num_ranks, np.int32)
    for r in range(num_ranks):
        rows = np.flatnonzero(in_rank[:, r])  # global token = source rank * T + source token: the dispatch order
        num_recv[r] = rows.size
        recv_x[r, : rows.size] = x[rows]
        here = rank_of[rows] == r
        recv_idx[r, : rows.size] = np.where(here, topk_idx[rows] - r * EXPERTS_PER_RANK, -1)
        recv_w[r, : rows.size] = np.where(here, topk_weights[rows], 0.0)

    # Combine of y = 2 * recv_x: float32, summed over ranks in rank order (zero where r did not receive t).
    out = np.zeros((total, HIDDEN), np.float32)
    out_w = np.zeros((total, NUM_TOPK), np.float32)
    for r in range(num_ranks):
        out = out + np.where(in_rank[:, r, None], np.float32(2) * x, np.float32(0))
        out_w = out_w + np.where(in_rank[:, r, None] & (rank_of == r), topk_weights, np.float32(0))
    return dict(recv_x=recv_x, recv_topk_idx=recv_idx, recv_topk_weights=recv_w, num_recv_tokens=num_recv,
                combined_x=out, combined_weights=out_w)


def main(process_id: int, num_processes: int, port: int) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
        initialization_timeout=120,
    )
    try:
        return run_and_check(process_id)
    finally:
        jax.distributed.shutdown()


def run_and_check(process_id: int) -> int:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    devices = jax.devices()
    num_ranks = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    sharding = NamedSharding(mesh, P("ep"))
    x, topk_idx, topk_weights = make_inputs(num_ranks)
    num_experts = num_ranks * EXPERTS_PER_RANK
    want = reference(x, topk_idx, topk_weights, num_ranks)

    def global_array(values):
        return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])

    buffer = jax_ep.Buffer(mesh, "ep", backend="xla", num_experts=num_experts)

    def per_rank(x, topk_idx, topk_weights):
        out = jax_ep.dispatch(buffer, x, topk_idx, topk_weights, strict=True)
        combined = jax_ep.combine(buffer, out.recv_x * 2, out.handle, topk_weights=out.recv_topk_weights)
        return dict(
            recv_x=out.recv_x, recv_topk_idx=out.recv_topk_idx, recv_topk_weights=out.recv_topk_weights,
            num_recv_tokens=out.num_recv_tokens[None], num_dropped=out.num_dropped[None],
            invalid_ids=out.invalid_ids[None], combined_x=combined.x, combined_weights=combined.topk_weights,
        )

    step = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    got = step(global_array(x), global_array(topk_idx), global_array(topk_weights))
    jax.block_until_ready(got)

    want = {
        **{k: v.reshape(-1, *v.shape[2:]) for k, v in want.items() if k.startswith("recv")},  # [R*C, ...]
        "num_recv_tokens": want["num_recv_tokens"],
        "num_dropped": np.zeros(num_ranks, np.int32),
        "invalid_ids": np.zeros(num_ranks, np.int32),
        "combined_x": want["combined_x"],
        "combined_weights": want["combined_weights"],
    }
    failures = []
    checked = 0
    for name, array in got.items():
        for shard in array.addressable_shards:
            expected = want[name][shard.index]
            actual = np.asarray(shard.data)
            checked += 1
            if actual.dtype != expected.dtype or not np.array_equal(actual, expected):
                rank = devices.index(shard.device)
                bad = np.argwhere(actual != expected)[:4].tolist() if actual.shape == expected.shape else "shape"
                failures.append(
                    f"{name} on rank {rank} (device {shard.device}): got {actual.dtype}{list(actual.shape)}, "
                    f"want {expected.dtype}{list(expected.shape)}; first differing positions {bad}\n"
                    f"  got  {actual.ravel()[:8]}\n  want {expected.ravel()[:8]}"
                )
    local = [d.id for d in jax.local_devices()]
    if failures:
        print(f"process {process_id} (devices {local}): {len(failures)} of {checked} shards differ:", file=sys.stderr)
        for line in failures:
            print("  " + line, file=sys.stderr)
        return 1
    print(f"process {process_id} (devices {local}): all {checked} shards match the reference")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    try:
        code = main(*(int(a) for a in sys.argv[1:]))
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
