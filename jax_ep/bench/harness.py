"""What every benchmark mode shares: the EP mesh and its inputs, the timed loops, the arguments common to the modes,
the launcher of one process per GPU with its shared-GPU labelling, and the JSON and plot output (`run`).

Two ways of timing, for two kinds of op:
- `time_per_op` (communication ops, microseconds): jitted sequences of n and 2n chained ops; the difference of
  their wall times over n, median over repeats, so that the fixed cost of launching a program cancels out.
- `median_ms` (compute, milliseconds): median over runs of back-to-back calls of one jitted step, one
  block_until_ready per run, after a warm-up; `alternating_median_ms` for several steps whose runs take turns.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _native, environment

# What every line and JSON record of a run whose ranks share GPUs says.
SHARED_GPU_LABEL = "[shared GPU: not a performance figure] "
# Why a mode whose step runs XLA's collectives across the ranks refuses ranks that share a GPU (its
# shared_gpu_refusal, which run asks before launching).
NEEDS_NCCL = "its step runs XLA's collectives across the ranks, NCCL's, which refuse two ranks on one GPU"
# What a run on a machine without a GPU says beside its figures.
NOT_ON_A_GPU = "not on a GPU: these times are not performance figures"

PROCESS_MODELS_HELP = """\
Process models (docs/design.md, "Process models"): by default one process drives every local GPU. With
`--processes N` this command is a launcher: it starts N copies of itself, process i owning GPU i mod G (G: the
host's GPUs, or `--gpus G`), joined through `jax.distributed` on localhost, which run the same measurements over
the global mesh (collectively: the same programs in the same order); process 0 prints and writes --json/--plot,
the others' output is shown only when they fail. More processes than GPUs means ranks share GPUs, whose timings
are not performance figures: the launcher refuses unless given `--allow-shared-gpu`, and then every line printed
starts with that warning and every JSON record carries it. With JAX_PLATFORMS=cpu each process owns one CPU
device and collectives go through gloo (for testing). Across hosts, run the launcher on every host with
`--nodes M --node-rank i --coordinator HOST:PORT` (host 0's address): host i starts processes i*N .. i*N+N-1 of
the M*N."""


# ---- arguments -------------------------------------------------------------------------------------------------

# The process model of a mode without add_process_arguments, and those arguments' defaults: this one process.
ONE_PROCESS = dict(processes=0, nodes=1, node_rank=0, coordinator=None, process_id=None, shared_gpu=False)


def mode_parser(mode: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m jax_ep.bench {mode}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(**ONE_PROCESS)
    return parser


def add_output_arguments(parser: argparse.ArgumentParser, plot_help: str | None = None) -> None:
    """--json, and --plot where the mode draws one (`plot_help` says what)."""
    parser.add_argument("--json", help="write every figure to this file")
    if plot_help:
        parser.add_argument("--plot", help=plot_help)
    else:
        parser.set_defaults(plot=None)


def add_ranks_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=0, help="GPUs to use (default: every local GPU)")


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """--ranks and the process model: one process driving every GPU, or --processes N (see PROCESS_MODELS_HELP).
    The arguments named in ONE_PROCESS take their defaults from there (mode_parser)."""
    parser.epilog = PROCESS_MODELS_HELP
    add_ranks_argument(parser)
    parser.add_argument("--processes", type=int,
                        help="run this many ranks as processes, process i owning GPU i mod G (see --gpus), instead of "
                             "one process driving every GPU")
    parser.add_argument("--gpus", type=int, default=0,
                        help="with --processes: the host's GPUs to spread the processes over (default: every GPU it "
                             "has)")
    parser.add_argument("--allow-shared-gpu", action="store_true",
                        help="with --processes: run even with more processes than GPUs (ranks sharing a GPU: for "
                             "correctness only; every figure is labelled as not a performance figure)")
    parser.add_argument("--deadline", type=float, default=1800,
                        help="with --processes: seconds after which the processes still running are killed")
    parser.add_argument("--nodes", type=int,
                        help="with --processes: hosts running the launcher (each starts --processes workers)")
    parser.add_argument("--node-rank", type=int, help="with --nodes: this host's index")
    parser.add_argument("--coordinator", help="with --nodes: HOST:PORT of the jax.distributed coordinator "
                                              "(on host 0; default: a free port on localhost)")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # a worker of --processes
    parser.add_argument("--local-device", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shared-gpu", action="store_true", help=argparse.SUPPRESS)


# The options that size a communication mode's problem (its GPU_SIZES; see refuse_gpu_sizes_without_gpu).
COMMUNICATION_SIZES = ("tokens", "hidden", "topk", "experts")


def add_communication_arguments(parser: argparse.ArgumentParser, shape: tuple[int, int, int, int]) -> None:
    """The routing shape (default `shape`: tokens per rank, hidden, top-k, experts), the timed loops of
    `time_per_op` and the pure-JAX baselines, common to the intranode, internode and low_latency modes."""
    tokens, hidden, topk, experts = shape
    parser.add_argument("--tokens", type=int, default=tokens, help="tokens per rank (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=hidden, help="default %(default)s")
    parser.add_argument("--topk", type=int, default=topk, help="default %(default)s")
    parser.add_argument("--experts", type=int, default=experts, help="default %(default)s")
    parser.add_argument("--iters", type=int, default=20, help="ops per timed jitted loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="skip the pure-JAX baselines (ragged_all_to_all MaxText-style, dense all_to_all; for "
                             "low_latency also jax_ep's xla backend)")


def add_sms_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sms", type=int, nargs="*", default=[24],
                        help="Config.num_sms values for the cuda backend (none: skip the cuda backend)")


# ---- the EP mesh and its inputs ----------------------------------------------------------------------------------

def process_model(args) -> str:
    return "one process per GPU" if args.processes else "one process, all GPUs"


def ep_mesh(args) -> Mesh:
    """The EP mesh: with --processes every device of the job (one per process), else this process's devices."""
    devices = jax.devices() if args.processes else jax.local_devices()[: args.ranks or None]
    if args.processes and len(devices) != args.processes * args.nodes:
        raise RuntimeError(f"--processes {args.processes} on {args.nodes} host(s): the job has {len(devices)} devices, "
                           "want one per process")
    return Mesh(np.array(devices), ("ep",))


def on_gpu(mesh: Mesh) -> bool:
    return mesh.devices.flat[0].platform == "gpu"


def global_array(mesh: Mesh, values: np.ndarray) -> jax.Array:
    """`values` (the whole [R*n, ...] input, identical in every process: same seed) as a global array, rows
    sharded over the EP axis; each process transfers only the rows of its own devices."""
    return jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("ep")), lambda index: values[index],
                                        dtype=values.dtype)


def random_topk_idx(rng: np.random.Generator, num_ranks: int, num_tokens: int, num_topk: int,
                    num_experts: int) -> np.ndarray:
    """DeepEP's test routing: the top-k of random scores, so every token has k distinct experts."""
    scores = rng.random((num_ranks * num_tokens, num_experts))
    return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def routed_tokens(mesh: Mesh, args) -> tuple[np.ndarray, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """The intranode and internode modes' inputs, the same in every process (seed 0): DeepEP's test routing of
    --tokens per rank over --experts (on the host, and as a global array), and BF16 tokens [R*T, --hidden], also
    as the FP8 pair."""
    num_ranks = mesh.devices.size
    rng = np.random.default_rng(0)
    topk_idx_host = random_topk_idx(rng, num_ranks, args.tokens, args.topk, args.experts)
    x = global_array(mesh, rng.standard_normal((num_ranks * args.tokens, args.hidden), dtype=np.float32)
                     .astype(jnp.bfloat16))
    return topk_idx_host, global_array(mesh, topk_idx_host), x, spmd(mesh, jax_ep.per_token_cast_to_fp8)(x)


def expert_major_ops(mesh: Mesh, buf, topk_idx, x, num_experts: int, mode: str):
    """The expert-major ops of `buf` as the communication benchmarks time them beside the rank-major ones: returns
    (dispatch(idx, payload), combine(handle, y, weights), the combine's arguments), the dispatch with unit top-k
    weights and the combine weighted by recv_weights. The capacity is the most pairs a rank receives here, rounded up
    to 128, as a user sets it (capacity_factor): the no-drop default, R*T*min(K, L) rows, holds 1.9 GB per rank at
    R=4 and DeepEP's shape, and a timed loop keeps each op's result alive (the work follows the pairs received
    either way)."""
    def dispatch(idx, payload, capacity=None):
        return jax_ep.dispatch(buf, payload, idx, jnp.ones_like(idx, jnp.float32), num_experts=num_experts,
                               max_recv_tokens=capacity, layout="expert_major")

    most = spmd(mesh, lambda i, p: jax.lax.pmax(dispatch(i, p).num_recv_tokens, "ep")[None])(topk_idx, x)
    capacity = -(-int(most.addressable_shards[0].data[0]) // 128) * 128  # the same on every rank
    print(f"[{mode}] expert-major capacity {capacity} rows per rank (the most pairs a rank receives here, rounded up "
          "to 128)", flush=True)

    def capped(idx, payload):
        return dispatch(idx, payload, capacity)

    def combine(handle, y, weights):
        return jax_ep.combine(buf, y, handle, weights=weights).x

    em = spmd(mesh, lambda i, p: (lambda r: (r.handle, r.recv_x, r.recv_weights))(capped(i, p)))(topk_idx, x)
    return capped, combine, em


def spmd(mesh: Mesh, body):
    # check_vma off: the loop carries start as zeros, which are not varying over the EP axis.
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=False))


@functools.cache
def rank_barrier(mesh: Mesh):
    """A function that returns once every rank of `mesh` has reached it (a psum over the EP axis, waited for).
    With one process per GPU each process times its own calls: without it, a timed run that starts while a peer
    is still busy also holds that skew, which the first collective or kernel of the ranks waits out."""
    reduce = spmd(mesh, lambda v: jax.lax.psum(v, "ep"))
    ones = global_array(mesh, np.ones(mesh.devices.size, np.float32))

    def barrier() -> None:
        jax.block_until_ready(reduce(ones))

    barrier()  # compiled before anything is timed
    return barrier


# ---- timed loops of communication ops ----------------------------------------------------------------------------

def depend(tree, value):
    """`tree` with a run-time zero derived from `value` added to every integer leaf (the routing, small unlike
    the payloads), so consecutive ops can neither be merged (CSE), hoisted nor overlapped."""
    zero = jnp.asarray(value, jnp.float32) * 0
    return jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.integer) else a, tree)


def _touch(data, value):
    """`data` with a run-time zero derived from `value` added to one element of every floating array: a
    one-element in-place update, so a payload path that does not depend on the routing (an all_gather of x)
    cannot be computed once for a whole timed sequence."""
    zero = jnp.asarray(value, jnp.float32) * 0
    return jax.tree.map(lambda a: a.at[(0,) * a.ndim].add(zero.astype(a.dtype))
                        if jnp.issubdtype(a.dtype, jnp.floating) else a, data)


def _timed_loop(mesh, op, iters: int, unroll: bool = True, chain_data: bool = False):
    """jit(shard_map(...)) running `op(routing, *data)` `iters` times in a row, unrolled: an XLA while loop
    adds a host round trip per iteration, which is the loop's cost, not the op's (the ragged_all_to_all
    baseline keeps the loop: unrolled, XLA reserves collective memory for every call). One element of each
    op's output feeds the next op's routing (and with `chain_data` one element of every floating data
    array, see `_touch`). A custom call always writes all its outputs; for the pure-JAX
    baselines XLA may skip local work after the collective that the probe does not need (which only
    flatters them)."""

    def body(routing, *data):
        def step(_, carry):
            routing, data, total = carry
            out = op(routing, *data)
            probe = jax.tree.leaves(out)[0].ravel()[0].astype(jnp.float32)
            return depend(routing, probe), _touch(data, probe) if chain_data else data, total + probe

        return jax.lax.fori_loop(0, iters, step, (routing, data, jnp.float32(0)), unroll=unroll)[2][None]

    return spmd(mesh, body)


def time_per_op(mesh, op, fn_args, args, unroll: bool = True, before_timing=None, chain_data: bool = False) -> float:
    """Seconds per op: (time of a sequence of 2n ops - time of n ops) / n, median over repeats. The fixed
    cost of launching a program on every device and waiting for it cancels out."""
    short, long = (_timed_loop(mesh, op, n, unroll, chain_data) for n in (args.iters, 2 * args.iters))
    for fn in (short, long):
        jax.block_until_ready(fn(*fn_args))  # compile and warm up
    if before_timing:
        before_timing()

    def wall(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        return time.perf_counter() - start

    return statistics.median((wall(long) - wall(short)) / args.iters for _ in range(args.repeats))


def timed_with_kernels(mesh, op, fn_args, args, kernel_times) -> tuple[float, float | None]:
    """(in-jit seconds per op, bare kernel seconds per op) of a jax_ep kernel op; kernel_times(reset=False) gives
    [(calls, summed ns)] per GPU of this process (the kernels' own %globaltimer spans). Without the
    instrumented build the kernels keep no times: (seconds, None)."""
    if not _native.with_instrumentation():
        return time_per_op(mesh, op, fn_args, args), None
    seconds = time_per_op(mesh, op, fn_args, args, before_timing=lambda: kernel_times(reset=True))
    return seconds, float(np.mean([ns / calls for calls, ns in kernel_times()])) * 1e-9


# ---- timed steps of compute --------------------------------------------------------------------------------------

def median_ms(fn, input_sets, runs: int, calls: int, warmup: int = 2, before_run=None) -> float:
    """Median over `runs` of the time per call of `calls` back-to-back calls (one block_until_ready per
    run), the calls rotating through input_sets. Only the last call's outputs are kept and waited for: the
    calls run in order on each device, and the outputs of a training step can be as large as its weights.
    before_run(), where given, runs before each run's clock starts (rank_barrier: the ranks start together)."""
    return alternating_median_ms({"": (fn, input_sets)}, runs, calls, warmup, before_run)[""]


def alternating_median_ms(steps: dict, runs: int, calls: int, warmup: int = 2, before_run=None) -> dict[str, float]:
    """median_ms of each of `steps` ({name: (fn, input_sets)}), their runs taken in turn (the order reversed
    every other run): a GPU's clock drifts with its temperature over a benchmark, and figures to be compared
    (a block and its roofline proxy) are then taken under the same conditions rather than one after the other."""
    cycles = {name: itertools.cycle(input_sets) for name, (_, input_sets) in steps.items()}
    for name, (fn, _) in steps.items():
        for _ in range(warmup):
            jax.block_until_ready(fn(*next(cycles[name])))
    per_call = {name: [] for name in steps}
    for run in range(runs):
        for name in (list(steps) if run % 2 == 0 else list(reversed(steps))):
            fn, sets = steps[name][0], cycles[name]
            if before_run is not None:
                before_run()
            start = time.perf_counter()
            out = None
            for _ in range(calls):
                out = fn(*next(sets))
            jax.block_until_ready(out)
            per_call[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(times) * 1e3 for name, times in per_call.items()}


# ---- one process per GPU -----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(procs: list[subprocess.Popen], deadline_s: float, grace_s: float = 20.0) -> list[int | None]:
    """Exit codes of `procs`, None for the ones killed: at `deadline_s`, or `grace_s` after the first one failed
    (its peers then wait in collectives that it never joins)."""
    deadline, failed = time.monotonic() + deadline_s, False
    while None in (codes := [proc.poll() for proc in procs]) and time.monotonic() < deadline:
        if not failed and any(code not in (None, 0) for code in codes):
            failed, deadline = True, min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    _kill_running(procs)
    return codes


def _kill_running(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cuda_device_count() -> int:
    """The GPUs this process sees, asked of the CUDA driver: the launcher starts no JAX backend, which would hold
    GPU memory beside its workers."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


class _LabelledLines:
    """A text stream that starts every line written to it with `label`."""

    def __init__(self, stream, label: str):
        self.stream, self.label, self.at_line_start = stream, label, True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            pieces.append(self.label + piece if self.at_line_start else piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(pieces))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def _label_shared(records):
    """Marks a mode's JSON (a list of records, or a dict) as taken on shared GPUs."""
    for record in records if isinstance(records, list) else [records]:
        record["not_a_performance_figure"] = "ranks shared GPUs"
    return records


def _launch(args, argv: list[str], gpus: int) -> int:
    """--processes N: runs N copies of this command (`argv`, the mode first), process i owning GPU i mod `gpus`
    (every process sees every GPU, for CUDA IPC), joined through jax.distributed on a free localhost port.
    Process 0's output passes through, the others' goes to log files whose last lines are printed when they
    fail. Returns 0 when all succeeded."""
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    first = args.node_rank * args.processes  # this host's first process
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding jax_ep/
    env = environment.for_subprocess(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if environment.runs_on_cpu():  # one CPU device per process
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    with tempfile.TemporaryDirectory(prefix="jax_ep_bench_") as logdir:
        logs = [open(Path(logdir) / f"process{i}.log", "w+") for i in range(args.processes)]
        procs = []
        # Killed by a deadline of its own (SIGTERM), the launcher takes its workers with it (the finally below).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            for i, log in enumerate(logs):
                command = [sys.executable, "-m", "jax_ep.bench", *argv, "--process-id", str(first + i),
                           "--local-device", str(i % gpus), "--coordinator", coordinator]
                if args.processes > gpus:
                    command.append("--shared-gpu")
                procs.append(subprocess.Popen(command, env=env, stdout=None if i == 0 else log,
                                              stderr=None if i == 0 else log))
            codes = _wait_for(procs, args.deadline)
        finally:  # the launcher itself failed or was interrupted
            _kill_running(procs)
        for i, (code, log) in enumerate(zip(codes, logs)):
            if code == 0:
                continue
            what = f"exited with code {code}" if code is not None else "was killed (deadline, or a peer failed)"
            log.seek(0)
            tail = "its output is above" if i == 0 else "last lines:\n" + "".join(log.readlines()[-40:])
            print(f"[bench] process {first + i} of {args.processes * args.nodes} {what}; {tail}", file=sys.stderr,
                  flush=True)
        for log in logs:
            log.close()
    return 0 if codes == [0] * args.processes else 1


def _join(args) -> None:
    """A worker of --processes joins jax.distributed as process `process_id`: on GPU owning its host's GPU
    `local_device` only, on CPU with its CPU device (gloo collectives)."""
    owned = {}
    if environment.runs_on_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
        owned["local_device_ids"] = [args.local_device]
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes * args.nodes,
                               process_id=args.process_id, initialization_timeout=120, **owned)


# ---- output ------------------------------------------------------------------------------------------------------

def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend), or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _write_outputs(mode, args, records) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot:
        plt = pyplot()
        if plt is None:
            print(f"[bench] matplotlib is not installed: no plot written to {args.plot} (pip install matplotlib)",
                  flush=True)
        else:
            mode.plot(plt, records, args.plot)


# ---- a mode's run ------------------------------------------------------------------------------------------------

# Seconds a failed process 0 stays up (hosting the coordination service) before it exits: see run.
WORKER_EXIT_GRACE_S = 3.0


def refuse_gpu_sizes_without_gpu(mode, args, parser: argparse.ArgumentParser, has_gpu: bool) -> None:
    """A mode whose default sizes are GPU figures (its GPU_SIZES: the options that size its problem) stops with one
    line on a machine without GPUs when none of those options was changed, or only `--shapes` to shapes that are
    GPU figures too (the mode's GPU_SHAPES): at those sizes the run would take minutes to hours and tens of GB of
    host memory, and print no performance figure. Smaller sizes run anywhere (the harness's own tests do)."""

    def smaller(name: str) -> bool:
        value = getattr(args, name)
        if name == "shapes":
            return value != parser.get_default(name) and not set(value) & set(getattr(mode, "GPU_SHAPES", ()))
        return value != parser.get_default(name)

    sizes = getattr(mode, "GPU_SIZES", ())
    if has_gpu or not sizes or any(smaller(name) for name in sizes):
        return
    options = " ".join("--" + name.replace("_", "-") for name in sizes)
    raise SystemExit(f"{parser.prog}: needs NVIDIA GPUs (none found); its default sizes are GPU benchmark figures. "
                     f"To try it on this machine, give smaller sizes ({options})")


def run(mode, args, argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Runs `mode` (a module with run(args) -> records and, where it takes --plot, plot(plt, records, path)) with
    its parsed `args`: in this process, or with --processes as the launcher of its workers (`argv`: this
    command's arguments, the mode first), or as one of those workers. Process 0 writes --json and --plot."""
    if args.processes < 0 or (args.processes and args.ranks not in (0, args.processes)):
        parser.error("--processes N runs N ranks, one per process (leave --ranks out)")
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes or (args.nodes > 1 and not args.coordinator):
        parser.error("--nodes M needs --node-rank in [0, M) and --coordinator HOST:PORT")
    if args.processes and args.process_id is None:
        cuda_gpus = 0 if environment.runs_on_cpu() else _cuda_device_count()
        refuse_gpu_sizes_without_gpu(mode, args, parser, has_gpu=cuda_gpus > 0)
        gpus = args.gpus or cuda_gpus or args.processes
        if args.processes > gpus and not args.allow_shared_gpu:
            parser.error(f"--processes {args.processes} on {gpus} GPU(s): ranks would share GPUs, so no figure would "
                         "be a performance figure; pass --allow-shared-gpu to run anyway (correctness, smoke tests)")
        # A mode's shared_gpu_refusal(args): why this run cannot have ranks share a GPU, or None.
        if args.processes > gpus and (reason := getattr(mode, "shared_gpu_refusal", lambda _: None)(args)):
            parser.error(f"--processes {args.processes} on {gpus} GPU(s): {reason}")
        return _launch(args, argv, gpus)
    if args.process_id is not None:
        _join(args)  # a worker: its launcher has checked the sizes
    else:
        refuse_gpu_sizes_without_gpu(mode, args, parser, has_gpu=jax.default_backend() == "gpu")
    if args.shared_gpu:
        sys.stdout = _LabelledLines(sys.stdout, SHARED_GPU_LABEL)
    try:
        records = mode.run(args)
        if args.shared_gpu:
            _label_shared(records)
        if jax.process_index() == 0:
            _write_outputs(mode, args, records)
    except BaseException:
        if args.process_id is None:
            raise
        # A failed worker exits without jax.distributed's shutdown, which would wait for peers stuck in
        # collectives. Process 0 hosts the coordination service: it first gives its peers a moment, so that one
        # still joining reports its own error instead of aborting on a lost coordinator.
        traceback.print_exc()
        sys.stderr.flush()
        if args.process_id == 0:
            time.sleep(WORKER_EXIT_GRACE_S)
        os._exit(1)
    return 0
