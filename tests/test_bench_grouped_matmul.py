"""python -m jax_ep.bench grouped_matmul on CPU, tiny: ragged_dot and the dense chain of the same FLOPs run (the
Pallas kernels are skipped, saying why), and the JSON holds each figure with its ratio to the dense chain; the
problems that --shapes and --m/--d/--f/--groups describe."""
from __future__ import annotations

import json
import math

import pytest

from jax_ep import bench
from jax_ep.bench import grouped_matmul, harness


def parse(*argv: str):
    parser = harness.mode_parser("grouped_matmul", "")
    grouped_matmul.add_arguments(parser)
    return parser.parse_args(argv)


def test_problems_from_shapes():
    """--shapes: M = 4096 tokens x K, D and F of the shape, one group per expert; --experts N ... replaces E."""
    assert grouped_matmul.problems(parse("--shapes", "moe-a", "v3")) == [
        ("moe-a", 4096 * 6, 2048, 1408, (64,)), ("v3", 4096 * 8, 7168, 2048, (256,))]
    assert grouped_matmul.problems(parse("--shapes", "v3", "--experts", "128", "256", "--tokens", "1024")) == [
        ("v3", 1024 * 8, 7168, 2048, (128, 256))]


def test_problems_from_sizes():
    assert grouped_matmul.problems(parse()) == [(None, 24576, 2048, 1408, (16, 64))]
    assert grouped_matmul.problems(parse("--m", "256", "--groups", "4")) == [(None, 256, 2048, 1408, (4,))]


@pytest.mark.parametrize("argv", [("--shapes", "v3", "--m", "256"), ("--shapes", "v3", "--groups", "4"),
                                  ("--experts", "8",), ("--tokens", "64",)])
def test_problems_conflicting_options(argv):
    with pytest.raises(SystemExit):
        grouped_matmul.problems(parse(*argv))


def test_grouped_matmul_bench_record(tmp_path):
    path = tmp_path / "gm.json"
    assert bench.main(["grouped_matmul", "--m", "256", "--d", "128", "--f", "128", "--groups", "4", "--runs", "1",
                       "--calls", "1", "--input-sets", "1", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["dtype"] == "bfloat16"
    assert all((r["shape"], r["m"], r["d"], r["f"]) == (None, 256, 128, 128) for r in record["records"])
    timed = {(r["case"], r["implementation"]) for r in record["records"] if "ms" in r}
    assert {("dense", "dense chain"), ("random", "ragged_dot")} <= timed
    assert all(r["skipped"] for r in record["records"] if "ms" not in r)
    for r in record["records"]:
        if "ms" in r:
            assert math.isfinite(r["ms"]) and r["ms"] > 0, r
            assert math.isclose(r["tflops"], 3 * 3 * 2 * 256 * 128 * 128 / r["ms"] / 1e9), r
