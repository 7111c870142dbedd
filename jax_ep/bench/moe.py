"""moe: the jax_ep.flax.MoE block, forward + backward, bfloat16, per shape and dispatcher, beside the dense proxy of
the same FLOPs measured in the same run, and where the block's time goes.

Shapes (--shapes, whose help lists their D, F, E and K): "moe-a" (issue 20's), "v3" (DeepSeek-V3-like) and "tiny"
(tests on CPU); --d-model, --d-ff, --experts and --topk replace those of every shape listed (then named "NAME,
modified"). R ranks, the local devices or --ranks (one process driving them) or --processes R (one process per GPU),
each hold E/R of the experts (one GPU holds them all); --tokens is per rank. With --processes each process times
its own calls and process 0 prints. Dispatchers (--dispatchers): "normal" (jax_ep.dispatch / combine on a Buffer of the
"auto" backend: the cuda kernels where they were built and the devices are GPUs, else the xla backend) and "xla".

Per shape and dispatcher:
- block: the block's output y and the pullback of a random cotangent of y to its parameters and x, one jitted
  step: the block's forward and backward as a layer of a model runs them (y returned: the gradients alone do not
  read the forward's combine, and jit would drop it).
- dense proxy (with each block): one dense bf16 SwiGLU, forward + backward, on T·K rows with D×F weights, y
  returned likewise (jax_ep.bench.swiglu): one rank's expert FLOPs at dense-matmul speed, without routing or
  communication (the roofline's compute term). ratio = block / proxy; the target is at most TARGET_RATIO.
- FLOPs per rank (swiglu_flops): T·K rows through the SwiGLU; forward 3 matmuls of 2·rows·D·F, backward twice
  the forward, so 18·T·K·D·F; TFLOP/s = FLOPs / time, for the block and the proxy.
- roofline (jax_ep.bench.swiglu), of the block and of its expert FFN stage: the larger of the FLOPs per rank at the
  dense proxy's rate (the proxy's time) and the bytes of one rank's E/R experts' weights that forward + backward
  moves, 3 x (G·D·2F + G·F·D) x 2 with G = E/R (read by the forward and by dx, written by dW), at the HBM bandwidth
  of a copy timed at the start of the run (each process its own GPU's; process 0's printed). With many experts per
  rank the weights bind (v3 at R=1: 67.6 GB, some 16 ms at 4 TB/s, beside the proxy's 13 ms on an H200), where
  the dense proxy, which reads one D×F set of weights, is no bound. The expert FFN stage is also printed over the
  dense proxy (the same FLOPs, forward + backward, y returned by both) and over its roofline, with a proxy timed in
  turns with the stage over as many calls a run (--stage-calls), not the block's (--calls): under the GPU's power
  cap a kernel's clock depends on how long the GPU has run without a pause, so a ratio compares two figures taken
  the same way.
- breakdown: router (jax_ep.flax.routing.route), dispatch (jax_ep.dispatch, expert-major), expert FFN
  (jax_ep.flax.experts.grouped_swiglu) and combine (jax_ep.combine, weighted), each forward + backward alone in a jitted
  shard_map of its own, on the inputs the stages before it produce from the block's x and weights, with random
  cotangents of its outputs' shapes. Their sum is printed beside the block; the difference is what the block does
  besides (router statistics, casts) and what XLA overlaps or fuses across the stages.
- GPU time of each stage (on a GPU): the time in which this process's GPU ran the stage's kernels, per call, from a
  profile of GPU_TIME_CALLS calls after a barrier of the ranks (jax_ep.bench.timeline.busy_us_per_device). Timed by
  the wall clock over a few calls, a stage of 0.1-0.5 ms also carries the host's launch of its first call and the
  wait for its last; inside the block nothing launches a stage alone. Where both dispatchers ran, their dispatch
  and combine stages are compared both ways. Under the profiler the host issues calls more slowly (about 11 ms a
  call of moe-a's expert FFN stage, jax 0.11.2), so a stage shorter than that runs with the GPU resting between
  calls, at a higher clock (an H200: 1965 MHz, against 1400-1550 back to back, where its 700 W power cap holds
  it): its GPU time is below what its kernels take back to back (moe-a's expert FFN: 2.35 ms on the GPU, 2.71 ms
  by the wall clock; docs/perf-log.md, 2026-11-29).
- compute stages: router + expert FFN of the breakdown. The block over them says how much of the communication
  the block hides: 1.0 would be all of it (each stage timed alone also pays its own launch, ~0.1 ms).
- hidden: the share of the communication stages (dispatch + combine) that the block did not add to its time,
  (sum of the stages - block) / (dispatch + combine); 0 when the block costs what its stages cost one after another.
- --timeline PATH: one step of each block timed (each dispatcher and --num-chunks value) profiled, its kernels per
  GPU stream drawn to PATH with "-SHAPE-DISPATCHER" (and "-N-chunks" for N > 1) before its suffix
  (jax_ep.bench.timeline), and listed (start, duration, name, kind) in the same name with the suffix .json.
- --num-chunks N [M ...]: the block with each num_chunks (its tokens through dispatch, experts and combine in
  chunks, so that XLA may overlap one chunk's communication with another's matmuls), timed in the same run; the
  breakdown is taken once, unchunked.
Timing (harness.median_ms): median over --runs of --calls back-to-back calls (--stage-calls for each stage of the
breakdown: a short stage timed over a few calls mostly measures the first call's launch), after a warm-up, each run
after a barrier of the ranks (harness.rank_barrier: with one process per GPU a run's clock would otherwise also hold
how far this process started ahead of its peers); the block's runs and its proxy's take turns
(harness.alternating_median_ms), so that both are timed at the same GPU clock (which drifts by several per cent
over a run as the GPU warms).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.bench import harness, swiglu, timeline
from jax_ep.bench.swiglu import (
    DTYPE,
    SHAPES,
    SHAPES_TOKENS,
    MoEShape,
    dense_swiglu_step,
    expert_weight_bytes,
    hbm_gbps,
    hbm_text,
    roofline,
    roofline_fields,
    roofline_text,
    shapes_help,
    swiglu_flops,
)
from jax_ep.flax import MoE
from jax_ep.flax.experts import grouped_swiglu
from jax_ep.flax.routing import route


DISPATCHERS = ("normal", "xla")
# Calls per timed run of a stage (--stage-calls): a run of 3 calls of a 0.2 ms stage also holds a third of the
# first call's launch and of the wait for the last, ~0.1 ms per call for either dispatcher (docs/perf-log.md).
STAGE_CALLS = 20
STAGES = ("router", "dispatch", "expert FFN", "combine")
TARGET_RATIO = 1.5  # issue 20's acceptance: the block's forward + backward at most 1.5x the dense proxy


# Options that size the problem: at their defaults the mode refuses to run without GPUs (harness).
GPU_SIZES = ("shapes", "tokens", "d_model", "d_ff", "experts", "topk")
GPU_SHAPES = swiglu.GPU_SHAPES  # naming them keeps a run at GPU sizes


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["moe-a", "v3"],
                        help=shapes_help() + " (default: %(default)s)")
    parser.add_argument("--dispatchers", nargs="+", choices=DISPATCHERS, default=list(DISPATCHERS))
    parser.add_argument("--tokens", type=int, default=SHAPES_TOKENS, help="tokens per rank (default %(default)s)")
    for field in MoEShape._fields:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, help="replaces the shapes' own")
    parser.add_argument("--num-chunks", type=int, nargs="+", default=[1],
                        help="the block's num_chunks values, each timed in the same run (its tokens through dispatch, "
                             "experts and combine in chunks; the breakdown's stages take the whole batch)")
    parser.add_argument("--sms", type=int,
                        help="the normal dispatcher's kernels on this many SMs (a Buffer with Config(num_sms=N) passed "
                             "to the block; default: the block's own Buffer, every SM but the 32 that "
                             "jax_ep.flax.moe.block_config leaves to XLA's collectives)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per figure (the median is reported)")
    parser.add_argument("--calls", type=int, default=3, help="back-to-back calls per timed run of the block and its "
                                                             "proxy")
    parser.add_argument("--stage-calls", type=int, default=STAGE_CALLS,
                        help="back-to-back calls per timed run of each stage of the breakdown (default %(default)s)")
    parser.add_argument("--remat", action="store_true",
                        help="also print XLA's temporary memory of a few blocks in a row with and without jax.checkpoint")
    parser.add_argument("--timeline", help="write a PNG of one block step's kernels per GPU stream, per shape and "
                                           "dispatcher (PATH gets -SHAPE-DISPATCHER before its suffix)")
    harness.add_output_arguments(parser, plot_help="write a PNG bar chart of the breakdown per shape and dispatcher")


def _shapes(args) -> list[tuple[str, MoEShape]]:
    overrides = {field: getattr(args, field) for field in MoEShape._fields if getattr(args, field) is not None}
    shapes = []
    for name in args.shapes:
        shape = SHAPES[name]._replace(**overrides)
        shapes.append((name if shape == SHAPES[name] else f"{name}, modified", shape))
    return shapes


def _placed(value: jax.Array, sharding) -> jax.Array:
    """`value` placed as `sharding` says. With one process per GPU a sharding spans devices of other processes: a
    value on this process's devices alone (the whole array, the same in every process) goes there by each process
    transferring its own devices' parts from a host copy."""
    if sharding.is_fully_addressable or not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _random(key, shape, dtype, sharding) -> jax.Array:
    return _placed(jax.random.normal(key, shape, jnp.float32).astype(dtype), sharding)


def make_block(mesh, shape: MoEShape, dispatcher: str, num_chunks: int = 1, buffer=None) -> MoE:
    """The block at `shape` with `dispatcher`, bfloat16, its state placed on the mesh (the experts sharded over the
    EP axis by their partition metadata, the rest replicated)."""
    moe = MoE(shape.d_model, shape.d_ff, shape.experts, shape.topk, mesh=mesh, dispatcher=dispatcher, dtype=DTYPE,
              param_dtype=DTYPE, num_chunks=num_chunks, buffer=buffer, rngs=nnx.Rngs(0))
    state = nnx.state(moe)
    nnx.update(moe, jax.tree.map(_placed, state, nnx.get_named_sharding(state, mesh)))
    return moe


def block_inputs(mesh, tokens: int, d_model: int) -> tuple[jax.Array, jax.Array]:
    """x and a cotangent of the block's output: [R * tokens, d_model] bfloat16, random, rows sharded over the EP
    axis (every rank's tokens)."""
    x_key, cotangent_key = jax.random.split(jax.random.key(1))
    rows = ((mesh.devices.size * tokens, d_model), DTYPE, NamedSharding(mesh, P("ep")))
    return _random(x_key, *rows), _random(cotangent_key, *rows)


REMAT_LAYERS = 4  # --remat's stack: remat keeps one layer's activations alive instead of every layer's


def block_step(moe: MoE, remat: bool = False, layers: int = 1):
    """The whole block, forward + backward, as one jitted step(state, x, cotangent) -> (y, (state's gradient,
    x's gradient)), applied `layers` times in a row (same weights); with `remat`, each application under
    jax.checkpoint with nothing saveable (the backward pass recomputes its forward: router, dispatch, experts,
    combine)."""
    graphdef, _ = nnx.split(moe)

    def block(state, x):
        return nnx.merge(graphdef, state)(x)[0]

    if remat:
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)

    def stack(state, x):
        for _ in range(layers):
            x = block(state, x)
        return x

    @jax.jit
    def step(state, x, cotangent):
        # y is returned as a model's next layer reads it: the gradients alone do not read the forward's combine,
        # and jit would drop it (jax_ep.bench.swiglu says the same of the dense proxy's last matmul).
        y, pullback = jax.vjp(stack, state, x)
        return y, pullback(cotangent)

    return step


def _block_and_proxy_ms(mesh, moe: MoE, x, cotangent, shape: MoEShape, args) -> dict[str, float]:
    """ms of the block's step and of the dense proxy of its FLOPs, their runs taken in turn, each after a barrier
    of the ranks."""
    return harness.alternating_median_ms(
        {"block": (block_step(moe, remat=False), [(nnx.state(moe), x, cotangent)]),
         "proxy": dense_swiglu_step(args.tokens * shape.topk, shape.d_model, shape.d_ff)}, args.runs, args.calls,
        before_run=harness.rank_barrier(mesh))


def remat_temp_bytes(moe: MoE, x, cotangent) -> dict[str, int]:
    """XLA's temporary memory (what the step keeps between its forward and backward passes, and workspace) of
    REMAT_LAYERS blocks in a row, without and with jax.checkpoint: a smaller figure with it shows each block's
    forward is recomputed in the backward pass rather than kept alive."""
    state = nnx.state(moe)
    return {("remat" if remat else "plain"): block_step(moe, remat, REMAT_LAYERS).lower(state, x, cotangent)
            .compile().memory_analysis().temp_size_in_bytes for remat in (False, True)}


def _stage_ms(mesh, key, fn, diff, diff_specs, const, args, beside=None):
    """One stage alone: `fn(*diff, *const) -> (out, aux)` (per rank; aux holds its outputs without a gradient),
    forward + backward with respect to `diff` (partitioned as `diff_specs`; `const` and the outputs per rank),
    jitted in a shard_map of its own. Returns (ms, out, aux): ms {"wall": by the clock, "gpu": _gpu_ms or None off a
    GPU}; out and aux of the forward, the next stages' inputs. `beside` ({name: (fn, input sets)}): steps whose runs
    take turns with the stage's (harness.alternating_median_ms), their ms in ms[name]."""
    ep = P("ep")
    forward = jax.jit(jax.shard_map(lambda d, c: fn(*d, *c), mesh=mesh, in_specs=(diff_specs, ep), out_specs=ep))
    out, aux = forward(diff, const)
    leaves, tree = jax.tree.flatten(out)
    cotangent = tree.unflatten([_random(k, leaf.shape, leaf.dtype, leaf.sharding)
                                for k, leaf in zip(jax.random.split(key, len(leaves)), leaves)])

    def forward_backward(d, c, ct):
        # The forward's outputs are returned too: the block needs them, and XLA would otherwise drop the parts of
        # the forward that the backward does not read.
        out, pullback, aux = jax.vjp(lambda *d: fn(*d, *c), *d, has_aux=True)
        return out, aux, pullback(ct)

    step = jax.jit(jax.shard_map(forward_backward, mesh=mesh, in_specs=(diff_specs, ep, ep),
                                 out_specs=(ep, ep, diff_specs)))
    inputs = (diff, const, cotangent)
    ms = harness.alternating_median_ms({"wall": (step, [inputs]), **(beside or {})}, args.runs, args.stage_calls,
                                       before_run=harness.rank_barrier(mesh))
    ms["gpu"] = _gpu_ms(mesh, step, inputs) if harness.on_gpu(mesh) else None
    return ms, out, aux


GPU_TIME_CALLS = 20  # calls profiled for a stage's GPU time: the ranks' skew at the first call weighs a twentieth


def _gpu_ms(mesh, step, inputs) -> float:
    """ms per call in which this process's busiest GPU ran `step`'s kernels, from a profile of GPU_TIME_CALLS
    back-to-back calls after a barrier of the ranks: the stage's cost on the GPU, without the host's launch of each
    call (a stage of 0.1-0.5 ms timed by the wall clock over a few calls carries a good part of that launch; inside
    the block nothing launches a stage)."""
    trace = timeline.profile(step, inputs, GPU_TIME_CALLS, before=harness.rank_barrier(mesh))
    busy = timeline.busy_us_per_device(trace, since=timeline.TIMED_CALLS)
    if not busy:
        raise RuntimeError("the profile holds no GPU streams (is CUPTI available?)")
    return max(busy.values()) / GPU_TIME_CALLS / 1e3


def _breakdown_ms(mesh, moe: MoE, x, shape: MoEShape, args) -> tuple[dict[str, float], dict[str, float] | None, float]:
    """ms of each of STAGES alone, forward + backward, chained as the block chains them (MoE._forward, the
    normal and xla dispatchers, the block's rows per rank), on this block's weights and x: by the wall clock, and on the
    GPU (_gpu_ms; None off a GPU); and ms of the dense proxy timed in turns with the expert FFN stage, over as many
    calls a run (the stage's ratio to the proxy is then taken at one GPU clock, as the block's is)."""
    buffer, config, num_experts, alignment = moe.buffer, moe.router_config, moe.num_experts, moe.expert_alignment
    keys = iter(jax.random.split(jax.random.key(3), len(STAGES)))
    ep, replicated = P("ep"), P()

    def router(x, kernel):
        routing = route(x, kernel, None, config)
        return routing.topk_weights, routing.topk_idx

    def dispatch(x, topk_weights, topk_idx):
        d = jax_ep.dispatch(buffer, x, topk_idx, topk_weights, num_experts=num_experts, expert_alignment=alignment,
                            max_recv_tokens=moe._capacity(x.shape[0], mesh.devices.size), layout="expert_major")
        return (d.recv_x, d.recv_weights), (d.num_recv_tokens_per_expert, d.handle)

    def expert_ffn(recv_x, w_gate_up, w_down, group_sizes):
        return grouped_swiglu(recv_x, group_sizes, w_gate_up, w_down, zero_past_groups=False).astype(DTYPE), ()

    def combine(y, recv_weights, handle):
        return jax_ep.combine(buffer, y, handle, weights=recv_weights).x, ()

    ms = {}
    ms["router"], topk_weights, topk_idx = _stage_ms(
        mesh, next(keys), router, (x, moe.router_kernel[...]), (ep, replicated), (), args)
    ms["dispatch"], (recv_x, recv_weights), (group_sizes, handle) = _stage_ms(
        mesh, next(keys), dispatch, (x, topk_weights), (ep, ep), (topk_idx,), args)
    experts = (moe.w_gate_up[...], moe.w_down[...])  # [E, ...], sharded over the EP axis
    proxy = dense_swiglu_step(args.tokens * shape.topk, shape.d_model, shape.d_ff)
    ms["expert FFN"], expert_out, _ = _stage_ms(
        mesh, next(keys), expert_ffn, (recv_x, *experts), (ep,) * 3, (group_sizes,), args, beside={"proxy": proxy})
    ms["combine"], _, _ = _stage_ms(mesh, next(keys), combine, (expert_out, recv_weights), (ep, ep), (handle,), args)
    gpu = {stage: figures["gpu"] for stage, figures in ms.items()}
    return ({stage: figures["wall"] for stage, figures in ms.items()}, (None if None in gpu.values() else gpu),
            ms["expert FFN"]["proxy"])


def timeline_path(path: str, shape: str, dispatcher: str, num_chunks: int = 1) -> str:
    root, suffix = os.path.splitext(path)
    chunks = f"-{num_chunks}-chunks" if num_chunks > 1 else ""
    return f"{root}-{shape.replace(', ', '-').replace(' ', '-')}-{dispatcher}{chunks}{suffix or '.png'}"


def _draw_timeline(moe: MoE, x, cotangent, path: str, title: str) -> None:
    """One profiled step of the block (every process profiles, as every process runs the step; process 0 draws)."""
    lanes = timeline.lanes_of(timeline.profile(block_step(moe, remat=False), (nnx.state(moe), x, cotangent)))
    if jax.process_index() != 0:
        return
    if harness.on_gpu(moe.mesh) and not any(lane.startswith("/device:") for lane in lanes):
        print("[moe]   the profile holds no GPU streams (is CUPTI available?): the timeline shows host threads",
              flush=True)
    spans = os.path.splitext(path)[0] + ".json"
    timeline.write_json(lanes, spans)
    plt = harness.pyplot()
    if plt is not None:
        timeline.plot(plt, lanes, path, title)
    print(f"[moe]   timeline of one step: {path if plt is not None else '(no matplotlib: not drawn)'}; its kernels: "
          f"{spans}", flush=True)


def _measure(mesh, shape: MoEShape, dispatcher: str, args, name: str) -> dict:
    """The block at `shape` with `dispatcher`, for each of --num-chunks, and the (unchunked) breakdown: the backend
    it ran on, {num_chunks: {"block": ms, "proxy": ms}} and the breakdown in ms."""
    x, cotangent = block_inputs(mesh, args.tokens, shape.d_model)
    figures = dict(blocks={})
    for index, num_chunks in enumerate(args.num_chunks):
        buffer = (jax_ep.Buffer(mesh, "ep", config=jax_ep.Config(num_sms=args.sms))
                  if args.sms is not None and dispatcher == "normal" else None)
        moe = make_block(mesh, shape, dispatcher, num_chunks, buffer)
        with moe.buffer:  # a cuda Buffer's memory lies outside XLA's pool: freed before the next block
            figures["backend"], figures["num_sms"] = moe.buffer.backend, moe.buffer.config.num_sms
            figures["blocks"][num_chunks] = _block_and_proxy_ms(mesh, moe, x, cotangent, shape, args)
            if index == 0:
                (figures["breakdown_ms"], figures["breakdown_gpu_ms"],
                 figures["expert_ffn_proxy_ms"]) = _breakdown_ms(mesh, moe, x, shape, args)
                if args.remat:
                    figures["temp_bytes"] = remat_temp_bytes(moe, x, cotangent)
            if args.timeline:
                _draw_timeline(moe, x, cotangent, timeline_path(args.timeline, name, dispatcher, num_chunks),
                               f"jax_ep.flax.MoE {name}, {dispatcher} dispatcher ({figures['backend']} backend), "
                               f"{num_chunks} chunk(s), {mesh.devices.size} ranks: one step, forward + backward"
                               + ("" if jax.process_count() == 1 else ", process 0's GPUs"))
    return figures


def shared_gpu_refusal(args) -> str | None:
    """Why ranks cannot share a GPU here (harness.run asks before it launches the processes)."""
    return f"the block's training step: {harness.NEEDS_NCCL}"


def run(args) -> dict:
    mesh = harness.ep_mesh(args)
    num_ranks, device = mesh.devices.size, mesh.devices.flat[0]
    setup = dict(device=device.device_kind, platform=device.platform, jax=jax.__version__, num_ranks=num_ranks,
                 process_model=harness.process_model(args), tokens=args.tokens, num_chunks=list(args.num_chunks),
                 dtype=jnp.dtype(DTYPE).name, runs=args.runs, calls=args.calls, stage_calls=args.stage_calls,
                 target_ratio=TARGET_RATIO,
                 normal_dispatcher_sms=args.sms)
    print(f"[moe] {num_ranks} ranks ({device.device_kind}), {setup['process_model']}, {args.tokens} tokens per rank"
          + (f" (the block in {' and '.join(map(str, args.num_chunks))} chunks)" if args.num_chunks != [1] else "")
          + (f", the normal dispatcher's kernels on {args.sms} SMs" if args.sms is not None else "") + ", "
          f"{setup['dtype']}, forward + backward; median of {args.runs} runs of {args.calls} calls (each stage "
          f"alone: of {args.stage_calls})", flush=True)
    if not harness.on_gpu(mesh):
        setup["not_a_performance_figure"] = harness.NOT_ON_A_GPU
        print(f"[moe] {harness.NOT_ON_A_GPU}", flush=True)
    gbps, setup["hbm_copy_bytes"] = hbm_gbps(args.runs, args.calls)
    setup["hbm_gbps"] = gbps
    print(f"[moe] {hbm_text(gbps, setup['hbm_copy_bytes'])}", flush=True)
    results = []
    for name, shape in _shapes(args):
        if shape.experts % num_ranks:
            raise SystemExit(f"[moe] {name}: {shape.experts} experts do not split over {num_ranks} ranks")
        rows = args.tokens * shape.topk
        flops = swiglu_flops(rows, shape.d_model, shape.d_ff)
        weight_bytes = expert_weight_bytes(shape.experts // num_ranks, shape.d_model, shape.d_ff)
        print(f"[moe] {name}: D={shape.d_model} F={shape.d_ff} E={shape.experts} K={shape.topk}, "
              f"{shape.experts // num_ranks} experts per rank, {rows} rows per rank, {flops / 1e12:.4g} TFLOP per "
              f"rank", flush=True)
        for dispatcher in args.dispatchers:
            figures = _measure(mesh, shape, dispatcher, args, name)
            breakdown = figures["breakdown_ms"]
            compute_ms = breakdown["router"] + breakdown["expert FFN"]
            communication_ms = breakdown["dispatch"] + breakdown["combine"]
            ffn_proxy_ms = figures["expert_ffn_proxy_ms"]  # (the breakdown's: one per dispatcher)
            ffn_bound = roofline(flops, flops / ffn_proxy_ms / 1e9, weight_bytes, gbps)
            for num_chunks, block in figures["blocks"].items():
                block_ms, proxy_ms = block["block"], block["proxy"]
                bound = roofline(flops, flops / proxy_ms / 1e9, weight_bytes, gbps)
                record = dict(shape=name, **shape._asdict(), experts_per_rank=shape.experts // num_ranks,
                              rows_per_rank=rows, flops_per_rank=flops, dispatcher=dispatcher, num_chunks=num_chunks,
                              backend=figures["backend"], num_sms=figures["num_sms"], block_ms=block_ms,
                              block_tflops=flops / block_ms / 1e9,
                              dense_proxy_ms=proxy_ms, dense_proxy_tflops=flops / proxy_ms / 1e9,
                              ratio=block_ms / proxy_ms, meets_target=block_ms / proxy_ms <= TARGET_RATIO,
                              breakdown_ms=breakdown, breakdown_sum_ms=sum(breakdown.values()),
                              breakdown_gpu_ms=figures["breakdown_gpu_ms"],
                              compute_stages_ms=compute_ms, block_over_compute_stages=block_ms / compute_ms,
                              hidden=(sum(breakdown.values()) - block_ms) / communication_ms,
                              **roofline_fields(block_ms, bound, weight_bytes, gbps),
                              expert_ffn_proxy_ms=ffn_proxy_ms,
                              expert_ffn_ratio_to_proxy=breakdown["expert FFN"] / ffn_proxy_ms,
                              expert_ffn_ratio_to_roofline=breakdown["expert FFN"] / ffn_bound.ms)
                if "temp_bytes" in figures:
                    record["temp_bytes"] = figures["temp_bytes"]
                results.append(record)
                chunks = f", {num_chunks} chunks" if num_chunks > 1 else ""
                print(f"[moe] {name} {dispatcher} ({record['backend']} backend{chunks}): block {block_ms:.3f} ms = "
                      f"{record['block_tflops']:.4g} TFLOP/s; dense proxy {proxy_ms:.3f} ms = "
                      f"{record['dense_proxy_tflops']:.4g} TFLOP/s; {record['ratio']:.2f}x the dense proxy "
                      f"(target <= {TARGET_RATIO}x: {'met' if record['meets_target'] else 'not met'}); "
                      f"{record['block_over_compute_stages']:.2f}x its compute stages (router + expert FFN); "
                      f"communication hidden {100 * record['hidden']:.0f} %", flush=True)
                print(f"[moe]   expert FFN stage {breakdown['expert FFN']:.3f} ms = "
                      f"{record['expert_ffn_ratio_to_proxy']:.2f}x the dense proxy timed in turns with it "
                      f"({ffn_proxy_ms:.3f} ms), {record['expert_ffn_ratio_to_roofline']:.2f}x its "
                      f"{roofline_text(ffn_bound)}; block {record['ratio_to_roofline']:.2f}x its "
                      f"{roofline_text(bound)}; {weight_bytes / 1e9:.3g} GB of expert weights moved per rank",
                      flush=True)
            if "temp_bytes" in figures:
                print(f"[moe]   temporary memory of {REMAT_LAYERS} blocks in a row, forward + backward: "
                      f"{figures['temp_bytes']['plain'] / 2**20:.1f} MiB; each under jax.checkpoint (nothing "
                      f"saveable): {figures['temp_bytes']['remat'] / 2**20:.1f} MiB", flush=True)
            print("[moe]   breakdown, each stage forward + backward alone: "
                  + " + ".join(f"{stage} {breakdown[stage]:.3f}" for stage in STAGES)
                  + f" = {sum(breakdown.values()):.3f} ms; compute stages (router + expert FFN) {compute_ms:.3f} ms",
                  flush=True)
            if figures["breakdown_gpu_ms"] is not None:
                print(f"[moe]   each stage's GPU time (a profile of {GPU_TIME_CALLS} calls, without their launch): "
                      + " + ".join(f"{stage} {figures['breakdown_gpu_ms'][stage]:.3f}" for stage in STAGES) + " ms",
                      flush=True)
        _print_communication_ratios(name, [r for r in results if r["shape"] == name])
    return dict(mode="moe", setup=setup, results=results)


def _print_communication_ratios(name: str, records: list[dict]) -> None:
    """The normal dispatcher's dispatch and combine stages over the xla dispatcher's, where both ran."""
    by_dispatcher = {}
    for r in records:  # the breakdown is one per dispatcher, whatever num_chunks
        by_dispatcher.setdefault(r["dispatcher"], r)
    if not {"normal", "xla"} <= by_dispatcher.keys():
        return
    normal, xla = by_dispatcher["normal"], by_dispatcher["xla"]
    parts = []
    for stage in ("dispatch", "combine"):
        text = (f"{stage} {normal['breakdown_ms'][stage]:.3f} / {xla['breakdown_ms'][stage]:.3f} ms "
                f"({normal['breakdown_ms'][stage] / xla['breakdown_ms'][stage]:.2f}x")
        if normal["breakdown_gpu_ms"] is not None and xla["breakdown_gpu_ms"] is not None:
            gpu_normal, gpu_xla = normal["breakdown_gpu_ms"][stage], xla["breakdown_gpu_ms"][stage]
            text += f"; GPU time {gpu_normal:.3f} / {gpu_xla:.3f} ms, {gpu_normal / gpu_xla:.2f}x"
        parts.append(text + ")")
    print(f"[moe] {name}, normal ({normal['backend']} backend) / xla, each stage forward + backward: "
          + ", ".join(parts), flush=True)


def plot(plt, figures: dict, path: str) -> None:
    """PNG: per shape, per dispatcher, the breakdown's stages stacked beside the whole block, with its dense proxy
    and the target (TARGET_RATIO x the proxy) as lines."""
    results = figures["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        records = [r for r in results if r["shape"] == shape]
        at = np.arange(len(records))
        bottom = np.zeros(len(records))
        for stage in STAGES:
            ms = np.array([r["breakdown_ms"][stage] for r in records])
            ax.bar(at - 0.2, ms, 0.4, bottom=bottom, label=stage)
            bottom += ms
        ax.bar(at + 0.2, [r["block_ms"] for r in records], 0.4, color="gray", label="whole block")
        proxy = np.array([r["dense_proxy_ms"] for r in records])  # each timed alongside its block
        ax.hlines(proxy, at - 0.45, at + 0.45, color="black", linestyle="--", linewidth=1, label="dense proxy")
        ax.hlines(TARGET_RATIO * proxy, at - 0.45, at + 0.45, color="black", linestyle=":", linewidth=1,
                  label=f"target ({TARGET_RATIO}x the proxy)")
        ax.set_xticks(at, [f"{r['dispatcher']}\n{r['backend']} backend"
                           + (f"\n{r['num_chunks']} chunks" if r["num_chunks"] > 1 else "") for r in records], fontsize=8)
        first = records[0]
        ax.set(ylabel="ms, forward + backward",
               title=f"{shape}: D={first['d_model']} F={first['d_ff']} E={first['experts']} K={first['topk']}")
    setup = figures["setup"]
    fig.suptitle(f"jax_ep.flax.MoE, {setup['num_ranks']} ranks ({setup['device']}), {setup['tokens']} tokens per rank"
                 + (f"\n{setup['not_a_performance_figure']}" if "not_a_performance_figure" in setup else ""),
                 fontsize=9)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)  # below the bars
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
