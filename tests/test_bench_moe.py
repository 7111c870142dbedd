"""python -m jax_ep.bench moe on CPU, tiny: it runs end to end and says that its figures are not performance
figures off a GPU (they mean nothing on CPU); its JSON holds every figure (the block, the dense proxy, their
ratio, TFLOP/s from the explicit FLOP count, the four stages of the breakdown and their sum, the roofline and the
block's and expert FFN's ratios to it), and the plot is written."""
from __future__ import annotations

import json
import math
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

pytest.importorskip("flax")

import jax_ep  # noqa: E402
from jax_ep import bench  # noqa: E402

STAGES = {"router", "dispatch", "expert FFN", "combine"}


def moe_record(tmp_path, *argv: str) -> dict:
    path = tmp_path / "moe.json"
    assert bench.main(["moe", "--tokens", "16", "--runs", "1", "--calls", "1", "--stage-calls", "1",
                       "--json", str(path), *argv]) == 0
    return json.loads(path.read_text())


def test_moe_bench_record(tmp_path, capsys):
    plot = tmp_path / "moe.png"
    record = moe_record(tmp_path, "--shapes", "tiny", "--ranks", "4", "--plot", str(plot))
    assert record["mode"] == "moe"
    setup = record["setup"]
    assert (setup["num_ranks"], setup["tokens"], setup["dtype"], setup["target_ratio"]) == (4, 16, "bfloat16", 1.5)
    assert setup["not_a_performance_figure"].startswith("not on a GPU")
    assert setup["hbm_gbps"] > 0
    results = record["results"]
    assert [(r["shape"], r["dispatcher"]) for r in results] == [("tiny", "normal"), ("tiny", "xla")]
    for r in results:
        assert r["backend"] == "xla", r  # "normal" takes the xla backend where there is no CUDA device
        assert (r["d_model"], r["d_ff"], r["experts"], r["topk"]) == (128, 64, 8, 2)
        assert (r["experts_per_rank"], r["rows_per_rank"]) == (2, 16 * 2)
        # SwiGLU forward: 3 matmuls of 2·rows·D·F; backward twice the forward.
        assert r["flops_per_rank"] == 3 * (3 * 2 * 32 * 128 * 64)
        assert set(r["breakdown_ms"]) == STAGES
        for ms in (r["block_ms"], r["dense_proxy_ms"], *r["breakdown_ms"].values()):
            assert math.isfinite(ms) and ms > 0, r
        assert math.isclose(r["ratio"], r["block_ms"] / r["dense_proxy_ms"])
        assert r["meets_target"] == (r["ratio"] <= 1.5)
        assert math.isclose(r["block_tflops"], r["flops_per_rank"] / r["block_ms"] / 1e9)
        assert math.isclose(r["dense_proxy_tflops"], r["flops_per_rank"] / r["dense_proxy_ms"] / 1e9)
        assert math.isclose(r["breakdown_sum_ms"], sum(r["breakdown_ms"].values()))
        assert r["breakdown_gpu_ms"] is None  # no GPU to profile
        compute = r["breakdown_ms"]["router"] + r["breakdown_ms"]["expert FFN"]
        assert math.isclose(r["compute_stages_ms"], compute)
        assert math.isclose(r["block_over_compute_stages"], r["block_ms"] / compute)
        communication = r["breakdown_ms"]["dispatch"] + r["breakdown_ms"]["combine"]
        assert math.isclose(r["hidden"], (r["breakdown_sum_ms"] - r["block_ms"]) / communication)
        assert r["num_chunks"] == 1
        # 2 experts per rank: W_gate_up 2·128·128 and W_down 2·64·128 elements, read, read again, written, 2 bytes.
        assert (r["weight_bytes"], r["hbm_gbps"]) == (3 * (32768 + 16384) * 2, setup["hbm_gbps"])
        # The proxy has the block's FLOPs: its rate puts the compute term at its time.
        assert math.isclose(r["roofline_ms"], max(r["dense_proxy_ms"], r["weight_bytes"] / (r["hbm_gbps"] * 1e6)))
        assert math.isclose(r["ratio_to_roofline"], r["block_ms"] / r["roofline_ms"])
        # The expert FFN stage is set against the proxy timed in turns with it (its own figure), not the block's.
        ffn_proxy = r["expert_ffn_proxy_ms"]
        assert math.isfinite(ffn_proxy) and ffn_proxy > 0, r
        assert math.isclose(r["expert_ffn_ratio_to_proxy"], r["breakdown_ms"]["expert FFN"] / ffn_proxy)
        ffn_roofline = max(ffn_proxy, r["weight_bytes"] / (r["hbm_gbps"] * 1e6))
        assert math.isclose(r["expert_ffn_ratio_to_roofline"], r["breakdown_ms"]["expert FFN"] / ffn_roofline)
    out = capsys.readouterr().out
    assert "[moe] not on a GPU" in out and "dense proxy" in out, out
    assert out.count("[moe]   breakdown") == 2 and out.count("compute stages (router + expert FFN)") == 4, out
    assert out.count("communication hidden") == 2, out
    # Both dispatchers ran: their communication stages side by side, by the wall clock only (no GPU time on CPU).
    ratios = [line for line in out.splitlines() if "normal (xla backend) / xla" in line]
    assert len(ratios) == 1 and "dispatch" in ratios[0] and "combine" in ratios[0], out
    assert "GPU time" not in out, out
    assert "[moe] HBM bandwidth" in out and out.count("x the dense proxy timed in turns with it") == 2, out
    assert out.count("x its roofline") == 4, out
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_moe_bench_shape_overrides(tmp_path):
    """--d-model/--d-ff/--experts/--topk replace the listed shape's own; the run says it was modified."""
    record = moe_record(tmp_path, "--shapes", "tiny", "--dispatchers", "xla", "--d-ff", "128", "--experts", "16",
                        "--topk", "1")
    (r,) = record["results"]
    assert (r["shape"], r["dispatcher"]) == ("tiny, modified", "xla")
    assert (r["d_model"], r["d_ff"], r["experts"], r["topk"]) == (128, 128, 16, 1)
    assert r["experts_per_rank"] == 16 // record["setup"]["num_ranks"]
    assert set(r["breakdown_ms"]) == STAGES


def test_moe_bench_num_chunks(tmp_path, capsys):
    """--num-chunks 1 2: the block timed with each num_chunks in the same run (a record each), one breakdown shared
    by both, and the header says so."""
    record = moe_record(tmp_path, "--shapes", "tiny", "--dispatchers", "xla", "--ranks", "2", "--num-chunks", "1", "2")
    assert record["setup"]["num_chunks"] == [1, 2]
    one, two = record["results"]
    assert (one["num_chunks"], two["num_chunks"]) == (1, 2)
    assert one["breakdown_ms"] == two["breakdown_ms"]
    assert all(math.isfinite(r["block_ms"]) and r["block_ms"] > 0 for r in (one, two))
    out = capsys.readouterr().out
    assert "16 tokens per rank (the block in 1 and 2 chunks)" in out and "(xla backend, 2 chunks)" in out, out
    assert out.count("[moe]   breakdown") == 1, out


def test_moe_bench_sms(tmp_path, capsys):
    """--sms N puts the normal dispatcher's kernels on N SMs (its Buffer's Config); the xla dispatcher's Buffer keeps
    the block's own Config (off a GPU: jax_ep.Config()'s default); the header says so."""
    record = moe_record(tmp_path, "--shapes", "tiny", "--ranks", "2", "--sms", "16")
    assert record["setup"]["normal_dispatcher_sms"] == 16
    sms = {r["dispatcher"]: r["num_sms"] for r in record["results"]}
    assert sms == {"normal": 16, "xla": jax_ep.Config().num_sms}, sms
    assert "the normal dispatcher's kernels on 16 SMs" in capsys.readouterr().out


def test_moe_bench_remat_memory(tmp_path):
    """--remat records XLA's temporary memory of the block's step with and without jax.checkpoint, and
    recomputing does not cost memory beyond a margin. (That it keeps less alive is asserted on the GPU at a
    realistic shape, tests/gpu/test_flax_moe_gpu.py: XLA's CPU schedule of these tiny blocks keeps about as much
    either way, 5.3 and 5.6 MiB.)"""
    record = moe_record(tmp_path, "--shapes", "tiny", "--dispatchers", "xla", "--ranks", "2", "--remat",
                        "--tokens", "64")
    (r,) = record["results"]
    assert set(r["temp_bytes"]) == {"plain", "remat"}
    assert 0 < r["temp_bytes"]["remat"] <= 1.25 * r["temp_bytes"]["plain"], r["temp_bytes"]


def test_moe_bench_timeline(tmp_path, capsys):
    """--timeline PATH: one profiled step per block timed (dispatcher, num_chunks), drawn to PATH with the shape,
    the dispatcher and the chunks in its name."""
    path = tmp_path / "step.png"
    moe_record(tmp_path, "--shapes", "tiny", "--dispatchers", "xla", "--ranks", "2", "--num-chunks", "1", "2",
               "--timeline", str(path))
    out = capsys.readouterr().out
    for variant in ("xla", "xla-2-chunks"):
        drawn = tmp_path / f"step-tiny-{variant}.png"
        assert drawn.read_bytes().startswith(b"\x89PNG")
        spans = json.loads((tmp_path / f"step-tiny-{variant}.json").read_text())
        assert spans and all(duration >= 0 and isinstance(name, str) for lane in spans.values()
                             for _, duration, name, _ in lane), spans
        assert f"timeline of one step: {drawn}" in out


def test_moe_bench_communication_ratios(capsys):
    """The line that sets the normal dispatcher's communication stages beside the xla dispatcher's, by the wall
    clock and on the GPU (ratios written out by hand from the figures)."""
    from jax_ep.bench import moe

    def record(dispatcher, backend, wall, gpu):
        return dict(dispatcher=dispatcher, backend=backend, breakdown_ms=dict(zip(("dispatch", "combine"), wall)),
                    breakdown_gpu_ms=dict(zip(("dispatch", "combine"), gpu)))

    moe._print_communication_ratios("moe-a", [record("normal", "cuda", (0.4, 0.3), (0.25, 0.2)),
                                              record("xla", "xla", (0.8, 0.5), (0.5, 0.4))])
    out = capsys.readouterr().out
    assert out == ("[moe] moe-a, normal (cuda backend) / xla, each stage forward + backward: dispatch 0.400 / 0.800 "
                   "ms (0.50x; GPU time 0.250 / 0.500 ms, 0.50x), combine 0.300 / 0.500 ms (0.60x; GPU time 0.200 / "
                   "0.400 ms, 0.50x)\n"), out
    moe._print_communication_ratios("moe-a", [record("xla", "xla", (0.8, 0.5), (0.5, 0.4))])  # one dispatcher
    assert capsys.readouterr().out == ""


def test_timed_runs_start_after_the_barrier():
    """harness.alternating_median_ms calls before_run once before each run of each step, and the run's clock starts
    after it: a barrier that takes 50 ms adds nothing to the figures (the steps here take no time)."""
    import time

    from jax_ep.bench import harness

    order = []

    def barrier():
        order.append("barrier")
        time.sleep(0.05)

    def step(name):
        def fn():
            order.append(name)
        return fn

    ms = harness.alternating_median_ms({"a": (step("a"), [()]), "b": (step("b"), [()])}, runs=3, calls=2, warmup=1,
                                       before_run=barrier)
    # Warm-up (no barrier), then each run of each step, the order reversed every other run.
    assert order == ["a", "b"] + ["barrier", "a", "a", "barrier", "b", "b",
                                  "barrier", "b", "b", "barrier", "a", "a",
                                  "barrier", "a", "a", "barrier", "b", "b"]
    assert ms["a"] < 25 and ms["b"] < 25, ms  # ms per call, the barrier's 50 ms outside the clock


def test_rank_barrier_returns_on_cpu():
    """harness.rank_barrier(mesh) is one compiled barrier per mesh that returns once every rank reached it."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jax_ep.bench import harness

    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    barrier = harness.rank_barrier(mesh)
    assert harness.rank_barrier(mesh) is barrier
    assert barrier() is None


def test_moe_refuses_ranks_sharing_a_gpu(capsys):
    """bench moe refuses ranks sharing a GPU before launching: its block step, with either dispatcher, failed on one
    H200 with NCCL's "Duplicate GPU detected"."""
    with pytest.raises(SystemExit):
        bench.main(["moe", "--shapes", "tiny", "--processes", "2", "--gpus", "1", "--allow-shared-gpu"])
    assert "NCCL's, which refuse two ranks on one GPU" in capsys.readouterr().err
