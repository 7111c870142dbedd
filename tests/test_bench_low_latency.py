"""python -m jax_ep.bench low_latency on CPU, tiny: it runs end to end (the figures mean nothing on CPU) and
its JSON record holds every figure, with DeepEP's byte count. Times are differences of two short wall-clock
runs (noise on CPU can make them negative), so only their finiteness is checked. The on-GPU breakdown of the
cuda kernels' trace is checked on a hand-timed synthetic trace."""
from __future__ import annotations

import json
import math
import os

import numpy as np

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jax_ep import bench  # noqa: E402
from jax_ep.bench import low_latency  # noqa: E402


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
                       for op, payload in (("dispatch", "FP8"), ("dispatch", "BF16"), ("combine", "BF16"))} | {
                           ("jax_ep xla", "combine", "LogFMT")}  # the xla backend's compressed combine
    # DeepEP's count (docs/design.md, "Byte counts"): per valid (token, expert) pair H + H/128*4 + 16 bytes for FP8
    # dispatch, 2H for BF16 dispatch and combine, and 164 bytes per 128 values LogFMT-compressed; GB/s * µs * 1e3 =
    # bytes moved per rank.
    pair_bytes = {"FP8": 256 + 256 // 128 * 4 + 16, "BF16": 2 * 256, "LogFMT": 256 // 128 * 164}
    assert setup["combine_bytes_per_rank"] == {payload: setup["valid_pairs_per_rank"] * pair_bytes[payload]
                                               for payload in ("BF16", "LogFMT")}
    for r in record["results"]:
        assert math.isfinite(r["t_us"]) and r["t_us"] != 0, r
        assert math.isclose(r["gbps"] * r["t_us"] * 1e3, setup["valid_pairs_per_rank"] * pair_bytes[r["payload"]],
                            rel_tol=1e-9), r
    assert {(s["op"], s["payload"]) for s in record["splits"]} == {("dispatch", "FP8"), ("combine", "BF16")}
    for s in record["splits"]:
        assert math.isfinite(s["t_split_us"]) and math.isfinite(s["compute_us"]), s
    assert {(s["op"], s["payload"]) for s in record["speedups"]} == {
        ("dispatch", "FP8"), ("dispatch", "BF16"), ("combine", "BF16"), ("combine", "LogFMT")}
    assert all(math.isfinite(s["speedup"]) and s["baseline"].startswith("jax all_to_all") for s in record["speedups"])
    out = capsys.readouterr().out
    assert "[low_latency] jax_ep xla [dispatch FP8]" in out and "GB/s (NVL)" in out


def test_low_latency_bench_one_op(tmp_path):
    """--ops combine times the combine only: no dispatch figure, split or baseline of any op (--no-baselines
    also leaves out the xla backend, which on CPU is the measured implementation itself)."""
    path = tmp_path / "ll.json"
    assert bench.main(["low_latency", "--ranks", "4", "--tokens", "8", "--hidden", "256", "--experts", "16",
                       "--topk", "2", "--iters", "1", "--repeats", "1", "--ops", "combine", "--no-baselines",
                       "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["setup"]["ops"] == ["combine"] and record["setup"]["baselines"] is False
    assert [(r["backend"], r["op"], r["payload"]) for r in record["results"]] == [
        ("jax_ep xla", "combine", "BF16"), ("jax_ep xla", "combine", "LogFMT")]
    assert [(s["op"], s["payload"]) for s in record["splits"]] == [("combine", "BF16")]
    assert record["speedups"] == []


def test_baselines_follow_ops(tmp_path):
    """With baselines on, --ops dispatch times only the dispatch baselines."""
    path = tmp_path / "ll.json"
    assert bench.main(["low_latency", "--ranks", "2", "--tokens", "4", "--hidden", "128", "--experts", "4",
                       "--topk", "2", "--iters", "1", "--repeats", "1", "--ops", "dispatch", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert {r["op"] for r in record["results"]} == {"dispatch"}
    assert {(r["backend"], r["payload"]) for r in record["results"]} == {
        (backend, payload) for backend in ("jax_ep xla", "jax all_to_all") for payload in ("FP8", "BF16")}
    assert {s["op"] for s in record["speedups"]} == {"dispatch"}


def _prepared_ring(phases, slots=256):
    """A trace ring as Buffer.backend_impl.low_latency_trace returns it, every slot prepared (no call)."""
    ring = {name: np.zeros(slots, np.int64) for name in ("call", "units", "last_start", "last_flag", "end")}
    ring["first_start"], ring["first_flag"] = np.full(slots, -1, np.int64), np.full(slots, -1, np.int64)
    ring["phases"] = {name: np.zeros(slots, np.int64) for name in phases}
    return ring


def _synthetic_gpu(origin, send_ns):
    """Calls 5..14 of a dispatch on one GPU, hand-timed in ns from `origin` (each GPU's clock has its own): a
    call every 40 µs; send `send_ns` (4 blocks: 2, 3, 10, 1 µs of phases each; blocks start within 0.5 µs,
    flags raised at 8 and 19 µs), 1 µs gap, receive 5 µs (2 blocks: waiting 1.5 and copying 3 µs each, flags
    found at 0.3 and 4 µs) except call 14's, which waits 400 µs more (a program's last call in a skewed run).
    Slot 15 holds an unfinished send; slot 3 a send of call 259 beside a receive of call 3 (stale slots)."""
    send = _prepared_ring(("routing", "cast", "puts", "flags"))
    recv = _prepared_ring(("waiting", "copying"))
    for call in range(5, 15):
        start = origin + 40_000 * (call - 5)
        send["call"][call], send["units"][call] = call, 4
        send["first_start"][call], send["last_start"][call], send["end"][call] = start, start + 500, start + send_ns
        send["first_flag"][call], send["last_flag"][call] = start + 8_000, start + 19_000
        for phase, ns in zip(("routing", "cast", "puts", "flags"), (2_000, 3_000, 10_000, 1_000)):
            send["phases"][phase][call] = 4 * ns
        begin = start + send_ns + 1_000
        recv["call"][call], recv["units"][call] = call, 2
        recv["first_start"][call], recv["last_start"][call] = begin, begin + 200
        recv["end"][call] = begin + 5_000 + (400_000 if call == 14 else 0)
        recv["first_flag"][call], recv["last_flag"][call] = begin + 300, begin + 4_000
        recv["phases"]["waiting"][call], recv["phases"]["copying"][call] = 2 * 1_500, 2 * 3_000
    send["call"][15], send["first_start"][15] = 15, origin + 400_000
    for ring, call in ((send, 259), (recv, 3)):
        ring["call"][3], ring["units"][3] = call, 1
        ring["first_start"][3], ring["end"][3] = origin - 900_000 + call, origin - 800_000
    empty = {k: _prepared_ring(()) for k in ("combine send", "combine recv")}
    return {"dispatch send": send, "dispatch recv": recv, **empty}


def test_trace_breakdown_hand_timed():
    """The benchmark's on-GPU breakdown against hand-computed figures: per GPU the medians over its finished
    calls (the slow last call moves the plain means only), then the mean over two GPUs with unrelated clocks."""
    traces = [_synthetic_gpu(10**12, 20_000), _synthetic_gpu(5 * 10**15, 22_000)]
    b = low_latency.trace_breakdown(traces, "dispatch")
    expected = {
        "calls": 10, "gpus": 2, "period": 40, "send": 21, "gap": 1, "recv": 5, "op": 27,
        "between": (14 + 12) / 2,  # 40 - (send + 1 + 5) per GPU
        "send_mean": 21, "recv_mean": (9 * 5 + 405) / 10,
        "dispatch send: spread": 0.5, "dispatch send: first flag": 8, "dispatch send: last flag": 19,
        "dispatch send: routing": 2, "dispatch send: cast": 3, "dispatch send: puts": 10, "dispatch send: flags": 1,
        "dispatch recv: spread": 0.2, "dispatch recv: first flag": 0.3, "dispatch recv: last flag": 4,
        "dispatch recv: waiting": 1.5, "dispatch recv: copying": 3,
    }
    per_gpu = b.pop("per_gpu")
    assert b.keys() == expected.keys()
    assert per_gpu == [{"op": 26, "send": 20, "recv": 5, "dispatch recv: last flag": 4},
                       {"op": 28, "send": 22, "recv": 5, "dispatch recv: last flag": 4}]  # each GPU's own medians
    for name, value in expected.items():
        assert math.isclose(b[name], value, rel_tol=1e-12), (name, b[name], value)
    assert low_latency.trace_breakdown(traces, "combine") is None  # no combine call ran
    lines = low_latency.breakdown_lines(b | {"per_gpu": per_gpu}, "dispatch", "2 GPUs")
    assert lines[3] == "per GPU: op 26.00 (recv's last flag 4.00); op 28.00 (recv's last flag 4.00) us"
    assert "an op every 40.00 us = send 21.00 + gap 1.00 + recv 5.00 + between ops 13.00 us" in lines[0]
    assert "plain means: send 21.00, recv 45.00 us" in lines[0]
    assert lines[1].startswith("dispatch send: blocks start within 0.50 us; per block: routing 2.00, cast 3.00, "
                               "puts 10.00, flags 1.00 us; flags raised from 8.00 to 19.00 us")
    assert lines[2].startswith("dispatch recv: blocks start within 0.20 us; per block: waiting 1.50, copying 3.00 us; "
                               "waits for flags done from 0.30 to 4.00 us")
