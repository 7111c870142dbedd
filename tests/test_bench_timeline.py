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


def test_busy_time_per_device_counts_overlaps_once():
    # GPU 0: stream 13 busy over [100, 150) and [160, 165), stream 20 over [130, 170): the union is [100, 170), 70 us.
    # GPU 1: [0, 10) and [20, 25) on one stream, 15 us. The host's event is no device's.
    trace = {"traceEvents": [
        meta(1, "/host:CPU"), complete(1, 5, 0.0, 1000.0, "step"),
        meta(2, "/device:GPU:0"), complete(2, 13, 100.0, 50.0, "a"), complete(2, 13, 160.0, 5.0, "b"),
        complete(2, 20, 130.0, 40.0, "c"),
        meta(3, "/device:GPU:1"), complete(3, 7, 20.0, 5.0, "d"), complete(3, 7, 0.0, 10.0, "e"),
    ]}
    assert timeline.busy_us_per_device(trace) == {"/device:GPU:0": 70.0, "/device:GPU:1": 15.0}


def test_busy_time_without_devices():
    trace = {"traceEvents": [meta(1, "/host:CPU"), complete(1, 5, 0.0, 10.0, "step")]}
    assert timeline.busy_us_per_device(trace) == {}


def test_busy_time_since_a_host_annotation():
    # The device events that start before the host's "timed" event (a barrier's, at 0-40 us) are left out.
    trace = {"traceEvents": [
        meta(1, "/host:CPU"), complete(1, 5, 50.0, 500.0, "timed"), complete(1, 5, 60.0, 5.0, "timed"),
        meta(2, "/device:GPU:0"), complete(2, 13, 0.0, 40.0, "barrier"), complete(2, 13, 55.0, 20.0, "a"),
        complete(2, 20, 45.0, 30.0, "late barrier"), complete(2, 13, 80.0, 10.0, "b"),
    ]}
    assert timeline.busy_us_per_device(trace, since="timed") == {"/device:GPU:0": 30.0}
    with pytest.raises(ValueError, match="no host event named 'missing'"):
        timeline.busy_us_per_device(trace, since="missing")


def test_profile_annotates_the_calls():
    import jax
    import jax.numpy as jnp

    ran = []
    trace = timeline.profile(jax.jit(lambda a: a * 2), (jnp.ones(4),), calls=3, before=lambda: ran.append(1))
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert ran == [1] and names.count(timeline.TIMED_CALLS) == 1, names
