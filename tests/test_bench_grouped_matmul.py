"""python -m jax_ep.bench grouped_matmul on CPU, tiny: ragged_dot and the dense chain of the same FLOPs run (the
Pallas kernels are skipped, saying why), and the JSON holds each figure with its ratio to the dense chain."""
from __future__ import annotations

import json
import math

from jax_ep import bench


def test_grouped_matmul_bench_record(tmp_path):
    path = tmp_path / "gm.json"
    assert bench.main(["grouped_matmul", "--m", "256", "--d", "128", "--f", "128", "--groups", "4", "--runs", "1",
                       "--calls", "1", "--input-sets", "1", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert (record["m"], record["d"], record["f"], record["dtype"]) == (256, 128, 128, "bfloat16")
    timed = {(r["case"], r["implementation"]) for r in record["records"] if "ms" in r}
    assert {("dense", "dense chain"), ("random", "ragged_dot")} <= timed
    assert all(r["skipped"] for r in record["records"] if "ms" not in r)
    for r in record["records"]:
        if "ms" in r:
            assert math.isfinite(r["ms"]) and r["ms"] > 0, r
            assert math.isclose(r["tflops"], 3 * 3 * 2 * 256 * 128 * 128 / r["ms"] / 1e9), r
