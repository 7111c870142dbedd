"""The cuda backend's intranode combine on CPU, what can be checked without a GPU: how the process model,
Config.combine and its override $JAX_EP_COMBINE pick the push or the pull combine (the custom call's method and
push_warps attributes, push_warps 0 for pull, and the scratch result of a push in one process), Config.push_warps and
$JAX_EP_COMBINE_PUSH_WARPS, the workspace a group spanning processes needs, and the error for a Buffer too small
for it. Lowering compiles and runs nothing, so a Buffer made for the xla backend, holding an intranode backend that
allocated nothing, stands in for a cuda one."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import mesh_of, with_standin_backend
from jax_ep import _native
from jax_ep.backends.cuda import intranode, normal

R, T, H, K, E = 4, 8, 512, 3, 16
ENV, WARPS_ENV = "JAX_EP_COMBINE", "JAX_EP_COMBINE_PUSH_WARPS"


def cuda_standin(spans_processes: bool, num_nvl_bytes: int = 1 << 30, config: jax_ep.Config | None = None):
    if not _native.has_target(intranode.COMBINE_TARGET, "cuda"):
        pytest.skip("this build has no CUDA normal-mode kernels")
    buf = jax_ep.Buffer(mesh_of(R), "ep", backend="xla", config=config)
    return with_standin_backend(buf, intranode.IntranodeBackend,
                                staging_bytes=num_nvl_bytes if spans_processes else None)


def combine_calls(buf, y_dtype=jnp.float32) -> list[str]:
    """The lowered program's jax_ep_combine custom calls (one line each) of a dispatch + combine."""

    def body(x, idx, y):
        d = jax_ep.dispatch(buf, x, idx, num_experts=E)
        return jax_ep.combine(buf, y, d.handle).x

    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * R * T, H), y_dtype))
    text = jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()
    return [line for line in text.splitlines() if "custom_call @jax_ep_combine(" in line]


def slots_bytes(row_bytes: int) -> int:
    """The push combine's slots: R - 1 regions of T rows."""
    return (R - 1) * T * row_bytes


@pytest.mark.parametrize("spans_processes, forced, push", [
    (False, None, False), (False, "push", True), (False, "pull", False),
    (True, None, True), (True, "pull", False), (True, "push", True)])
def test_process_model_and_environment_pick_the_method(monkeypatch, spans_processes, forced, push):
    monkeypatch.delenv(WARPS_ENV, raising=False)
    if forced is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, forced)
    (call,) = combine_calls(cuda_standin(spans_processes))
    method = intranode.COMBINE_METHOD_VALUES["push" if push else "pull"]  # csrc/api.h's CombineMethod, via _C
    assert f"method = {method} : i64" in call, call
    assert f"push_warps = {8 if push else 0} : i64" in call, call  # half of each block's 16 warps push
    results = re.search(r"-> (.*)$", call).group(1)
    # One process pushing: the peers store into a scratch result of the call; staged groups use the workspace.
    scratch = f"tensor<{slots_bytes(4 * H)}xui8>"
    assert (scratch in results) == (push and not spans_processes), results
    assert f"tensor<{T}x{H}xf32>" in results, results


@pytest.mark.parametrize("spans_processes", [False, True])
@pytest.mark.parametrize("method", ["push", "pull"])
def test_config_picks_the_method_and_warps(monkeypatch, spans_processes, method):
    """Config.combine and Config.push_warps win over the environment, which fills only what they leave open."""
    monkeypatch.setenv(ENV, "pull" if method == "push" else "push")
    monkeypatch.setenv(WARPS_ENV, "3")
    (call,) = combine_calls(cuda_standin(spans_processes, config=jax_ep.Config(combine=method, push_warps=5)))
    assert f"push_warps = {5 if method == 'push' else 0} : i64" in call, call
    (call,) = combine_calls(cuda_standin(spans_processes, config=jax_ep.Config(combine=method)))
    assert f"push_warps = {3 if method == 'push' else 0} : i64" in call, call


@pytest.mark.parametrize("field, value, message", [
    ("combine", "both", r"Config.combine must be one of \('push', 'pull'\) or None"),
    ("push_warps", 0, "Config.push_warps must be an integer from 1 to 16 or None"),
    ("push_warps", 17, "Config.push_warps must be an integer from 1 to 16 or None")])
def test_bad_config_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        jax_ep.Config(**{field: value})


def test_push_warps_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "push")
    monkeypatch.setenv(WARPS_ENV, "16")
    (call,) = combine_calls(cuda_standin(False))
    assert "push_warps = 16 : i64" in call, call
    monkeypatch.setenv(ENV, "pull")  # the pull combine has no pushing warps
    (call,) = combine_calls(cuda_standin(False))
    assert "push_warps = 0 : i64" in call, call


@pytest.mark.parametrize("name, value, message", [
    (ENV, "both", r"JAX_EP_COMBINE must be one of \('push', 'pull'\)"),
    (WARPS_ENV, "0", "JAX_EP_COMBINE_PUSH_WARPS must be an integer from 1 to 16"),
    (WARPS_ENV, "17", "JAX_EP_COMBINE_PUSH_WARPS must be an integer from 1 to 16"),
    (WARPS_ENV, "half", "JAX_EP_COMBINE_PUSH_WARPS must be an integer from 1 to 16")])
def test_bad_environment_values(monkeypatch, name, value, message):
    monkeypatch.setenv(ENV, "push")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        combine_calls(cuda_standin(False))


def staged(*region_bytes: int) -> int:
    """Workspace a group spanning processes needs for these staged regions: from the staging offset on, each
    region rounded up to the staging alignment (both the extension's)."""
    offset, align = _native.limit("staging_offset"), _native.limit("staging_align")
    return offset + sum(-(-b // align) * align for b in region_bytes)


@pytest.mark.parametrize("method", ["push", "pull"])
def test_workspace_check_names_the_size(monkeypatch, method):
    """A group spanning processes: combine's workspace is the slots (push) or the staged copy of y [R*T rows]
    (pull), one aligned region after the staging offset; one byte less raises, naming the size."""
    monkeypatch.setenv(ENV, method)
    rows = R * T if method == "pull" else (R - 1) * T
    need = staged(rows * 4 * H)
    assert len(combine_calls(cuda_standin(True, num_nvl_bytes=need))) == 1
    with pytest.raises(ValueError, match=rf"combine \(cuda\).*num_nvl_bytes >= {need} "):
        combine_calls(cuda_standin(True, num_nvl_bytes=need - 1))


def test_dispatch_staging_per_region():
    """Dispatch stages its payload rows (one payload, or the FP8 pair), topk_idx, topk_weights when given, and the
    send offsets [T, R] int32, each in its own aligned region; cached dispatch stages its new rows."""
    if not _native.available():
        pytest.skip("the native extension did not load")
    tokens, topk, values, scales = 37, 5, 7168, 7168 // 128 * 4
    routing, offsets = tokens * topk * 4, tokens * R * 4
    assert intranode.dispatch_staging_bytes(tokens, (values, scales), topk, R, True) == \
        staged(tokens * values, tokens * scales, routing, routing, offsets)
    assert intranode.dispatch_staging_bytes(tokens, (2 * values,), topk, R, False) == \
        staged(tokens * 2 * values, routing, offsets)
    assert intranode.cached_dispatch_staging_bytes(tokens, 4 * H) == staged(tokens * 4 * H)
    with pytest.raises(ValueError, match="1 or 2 row sizes"):
        intranode.dispatch_staging_bytes(tokens, (), topk, R, True)


def test_normal_buffer_bytes_per_method(monkeypatch):
    """The combine of float32 rows dominates at these sizes: (R-1)*T rows pushed, or C rows staged to pull; the
    expert-major combine always pushes, so a small pull capacity still leaves room for its (R-1)*T rows."""
    Tb, Hb, Rb, Kb = 4096, 7168, 4, 8
    pushed = staged((Rb - 1) * Tb * 4 * Hb)
    pulled = staged(Rb * Tb * 4 * Hb)
    assert jax_ep.normal_buffer_bytes(Tb, Hb, Rb, Kb, combine="push") == pushed
    assert jax_ep.normal_buffer_bytes(Tb, Hb, Rb, Kb, combine="pull") == pulled
    assert jax_ep.normal_buffer_bytes(Tb, Hb, Rb, Kb, combine="pull", capacity=Tb) == pushed
    # No method named: enough for either, whatever the environment says.
    for method in (None, "push", "pull"):
        if method is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, method)
        assert jax_ep.normal_buffer_bytes(Tb, Hb, Rb, Kb) == max(pushed, pulled)
    with pytest.raises(ValueError, match="combine must be one of"):
        jax_ep.normal_buffer_bytes(Tb, Hb, Rb, Kb, combine="staged")


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_no_xla_collective_in_cuda_programs(layout):
    """strict's agreement on the counts and the expert-major routing go through the cuda backend's own kernels:
    the lowered program has no XLA collective, which on GPUs would be NCCL's (it refuses two ranks on one GPU)."""
    buf = cuda_standin(spans_processes=True)

    def body(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, strict=True, layout=layout)
        weights = {"weights": d.recv_weights} if layout == "expert_major" else {}
        return jax_ep.combine(buf, d.recv_x, d.handle, **weights).x

    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * T, K), jnp.float32))
    text = jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()
    collectives = re.findall(r"stablehlo\.(all_gather|all_to_all|all_reduce|collective_permute|reduce_scatter)", text)
    assert not collectives, collectives
    assert "custom_call @jax_ep_cached_dispatch(" in text  # strict's gather of the counts (and the rows)


def expert_major_program(buf, num_experts: int) -> str:
    """The lowered text of an expert-major dispatch, cached dispatch and weighted combine with their gradients."""

    def loss(x, w, idx, x2, bias):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=num_experts, layout="expert_major")
        cached = jax_ep.dispatch(buf, x2, handle=d.handle).recv_x
        out = jax_ep.combine(buf, d.recv_x + cached, d.handle, bias=bias, weights=d.recv_weights).x
        return jnp.sum(out.astype(jnp.float32))

    def body(x, w, idx, x2, bias):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w, idx, x2, bias)
        return value[None], grads

    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.float32), jnp.zeros((R * T, K), jnp.int32),
            jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, H), jnp.float32))
    return jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()


def calls_of(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"custom_call @{target}(" in line]


@pytest.mark.parametrize("spans_processes", [False, True])
def test_expert_major_ops_run_their_own_kernels(spans_processes):
    """With E within the kernels' limit the expert-major dispatch, cached dispatch, combine and their gradients are
    the expert-major kernels' calls (no routing dispatch, no rank-major call); the combines are weighted where
    weights are given (the combine: yes; the dispatch's d x and the d topk_weights rows: no) and carry the peers'
    slots as a second result in one process only; the combine's gradient is one weighted backward call with d y
    and d weights as its results."""
    text = expert_major_program(cuda_standin(spans_processes), E)
    for target in (intranode.DISPATCH_TARGET, intranode.CACHED_DISPATCH_TARGET, intranode.COMBINE_TARGET):
        assert not calls_of(text, target), target
    assert len(calls_of(text, intranode.EXPERT_MAJOR_DISPATCH_TARGET)) == 1
    assert len(calls_of(text, intranode.EXPERT_MAJOR_CACHED_DISPATCH_TARGET)) == 1  # the cached x2
    backward = calls_of(text, intranode.EXPERT_MAJOR_COMBINE_BACKWARD_TARGET)
    assert len(backward) == 1 and "weighted = 1" in backward[0], backward
    assert re.search(r"->\s*\(tensor<[^>]*bf16>, tensor<[^>]*f32>\)", backward[0]), backward[0]  # d y, d weights
    combines = calls_of(text, intranode.EXPERT_MAJOR_COMBINE_TARGET)
    assert len(combines) == 3, combines  # forward, d x, d topk_weights
    weighted = sorted(int(re.search(r"weighted = (\d+)", c).group(1)) for c in combines)
    assert weighted == [0, 0, 1], weighted
    for call in combines:
        results = re.search(r"->\s*(\(.*\)|tensor<[^>]*>)\s*$", call).group(1)
        assert ("ui8" in results) == (not spans_processes), call


def test_expert_major_beyond_the_kernels_limit_is_composed():
    """More experts than the expert-major kernels take: the composed path (a routing dispatch of the rank-major
    kernels, their cached dispatch and combine)."""
    experts = R * (normal.MAX_EXPERT_MAJOR_EXPERTS // R + 1)
    text = expert_major_program(cuda_standin(False), experts)
    assert not calls_of(text, intranode.EXPERT_MAJOR_DISPATCH_TARGET)
    assert calls_of(text, intranode.DISPATCH_TARGET) and calls_of(text, intranode.COMBINE_TARGET)


def test_expert_major_combine_of_other_float_types_rounds_partials_first():
    """y of a type the combine kernels do not read (float8 here): its partials are made in XLA and rounded to y's
    type, then summed home by the kernel as float32 rows, one per received token."""
    buf = cuda_standin(False)

    def body(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w, num_experts=E, layout="expert_major")
        return jax_ep.combine(buf, d.recv_x.astype(jnp.float8_e4m3fn), d.handle, weights=d.recv_weights).x

    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * T, K), jnp.float32))
    text = jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()
    (call,) = calls_of(text, intranode.EXPERT_MAJOR_COMBINE_TARGET)
    assert f"tensor<{R * T}x{H}xf32>, tensor<{R * T}x1xi32>" in call, call  # a float32 partial per received token
    assert re.search(r"weighted = 0", call), call
    assert "f8E4M3FN" in text and "convert" in text  # the partials rounded to float8 in XLA


# ---- side streams (docs/design.md, "Side streams") --------------------------------------------------------------

def side_stream_program(buf) -> str:
    """An expert-major dispatch and weighted combine on side stream 2 beside a matmul (normal.overlap); a cached
    dispatch on XLA's stream after them."""
    backend = buf.backend_impl

    def body(x, idx, w, m):
        def start(x, idx, w):
            recv, weights, *_, handle, _ = backend.expert_major_dispatch(
                (x,), idx, w, num_experts=E, capacity=R * T * K, expert_alignment=1)
            out = backend._expert_major_combine_call(recv[0], weights, handle.pair_row, handle, None, x.dtype)
            return out, handle

        (out, handle), product = normal.overlap(start, (x, idx, w), lambda m: m @ m, (m,), index=2)
        return out, product, backend.expert_major_cached_dispatch(x, handle)

    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * T, K), jnp.float32),
            jnp.zeros((R * 64, 64), jnp.float32))
    return jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args).as_text()


def test_calls_inside_side_stream_take_the_twins_and_join_holds_every_operand():
    """In normal.overlap the backend's calls lower to their `_on_side_stream` twins with side_stream = 2, the matmul
    between two optimization barriers, then the join: it returns the started results in place (aliased) and holds
    every other result and operand of the calls, each once; calls outside stay on XLA's stream."""
    text = side_stream_program(cuda_standin(False))
    dispatch, combine = (calls_of(text, _native.side_stream_twin(t)) for t in
                         (intranode.EXPERT_MAJOR_DISPATCH_TARGET, intranode.EXPERT_MAJOR_COMBINE_TARGET))
    assert len(dispatch) == len(combine) == 1, text
    assert all(re.search(r"side_stream = 2", call) for call in dispatch + combine), dispatch + combine
    assert not calls_of(text, intranode.EXPERT_MAJOR_DISPATCH_TARGET)  # only the twin
    assert len(calls_of(text, intranode.EXPERT_MAJOR_CACHED_DISPATCH_TARGET)) == 1  # after overlap: XLA's stream
    (join,) = calls_of(text, normal.JOIN_TARGET)
    assert re.search(r"side_stream = 2", join), join
    lines = text.splitlines()
    at = {name: next(i for i, line in enumerate(lines) if name in line)
          for name in (_native.side_stream_twin(intranode.EXPERT_MAJOR_COMBINE_TARGET), "dot_general",
                       normal.JOIN_TARGET)}
    assert list(at.values()) == sorted(at.values()), at  # start, matmul, join
    # Before the calls (their arguments together), before the compute, after it, and after the join (the compute's
    # results with the join's).
    assert text.count("optimization_barrier") == 4, text
    assert "has_side_effect = true" in join, join  # kept even where nothing reads the started results
    # Operands: the started results (the combine's result and the handle's 5 arrays, aliased), then the dispatch's
    # other 9 results, the combine's slots, x, topk_idx and topk_weights (the combine's operands are among those).
    operands = re.search(r"\(([^)]*)\)", join.split(normal.JOIN_TARGET, 1)[1]).group(1).split(",")
    assert len(operands) == len(set(operands)) == 6 + 9 + 1 + 3, join
    assert join.count("output_operand_alias<") == 6, join


def test_side_stream_index_is_checked():
    with pytest.raises(ValueError, match=f"index must be 1 to {normal.MAX_SIDE_STREAMS}, got 0"):
        with normal.side_stream(0):
            pass


def start_refusal(buf, start, compute=lambda m: m @ m) -> str:
    """The error of normal.overlap(start, ...) with `compute`, traced in a shard_map over buf's mesh."""
    def body(x, idx, w, m):
        (out,), product = normal.overlap(start, (x, idx, w), compute, (m,))
        return out, product

    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * T, K), jnp.float32),
            jnp.zeros((R * 64, 64), jnp.float32))
    with pytest.raises(ValueError) as raised:
        jax.jit(jax.shard_map(body, mesh=buf.mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*args)
    return str(raised.value)


def test_overlap_refuses_what_would_race_with_the_side_stream():
    """An XLA op on a side call's result inside start, a nested jit, a start without calls, a start returning
    something else, and a compute calling the same Buffer: each refused while tracing, saying what."""
    buf = cuda_standin(False)
    backend = buf.backend_impl

    def dispatch(x, idx, w):
        return backend.expert_major_dispatch((x,), idx, w, num_experts=E, capacity=R * T * K, expert_alignment=1)

    def cast_inside(x, idx, w):
        recv, *_ = dispatch(x, idx, w)
        return (recv[0].astype(jnp.float32),)

    assert "computes convert_element_type on a result of its side-stream calls" in start_refusal(buf, cast_inside)
    nested = jax.jit(lambda x, idx, w: (dispatch(x, idx, w)[0][0],))
    assert "start traces a jit" in start_refusal(buf, nested)
    assert "made no call" in start_refusal(buf, lambda x, idx, w: (x + 1,))
    assert "return only results of its side-stream calls" in start_refusal(buf, lambda x, idx, w: (
        dispatch(x, idx, w) and x,))

    def same_buffer(m):
        dispatch(jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K), jnp.float32))
        return m

    message = start_refusal(buf, lambda x, idx, w: (dispatch(x, idx, w)[0][0],), compute=same_buffer)
    assert "the compute calls an op of the Buffer" in message, message
