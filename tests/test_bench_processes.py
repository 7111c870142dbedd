"""python -m jax_ep.bench {low_latency,intranode,moe} --processes 2 on CPU, tiny: the launcher starts two
jax.distributed processes (one CPU device each, gloo), both run the benchmark over the global 2-rank mesh,
process 0 alone prints and writes the JSON, which records the process model; a failing worker makes the
launcher exit non-zero with that worker's last lines. The internode mode refuses to run without one process per
GPU, and a launch over several hosts without a coordinator."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ONE_PROCESS_PER_GPU = "one process per GPU"


def bench(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the launcher sets one CPU device per worker in XLA_FLAGS
    return subprocess.run([sys.executable, "-m", "jax_ep.bench", *argv, "--processes", "2", "--deadline", "100"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def bench_record(tmp_path, *argv: str) -> tuple[str, dict | list]:
    """Runs the tiny benchmark (one timed iteration); its stdout and JSON record."""
    path = tmp_path / "bench.json"
    run = bench(*argv, "--iters", "1", "--repeats", "1", "--json", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout, json.loads(path.read_text())


def test_low_latency_one_process_per_rank(tmp_path):
    stdout, record = bench_record(tmp_path, "low_latency", "--tokens", "4", "--hidden", "128", "--experts", "4",
                                  "--topk", "2", "--overlap-size", "32")
    setup = record["setup"]
    assert setup["process_model"] == ONE_PROCESS_PER_GPU and setup["num_ranks"] == 2
    assert setup["measured"] == "jax_ep xla"
    assert {r["backend"] for r in record["results"]} == {"jax_ep xla", "jax all_to_all"}
    assert all(math.isfinite(r["t_us"]) for r in record["results"])  # 1 iteration: CPU noise can make it < 0
    headers = [line for line in stdout.splitlines() if line.startswith("[low_latency] 2 ranks")]
    assert len(headers) == 1 and ONE_PROCESS_PER_GPU in headers[0], stdout  # process 0 alone prints


def test_intranode_one_process_per_rank(tmp_path):
    stdout, records = bench_record(tmp_path, "intranode", "--sms", "--xla", "--tokens", "8", "--hidden", "128",
                                   "--experts", "4", "--topk", "2")
    assert {(r["backend"], r["op"], r["payload"]) for r in records} == {
        ("xla", "dispatch", "BF16"), ("xla", "dispatch", "FP8"), ("xla", "combine", "BF16"),
        ("jax all_to_all", "dispatch", "BF16"), ("jax all_to_all", "combine", "BF16")}
    for r in records:
        assert r["process_model"] == ONE_PROCESS_PER_GPU and r["num_ranks"] == 2 and math.isfinite(r["t_us"]), r
        assert 0 < r["recv_rows"] <= 2 * 8, r
    assert stdout.count("[intranode] xla dispatch (BF16)") == 1, stdout


def test_moe_one_process_per_rank(tmp_path):
    pytest.importorskip("flax")
    path = tmp_path / "moe.json"
    run = bench("moe", "--shapes", "tiny", "--dispatchers", "xla", "--tokens", "16", "--runs", "1", "--calls", "1",
                "--json", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads(path.read_text())
    assert (record["setup"]["process_model"], record["setup"]["num_ranks"]) == (ONE_PROCESS_PER_GPU, 2)
    [result] = record["results"]
    assert (result["dispatcher"], result["experts_per_rank"]) == ("xla", 4), result
    assert all(math.isfinite(ms) and ms > 0 for ms in (result["block_ms"], *result["breakdown_ms"].values())), result
    assert run.stdout.count("[moe] tiny xla") == 1, run.stdout  # process 0 alone prints


def test_failing_worker_fails_the_launcher(tmp_path):
    """The cuda kernels asked for on CPU: every worker stops with a message that says so."""
    path = tmp_path / "never.json"
    run = bench("intranode", "--sms", "24", "--no-baselines", "--tokens", "8", "--hidden", "128", "--experts", "4",
                "--topk", "2", "--json", str(path))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "[bench] process 1 of 2 exited with code 1; last lines:" in run.stderr, run.stderr
    assert "the cuda kernels (--sms 24) need NVIDIA GPUs" in run.stderr.split("[bench] process 1 of 2")[1], run.stderr
    assert not path.exists()


def _bench_on_cpu(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jax_ep.bench", *argv], cwd=REPO_ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode", ["intranode", "internode", "low_latency", "moe", "grouped_matmul", "overlap"])
def test_default_sizes_need_a_gpu(mode):
    """A GPU benchmark at its default sizes on a machine without GPUs: one line that says so, exit status 1, nothing
    run (in this process, and as the launcher of --processes, which starts no worker)."""
    for launcher in (False, True) if mode != "grouped_matmul" else (False,):  # grouped_matmul: one GPU
        run = _bench_on_cpu(mode, *(["--processes", "2"] if launcher else []))
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert run.returncode == 1 and lines[-1].startswith(f"python -m jax_ep.bench {mode}: needs NVIDIA GPUs"), \
            run.stdout + run.stderr
        assert sum("needs NVIDIA GPUs" in line for line in lines) == 1 and "[bench] process" not in run.stderr, \
            run.stderr
        assert f"[{mode}]" not in run.stdout, run.stdout


@pytest.mark.parametrize("mode", ["moe", "grouped_matmul"])
def test_named_gpu_shapes_need_a_gpu(mode):
    """--shapes v3 names a GPU figure: on a machine without GPUs it stops as the default sizes do."""
    run = _bench_on_cpu(mode, "--shapes", "v3")
    assert run.returncode == 1 and f"python -m jax_ep.bench {mode}: needs NVIDIA GPUs" in run.stderr, \
        run.stdout + run.stderr


def test_internode_needs_one_process_per_gpu():
    run = subprocess.run([sys.executable, "-m", "jax_ep.bench", "internode", "--tokens", "8", "--hidden", "128"],
                         cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "internode mode needs one process per GPU: pass --processes N" in run.stderr, \
        run.stdout + run.stderr


def test_several_hosts_need_a_coordinator():
    run = subprocess.run([sys.executable, "-m", "jax_ep.bench", "internode", "--processes", "4", "--nodes", "2"],
                         cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--nodes M needs --node-rank in [0, M) and --coordinator HOST:PORT" in run.stderr, \
        run.stderr


def test_ranks_sharing_a_gpu_need_consent(tmp_path):
    """More processes than GPUs (here 2 on `--gpus 1`): refused without --allow-shared-gpu."""
    run = bench("low_latency", "--gpus", "1", "--tokens", "4", "--hidden", "128", "--experts", "4", "--topk", "2")
    assert run.returncode == 2 and "ranks would share GPUs" in run.stderr and "--allow-shared-gpu" in run.stderr, \
        run.stdout + run.stderr


def test_ranks_sharing_a_gpu_label_every_figure(tmp_path):
    """With --allow-shared-gpu every line printed and every JSON record says it is not a performance figure."""
    stdout, records = bench_record(tmp_path, "intranode", "--gpus", "1", "--allow-shared-gpu", "--sms", "--xla",
                                   "--tokens", "8", "--hidden", "128", "--experts", "4", "--topk", "2")
    lines = [line for line in stdout.splitlines() if "[intranode]" in line]  # not the C++ libraries' own lines
    assert any("xla dispatch (BF16)" in line for line in lines), stdout
    assert all(line.startswith("[shared GPU: not a performance figure] [intranode]") for line in lines), stdout
    assert records and all(r["not_a_performance_figure"] == "ranks shared GPUs" for r in records), records
