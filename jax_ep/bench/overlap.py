"""overlap: does an expert-major dispatch + combine on a jax_ep side stream run while XLA runs the expert matmuls?
`python -m jax_ep.bench overlap [--sms 24] [--tokens 4096]`, on the GPUs of one host (one process, or
--processes N).

Per rank, two independent pieces of work in one jitted program (moe-a's sizes: D=2048, F=1408, E=64, K=6):
- compute: the grouped SwiGLU of moe-a's expert FFN (T*K rows in E/R groups), forward + backward, on every SM or
  on every SM but --sms (`grouped_matmul(num_sms=...)`, so that the communication kernels find SMs free);
- communication: an expert-major dispatch of other tokens and the weighted combine of its rows (the backend's
  kernels on --sms SMs), on XLA's stream or on jax_ep's side stream 1 (`overlap` of jax_ep.backends.cuda.normal:
  started before the compute, joined after it; the compiled schedule is checked).
Prints ms per call of each alone, of both on one stream, and of both with the communication on the side stream, and
how much of the shorter piece the overlap hid: (alone + alone - both) / min(alone, alone). The fair serial baseline
is what the Flax block does today: the communication on XLA's stream after the compute, on the SMs its own Buffer
takes (`jax_ep.flax.moe.block_config`: every SM but 32), timed alone and after the compute; each side-stream variant
is also set against it. The communication's result on the side stream is checked against XLA's stream, bit for bit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.backends.cuda import normal
from jax_ep.bench import harness
from jax_ep.bench.swiglu import swiglu_forward_backward
from jax_ep.expert_major import default_capacity
from jax_ep.flax.moe import block_config as moe_block_config
from jax_ep.grouped_matmul import grouped_matmul

# moe-a (jax_ep.bench.swiglu): model width, expert width, experts, top-k.
D, F, E, K = 2048, 1408, 64, 6
ALIGNMENT = 8

# Options that size the problem: at their defaults the mode refuses to run without GPUs (harness).
GPU_SIZES = ("tokens",)


def add_arguments(parser) -> None:
    harness.add_process_arguments(parser)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    parser.add_argument("--sms", type=int, default=24, help="SMs of the communication kernels (default 24)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is printed")
    parser.add_argument("--calls", type=int, default=10, help="calls per timed run")
    harness.add_output_arguments(parser)


def run(args) -> list[dict]:
    mesh = harness.ep_mesh(args)
    num_ranks = mesh.devices.size
    device = mesh.devices.flat[0]
    if not harness.on_gpu(mesh):
        raise SystemExit("[overlap] needs NVIDIA GPUs: the side streams are the cuda backend's")
    T, local = args.tokens, E // num_ranks
    rows = T * K
    sms = device.core_count
    rng = np.random.default_rng(0)
    sharding = jax.sharding.NamedSharding(mesh, P("ep"))

    def placed(values, dtype):
        return jax.device_put(jnp.asarray(values, dtype), sharding)

    x = placed(rng.standard_normal((num_ranks * rows, D)), jnp.bfloat16)
    cotangent = placed(rng.standard_normal((num_ranks * rows, D)), jnp.bfloat16)
    w_gate_up = placed(rng.standard_normal((num_ranks * local, D, 2 * F)) * 0.02, jnp.bfloat16)
    w_down = placed(rng.standard_normal((num_ranks * local, F, D)) * 0.02, jnp.bfloat16)
    tokens = placed(rng.standard_normal((num_ranks * T, D)), jnp.bfloat16)
    topk_idx = placed(np.stack([rng.choice(E, K, replace=False) for _ in range(num_ranks * T)]), jnp.int32)
    topk_weights = placed(rng.random((num_ranks * T, K)), jnp.float32)
    inputs = (x, cotangent, w_gate_up, w_down, tokens, topk_idx, topk_weights)
    capacity = default_capacity(num_ranks, T, K, local, ALIGNMENT)
    print(f"[overlap] {num_ranks} ranks ({device.device_kind}, {sms} SMs), {harness.process_model(args)}; compute: "
          f"grouped SwiGLU fwd + bwd, {rows} rows in {local} groups, D={D} F={F}; communication: expert-major "
          f"dispatch + weighted combine of T={T} tokens, H={D}, K={K}, E={E}, on {args.sms} SMs", flush=True)

    buf = jax_ep.Buffer(mesh, "ep", backend="cuda", config=jax_ep.Config(num_sms=args.sms))
    block_config = moe_block_config(mesh)
    block_buf = jax_ep.Buffer(mesh, "ep", backend="cuda", config=block_config)
    block_comm = f"communication, the block's {block_config.num_sms} SMs"
    block_serial = f"both, one stream, the block's {block_config.num_sms} SMs"

    def compute(x, cotangent, w_gate_up, w_down, num_sms):
        sizes = jnp.full((local,), rows // local, jnp.int32)

        matmul = functools.partial(grouped_matmul, group_sizes=sizes, num_sms=num_sms)
        return swiglu_forward_backward(x, w_gate_up, w_down, cotangent, matmul)

    def communicate(tokens, topk_idx, topk_weights, backend=buf.backend_impl):
        recv, weights, *_, handle, _ = backend.expert_major_dispatch(
            (tokens,), topk_idx, topk_weights, num_experts=E, capacity=capacity, expert_alignment=ALIGNMENT)
        return backend._expert_major_combine_call(recv[0], weights, handle.pair_row, handle, None, tokens.dtype)

    def program(kind: str, num_sms: int | None, comm_buf: jax_ep.Buffer):
        def body(x, cotangent, w_gate_up, w_down, tokens, topk_idx, topk_weights):
            if kind == "compute":
                return compute(x, cotangent, w_gate_up, w_down, num_sms)
            if kind == "communication":
                return communicate(tokens, topk_idx, topk_weights, comm_buf.backend_impl)
            if kind == "one stream":
                return (compute(x, cotangent, w_gate_up, w_down, num_sms),
                        communicate(tokens, topk_idx, topk_weights, comm_buf.backend_impl))
            combined, grads = normal.overlap(communicate, (tokens, topk_idx, topk_weights),
                                             lambda *a: compute(*a, num_sms), (x, cotangent, w_gate_up, w_down))
            return grads, combined

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 7, out_specs=P("ep")))

    budget = sms - args.sms
    # (name, what runs, the compute's SMs, the Buffer that communicates; the side stream's is always --sms's)
    variants = [("compute, all SMs", "compute", None, buf), (f"compute, {budget} SMs", "compute", budget, buf),
                ("communication", "communication", None, buf),
                (block_comm, "communication", None, block_buf),
                ("both, one stream, all SMs", "one stream", None, buf),
                (block_serial, "one stream", None, block_buf),
                ("both, side stream, all SMs", "side stream", None, buf),
                (f"both, side stream, compute on {budget} SMs", "side stream", budget, buf)]
    programs = {name: program(kind, num_sms, comm_buf) for name, kind, num_sms, comm_buf in variants}
    ms = harness.alternating_median_ms({name: (fn, [inputs]) for name, fn in programs.items()}, args.runs, args.calls)
    records = []
    for name, kind, num_sms, comm_buf in variants:
        record = dict(variant=name, ms=ms[name], num_ranks=num_ranks, comm_sms=args.sms, tokens=T,
                      device=device.device_kind)
        line = f"[overlap] {name:45s} {ms[name]:8.3f} ms"
        if kind in ("side stream", "one stream"):
            alone = ms["compute, all SMs" if num_sms is None else f"compute, {budget} SMs"]
            comm = ms[block_comm if comm_buf is block_buf else "communication"]
            record["hidden"] = (alone + comm - ms[name]) / min(alone, comm)
            line += (f"  (compute alone {alone:.3f} + communication alone {comm:.3f} = {alone + comm:.3f}; hidden "
                     f"{100 * record['hidden']:.0f} % of the shorter)")
        if kind == "side stream":
            serial = ms[block_serial]
            record["saved_against_block_schedule_ms"] = serial - ms[name]
            line += f"; {serial - ms[name]:+.3f} ms against the block's schedule"
        records.append(record)
        print(line, flush=True)
    side = programs["both, side stream, all SMs"]
    text = side.lower(*inputs).compile().as_text()
    order = [i for i, line in enumerate(text.splitlines()) if "_on_side_stream" in line or "side_stream_join" in line
             or "mosaic_gpu" in line]
    print(f"[overlap] compiled schedule, side stream: {len(order)} of the starts, joins and matmul kernels found; "
          f"first {_kind(text, order[0]) if order else '-'}, last {_kind(text, order[-1]) if order else '-'}",
          flush=True)
    same = jnp.array_equal(programs["communication"](*inputs), side(*inputs)[1])
    print(f"[overlap] communication result on the side stream equal to XLA's stream, bit for bit: {bool(same)}",
          flush=True)
    buf.destroy()
    block_buf.destroy()
    return records


def _kind(text: str, line: int) -> str:
    content = text.splitlines()[line]
    return "join" if "side_stream_join" in content else "start" if "_on_side_stream" in content else "matmul"
