"""python -m jax_ep.bench low_latency on CPU, tiny: it runs end to end (the figures mean nothing on CPU) and
its JSON record holds every figure, with DeepEP's byte count. Times are differences of two short wall-clock
runs (noise on CPU can make them negative), so only their finiteness is checked."""
from __future__ import annotations

import json
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jax_ep import bench  # noqa: E402


def test_low_latency_bench_record(tmp_path, capsys):
    path = tmp_path / "ll.json"
    assert bench.main(["low_latency", "--ranks", "4", "--tokens", "8", "--hidden", "256", "--experts", "16",
                       "--topk", "2", "--masked", "1", "--iters", "1", "--repeats", "1", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["mode"] == "low_latency"
    setup = record["setup"]
    assert (setup["num_ranks"], setup["tokens"], setup["hidden"], setup["topk"], setup["experts"]) == (4, 8, 256, 2, 16)
    assert setup["valid_pairs_per_rank"] == 8 * 2 - 1  # one entry per rank masked to -1
    assert setup["measured"] == "jax_ep xla" and setup["custom_calls"] == []  # no CUDA on CPU
    figures = {(r["backend"], r["op"], r["payload"]) for r in record["results"]}
    assert figures == {(backend, op, payload) for backend in ("jax_ep xla", "jax all_to_all")
                       for op, payload in (("dispatch", "FP8"), ("dispatch", "BF16"), ("combine", "BF16"))}
    # DeepEP's count (ARCHITECTURE.md §5): per valid (token, expert) pair H + H/128*4 + 16 bytes for FP8
    # dispatch, 2H for BF16 dispatch and combine; GB/s * µs * 1e3 = bytes moved per rank.
    pair_bytes = {"FP8": 256 + 256 // 128 * 4 + 16, "BF16": 2 * 256}
    for r in record["results"]:
        assert math.isfinite(r["t_us"]) and r["t_us"] != 0, r
        assert math.isclose(r["gbps"] * r["t_us"] * 1e3, setup["valid_pairs_per_rank"] * pair_bytes[r["payload"]],
                            rel_tol=1e-9), r
    assert {(s["op"], s["payload"]) for s in record["splits"]} == {("dispatch", "FP8"), ("combine", "BF16")}
    for s in record["splits"]:
        assert math.isfinite(s["t_split_us"]) and math.isfinite(s["compute_us"]), s
    assert {(s["op"], s["payload"]) for s in record["speedups"]} == {
        ("dispatch", "FP8"), ("dispatch", "BF16"), ("combine", "BF16")}
    assert all(math.isfinite(s["speedup"]) and s["baseline"].startswith("jax all_to_all") for s in record["speedups"])
    out = capsys.readouterr().out
    assert "[low_latency] jax_ep xla [dispatch FP8]" in out and "GB/s (NVL)" in out
