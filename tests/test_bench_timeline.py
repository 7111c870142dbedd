"""jax_ep.bench.timeline on a trace written by hand: which events make lanes, their times from the first event
shown, and the kind each kernel name is given."""
from __future__ import annotations

import pytest

from jax_ep.bench import timeline


def meta(pid, name, tid=None):
    event = {"ph": "M", "pid": pid, "name": "process_name" if tid is None else "thread_name", "args": {"name": name}}
    return event if tid is None else {**event, "tid": tid}


def complete(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_device_streams_are_the_lanes():
    trace = {"traceEvents": [
        meta(1, "/host:CPU"), meta(1, "python", tid=5), complete(1, 5, 10.0, 500.0, "step"),
        meta(2, "/device:GPU:0"), meta(2, "Stream #13", tid=13), meta(2, "Stream #20", tid=20),
        complete(2, 20, 130.0, 40.0, "jax_ep::(anonymous namespace)::expert_major_dispatch_kernel"),
        complete(2, 13, 100.0, 50.0, "ragged_rows_matmul"),
        complete(2, 13, 160.0, 5.0, "loop_fusion"),
    ]}
    lanes = timeline.lanes_of(trace)
    assert lanes == {
        "/device:GPU:0 Stream #13": [timeline.Span(0.0, 50.0, "ragged_rows_matmul"),
                                     timeline.Span(60.0, 5.0, "loop_fusion")],
        "/device:GPU:0 Stream #20": [timeline.Span(30.0, 40.0,
                                                   "jax_ep::(anonymous namespace)::expert_major_dispatch_kernel")],
    }


def test_host_threads_without_devices():
    trace = {"traceEvents": [meta(1, "/host:CPU"), meta(1, "python", tid=5), complete(1, 5, 7.0, 3.0, "step"),
                             complete(1, 5, 1.0, 90.0, "$profiler.py:307 trace"), complete(1, 6, 9.0, 1.0, "dot.3")]}
    assert timeline.lanes_of(trace) == {"/host:CPU 6": [timeline.Span(2.0, 1.0, "dot.3")],
                                        "/host:CPU python": [timeline.Span(0.0, 3.0, "step")]}


@pytest.mark.parametrize("name, kind", [
    ("void jax_ep::(anonymous namespace)::combine_kernel<1>(...)", "communication (jax_ep)"),
    ("ncclDevKernel_AllToAll", "communication (NCCL)"),
    ("nvjet_hsh_128x256", "matmul"),
    ("ragged_contraction_matmul", "matmul"),
    ("loop_multiply_fusion", "other"),
])
def test_kind_of(name, kind):
    assert timeline.kind_of(name) == kind
