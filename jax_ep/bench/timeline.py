"""The timeline of one jitted step: its kernels per GPU stream, from a profile (jax.profiler's Perfetto trace),
drawn as bars per stream and coloured by what they do, so that one sees which communication runs beside which
matmul. On a machine without GPUs the lanes are the host's threads (XLA's CPU ops)."""
from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile
from typing import NamedTuple

import jax

# What a kernel does, by the words in its name (checked in this order; the first that matches names it).
KINDS = (
    ("communication (jax_ep)", ("jax_ep",)),
    ("communication (NCCL)", ("nccl",)),
    ("matmul", ("matmul", "gemm", "nvjet", "cutlass", "mosaic", "dot")),
    ("other", ("",)),
)
COLOURS = {"communication (jax_ep)": "tab:red", "communication (NCCL)": "tab:orange", "matmul": "tab:blue",
           "other": "tab:gray"}


class Span(NamedTuple):
    start_us: float
    duration_us: float
    name: str


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next(kind for kind, words in KINDS if any(word in lowered for word in words))


def lanes_of(trace: dict) -> dict[str, list[Span]]:
    """{lane: its complete events, by start}: a lane per thread of the processes whose name starts with "/device:"
    (a GPU's streams) where the trace has any, else per thread of every process (the host's), leaving out the
    Python tracer's events (named "$file:line function"). Times in us from the first event shown."""
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    shown = devices or set(processes)
    lanes: dict[str, list[Span]] = {}
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in shown or e["name"].startswith("$"):
            continue
        lane = f"{processes[e['pid']]} {threads.get((e['pid'], e['tid']), e['tid'])}"
        lanes.setdefault(lane, []).append(Span(float(e["ts"]), float(e.get("dur", 0.0)), e["name"]))
    origin = min((span.start_us for spans in lanes.values() for span in spans), default=0.0)
    return {lane: sorted(Span(s.start_us - origin, s.duration_us, s.name) for s in spans)
            for lane, spans in sorted(lanes.items())}


# The host annotation under which profile() makes its calls.
TIMED_CALLS = "jax_ep.bench.timeline: timed calls"


def busy_us_per_device(trace: dict, since: str | None = None) -> dict[str, float]:
    """{device: us in which any of its streams ran an event (the union of their spans: an instant two streams share
    counts once)}, for the processes whose name starts with "/device:"; {} where the trace has none (a CPU run).
    With `since`, only the device events that start after the first host event of that name starts."""
    events = trace["traceEvents"]
    devices = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "process_name" and e["args"]["name"].startswith("/device:")}
    first = float("-inf")
    if since is not None:
        starts = [float(e["ts"]) for e in events
                  if e.get("ph") == "X" and e["pid"] not in devices and e["name"] == since]
        if not starts:
            raise ValueError(f"the trace holds no host event named {since!r}")
        first = min(starts)
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] in devices and float(e["ts"]) >= first:
            start = float(e["ts"])
            spans.setdefault(devices[e["pid"]], []).append((start, start + float(e.get("dur", 0.0))))
    busy = {}
    for device, intervals in spans.items():
        total, covered_to = 0.0, float("-inf")
        for start, end in sorted(intervals):
            if end > covered_to:
                total += end - max(start, covered_to)
                covered_to = end
        busy[device] = total
    return busy


def profile(fn, args, calls: int = 1, before=None) -> dict:
    """The Perfetto trace (a dict) of `calls` back-to-back calls of `fn(*args)`, made under the host annotation
    TIMED_CALLS, after a call that compiles it; `before()` runs inside the trace ahead of them (a barrier of the
    processes, so that the first call's collectives do not wait for a peer still starting its profiler)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            if before is not None:
                before()
            with jax.profiler.TraceAnnotation(TIMED_CALLS):
                out = None
                for _ in range(calls):
                    out = fn(*args)
                jax.block_until_ready(out)
        (path,) = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            return json.load(f)


def write_json(lanes: dict[str, list[Span]], path: str) -> None:
    """The lanes as JSON: {lane: [[start_us, duration_us, name, kind], ...]}, for a per-kernel breakdown."""
    with open(path, "w") as f:
        json.dump({lane: [[s.start_us, s.duration_us, s.name, kind_of(s.name)] for s in spans]
                   for lane, spans in lanes.items()}, f)


def plot(plt, lanes: dict[str, list[Span]], path: str, title: str) -> None:
    """PNG: a row per lane, a bar per event, coloured by kind_of its name."""
    fig, ax = plt.subplots(figsize=(14, 1 + 0.45 * max(1, len(lanes))))
    for row, spans in enumerate(lanes.values()):
        for kind, colour in COLOURS.items():
            bars = [(s.start_us / 1e3, s.duration_us / 1e3) for s in spans if kind_of(s.name) == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colour, label=kind)
    ax.set_yticks(range(len(lanes)), [lane[-48:] for lane in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the step's first event", title=title)
    handles = {label: handle for handle, label in zip(*ax.get_legend_handles_labels())}  # one entry per kind
    ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
