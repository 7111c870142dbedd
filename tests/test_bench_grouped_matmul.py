"""python -m jax_ep.bench grouped_matmul on CPU, tiny: ragged_dot and the dense chain of the same FLOPs run (the
Pallas kernels are skipped, saying why), and the JSON holds each figure with its ratio to the dense chain and to
its roofline; the problems that --shapes and --m/--d/--f/--groups describe; the roofline (jax_ep.bench.swiglu)
and the input sets that fit a memory budget against figures worked out by hand."""
from __future__ import annotations

import json
import math

import jax
import numpy as np
import oracle as O
import pytest

from jax_ep import bench
from jax_ep.bench import grouped_matmul, harness, swiglu


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


def test_expert_weight_bytes():
    """W_gate_up [G, D, 2F] and W_down [G, F, D] read by the forward, read by dx and written by dW, 2 bytes each."""
    # v3, 256 experts: 256·7168·4096 + 256·2048·7168 = 7,516,192,768 + 3,758,096,384 elements, x 3 x 2 bytes.
    assert swiglu.expert_weight_bytes(256, 7168, 2048) == 67_645_734_912
    # moe-a, 64 experts: 64·2048·2816 + 64·1408·2048 = 369,098,752 + 184,549,376 elements, x 3 x 2 bytes.
    assert swiglu.expert_weight_bytes(64, 2048, 1408) == 3_321_888_768


def test_roofline_is_the_larger_term():
    # v3 at 4096 tokens, M = 32768 rows: 18·M·D·F = 8,658,654,068,736 FLOPs at 640 TFLOP/s = 13.529 ms; its weights,
    # 67,645,734,912 bytes at 4000 GB/s = 16.911 ms: bound by memory.
    v3 = swiglu.roofline(18 * 32768 * 7168 * 2048, 640, 67_645_734_912, 4000)
    assert v3.compute_ms == pytest.approx(13.529, abs=1e-3) and v3.memory_ms == pytest.approx(16.911, abs=1e-3)
    assert (v3.ms, v3.bound) == (v3.memory_ms, "memory")
    # moe-a, M = 24576: 1,275,605,286,912 FLOPs at 640 TFLOP/s = 1.993 ms; 3,321,888,768 bytes at 4000 GB/s =
    # 0.830 ms: bound by compute.
    moe_a = swiglu.roofline(18 * 24576 * 2048 * 1408, 640, 3_321_888_768, 4000)
    assert moe_a.compute_ms == pytest.approx(1.993, abs=1e-3) and moe_a.memory_ms == pytest.approx(0.830, abs=1e-3)
    assert (moe_a.ms, moe_a.bound) == (moe_a.compute_ms, "compute")
    fields = swiglu.roofline_fields(3.0, moe_a, 3_321_888_768, 4000)
    assert fields["ratio_to_roofline"] == pytest.approx(3.0 / 1.993, rel=1e-3)
    assert (fields["roofline_ms"], fields["weight_bytes"], fields["hbm_gbps"]) == (moe_a.ms, 3_321_888_768, 4000)


V3 = (32768, 7168, 2048)  # M (4096 tokens x K=8), D, F


def test_memory_per_input_set_and_call():
    # v3 at 256 experts: x and cotangent 2·32768·7168 = 469,762,048 elements; W_gate_up 256·7168·4096 =
    # 7,516,192,768; W_down 256·2048·7168 = 3,758,096,384; 2 bytes each.
    assert grouped_matmul.input_set_bytes(*V3, 256) == 23_488_102_400
    # Outputs y and dx 2·234,881,024 elements and the two dW as large as the weights, 2 bytes each: 23,488,102,400
    # bytes; row temporaries 4 bytes x 32768 x (3·4096 + 2·7168): 3,489,660,928 bytes.
    assert grouped_matmul.call_bytes(*V3, 256) == 26_977_763_328
    # At 128 experts: 12,213,813,248 bytes a set; 12,213,813,248 + 3,489,660,928 bytes a call.
    assert grouped_matmul.input_set_bytes(*V3, 128) == 12_213_813_248
    assert grouped_matmul.call_bytes(*V3, 128) == 15_703_474_176


@pytest.mark.parametrize("budget_gib, groups, sets", [
    # 107,374,182,400 bytes - two calls (53,955,526,656) leaves room for 2.27 sets of 23,488,102,400: 2 (the 3
    # sets asked for would take 124.4 GB with the two calls).
    (100, 256, 2),
    # 107,374,182,400 - 31,406,948,352 = 75,967,234,048 bytes: 6.2 sets of 12,213,813,248; 3 asked for.
    (100, 128, 3),
    # 64,424,509,440 - 53,955,526,656 bytes: less than one set; one anyway.
    (60, 256, 1),
    # 64,424,509,440 - 31,406,948,352 = 33,017,561,088 bytes: 2.70 sets.
    (60, 128, 2)])
def test_tensor_sets_within_budget(budget_gib, groups, sets):
    assert grouped_matmul.tensor_sets_within(budget_gib * 2 ** 30, 3, *V3, groups) == sets


class StubDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_memory_budget():
    """90 % of the memory free (bytes_limit - bytes_in_use), 16 GiB where the device says nothing, or as given."""
    device = StubDevice(dict(bytes_limit=100 * 2 ** 30, bytes_in_use=10 * 2 ** 30))
    assert grouped_matmul.memory_budget(parse(), device) == int(0.9 * 90 * 2 ** 30)
    assert grouped_matmul.memory_budget(parse(), StubDevice(None)) == 16 * 2 ** 30
    assert grouped_matmul.memory_budget(parse("--memory-budget-gib", "2.5"), device) == 2.5 * 2 ** 30


# (options, (shape, M, D, F), {group count: input sets whose tensors are made}); the tiny shape: D=128 F=64 K=2.
RUNS = [(("--m", "256", "--d", "128", "--f", "128", "--groups", "4", "--input-sets", "1"), (None, 256, 128, 128),
         {4: 1}),
        # A budget of 0.0015 GiB, 1,610,612 bytes. G=4: a set 2·(2·64·128 + 4·128·128 + 4·64·128) = 229,376
        # bytes, a call 2·(2·64·128 + 98,304) + 4·64·(3·128 + 2·128) = 393,216 bytes: (1,610,612 - 2·393,216) /
        # 229,376 = 3.6 sets, 2 asked for. G=8: a set 425,984 bytes, a call 589,824: (1,610,612 - 1,179,648) /
        # 425,984 = 1.01.
        (("--shapes", "tiny", "--tokens", "32", "--experts", "4", "8", "--input-sets", "2", "--memory-budget-gib",
          "0.0015"), ("tiny", 64, 128, 64), {4: 2, 8: 1})]


@pytest.mark.parametrize("options, problem, tensor_sets", RUNS)
def test_grouped_matmul_bench_record(tmp_path, options, problem, tensor_sets):
    path = tmp_path / "gm.json"
    assert bench.main(["grouped_matmul", *options, "--runs", "1", "--calls", "1", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["dtype"] == "bfloat16" and record["hbm_gbps"] > 0
    assert all((r["shape"], r["m"], r["d"], r["f"]) == problem for r in record["records"])
    _, m, d, f = problem
    timed = {(r["case"], r["implementation"], r["groups"]) for r in record["records"] if "ms" in r}
    assert {("dense", "dense chain", None)} | {("random", "ragged_dot", g) for g in tensor_sets} <= timed
    assert all(r["skipped"] for r in record["records"] if "ms" not in r)
    dense_ms = next(r["ms"] for r in record["records"] if r["case"] == "dense")
    for r in record["records"]:
        if "ms" not in r:
            continue
        assert math.isfinite(r["ms"]) and r["ms"] > 0, r
        assert math.isclose(r["tflops"], 3 * 3 * 2 * m * d * f / r["ms"] / 1e9), r
        # The weights' bytes: 3 x (G·D·2F + G·F·D) x 2, the dense chain's one group.
        assert r["weight_bytes"] == 3 * (r["groups"] or 1) * 3 * d * f * 2, r
        assert r["hbm_gbps"] == record["hbm_gbps"]
        # The dense chain has these FLOPs: its rate puts the compute term at its time.
        assert math.isclose(r["roofline_ms"], max(dense_ms, r["weight_bytes"] / (r["hbm_gbps"] * 1e6))), r
        assert math.isclose(r["ratio_to_roofline"], r["ms"] / r["roofline_ms"]), r
        if r["groups"] is not None:
            assert r["tensor_sets"] == tensor_sets[r["groups"]], r


def test_out_of_memory_is_a_skipped_figure(tmp_path, monkeypatch):
    """An implementation that runs out of device memory is reported as skipped, and the run goes on."""
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes.")

    monkeypatch.setattr(grouped_matmul.harness, "median_ms", out_of_memory)  # the grouped figures', not the dense's
    path = tmp_path / "gm.json"
    assert bench.main(["grouped_matmul", "--shapes", "tiny", "--tokens", "32", "--experts", "4", "8", "--runs", "1",
                       "--calls", "1", "--json", str(path)]) == 0
    ragged = [r for r in json.loads(path.read_text())["records"] if r["implementation"] == "ragged_dot"]
    assert [r["groups"] for r in ragged] == [4, 8]
    assert all(r["skipped"].startswith("out of memory: RESOURCE_EXHAUSTED") and "ms" not in r for r in ragged), ragged


@pytest.mark.parametrize("num_rows, groups", [(256, 4), (1000, 7), (60, 16)])
def test_ops_layouts(num_rows, groups):
    """--ops's rows: routed sizes are multiples of 8 summing to at most M, even ones M // G each, one all in group 0."""
    rng = np.random.default_rng(0)
    routed = grouped_matmul.layout_group_sizes("routed", rng, num_rows, groups)
    assert routed.shape == (groups,) and (routed >= 0).all() and routed.sum() <= num_rows
    assert (routed[:-1] % grouped_matmul.ROUTED_ALIGNMENT == 0).all()  # the last may be cut at M
    assert (grouped_matmul.layout_group_sizes("even", rng, num_rows, groups) == num_rows // groups).all()
    one = grouped_matmul.layout_group_sizes("one", rng, num_rows, groups)
    assert one[0] == num_rows and not one[1:].any()


def test_ops_bench_record(tmp_path):
    """Each of the six products per layout, with the dense dot of its shape and its roofline (the products'
    weights: G·K·N bf16 read or written once)."""
    path = tmp_path / "ops.json"
    argv = ["grouped_matmul", "--ops", "--shapes", "tiny", "--tokens", "32", "--experts", "4", "--runs", "1", "--calls",
            "1", "--json", str(path)]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())["records"]
    seen = {(r["op"], r["k"], r["n"], r["layout"]) for r in records}
    d, f = 128, 64
    assert seen == {(op, k, n, layout) for op in ("fwd", "dx", "dw") for k, n in ((d, 2 * f), (f, d))
                    for layout in grouped_matmul.OPS_LAYOUTS}
    for r in records:
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["dense_ms"] > 0, r
        assert r["weight_bytes"] == r["groups"] * r["k"] * r["n"] * 2, r
        assert math.isclose(r["ratio_to_dense"], r["ms"] / r["dense_ms"]), r
    with pytest.raises(SystemExit, match="two modes"):
        bench.main([*argv[:1], "--sweep", *argv[1:]])


@pytest.mark.parametrize("step", ["dense", "grouped"])
def test_timed_steps_return_the_forward_output(step):
    """A timed step returns y beside the gradients, so the FLOPs that swiglu_flops counts are all done (with the
    gradients alone jit drops y's matmul): both against the float64 oracle, and six matmuls in the compiled
    dense step (forward 2, backward 4)."""
    rows, d, f, groups = 64, 32, 16, 3
    if step == "dense":
        x, w_gate_up, w_down, cotangent = swiglu.make_inputs(0, rows, d, f, None)
        fn, group_of_row = swiglu.dense_swiglu_forward_backward, np.zeros(rows, int)
        weights = (w_gate_up[None], w_down[None])
        compiled = fn.lower(x, w_gate_up, w_down, cotangent).compile().as_text()
        assert compiled.count(" dot(") == 6, compiled
        out = fn(x, w_gate_up, w_down, cotangent)
    else:
        x, w_gate_up, w_down, cotangent = swiglu.make_inputs(0, rows, d, f, groups)
        sizes = np.array([24, 8, 32], np.int32)
        group_of_row, weights = np.repeat(np.arange(groups), sizes), (w_gate_up, w_down)
        out = grouped_matmul.grouped_swiglu_forward_backward(x, w_gate_up, w_down, cotangent, jax.numpy.asarray(sizes),
                                                            implementation="ragged_dot")
    y, grads = jax.tree.map(lambda a: np.asarray(a, np.float64), out)
    want_y, want_grads = O.grouped_swiglu(x, *weights, cotangent, group_of_row)
    if step == "dense":
        want_grads = (want_grads[0], want_grads[1][0], want_grads[2][0])
    for name, got, want in zip(("y", "dx", "dW_gate_up", "dW_down"), (y, *grads), (want_y, *want_grads)):
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want), name
