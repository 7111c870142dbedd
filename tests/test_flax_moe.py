"""jax_ep.flax.MoE: every dispatcher against the dense `none` reference (outputs, losses, counts and gradients),
the router variants, the block inside the caller's shard_map, jit + grad + jax.checkpoint, the Linen wrapper,
the swap-in of a plain Flax dense MoE block, capacity drops, the block in chunks and the expert-bias update."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import oracle as O  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import meta  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.flax import MoE, RouterConfig, from_dense, moe_linen  # noqa: E402
from jax_ep.flax.routing import route  # noqa: E402
from conftest import mesh_of  # noqa: E402
from flax_moe_harness import (D_FF, D_MODEL, EXPERTS, RANKS, SHARED_D_FF, TOKENS, TOPK, assert_close,  # noqa: E402
                              assert_matches_reference, check_capacity_drops, inputs, make_moe, objective,
                              reference, run)


@pytest.mark.parametrize("dispatcher, rtol", [("xla", 1e-5), ("normal", 1e-5), ("low_latency", 2e-2)])
def test_dispatcher_matches_dense_reference(dispatcher, rtol):
    assert_matches_reference(run(make_moe(dispatcher)), reference("softmax"), rtol)


def test_low_latency_block_counts_entries_to_masked_ranks():
    """With a masking Buffer (jax_ep.masks) and rank 1 masked by every rank and masking every other, the block's
    num_dropped counts the top-k entries that named a rank across that cut, as the oracle's num_masked does."""
    if RANKS < 2:
        pytest.skip("needs two ranks")
    buf = jax_ep.Buffer(mesh_of(RANKS), "ep", backend="xla", config=jax_ep.Config(on_timeout="mask"),
                        num_max_dispatch_tokens_per_rank=TOKENS, hidden=D_MODEL, num_experts=EXPERTS)
    moe = make_moe("low_latency", buffer=buf)
    x, _ = inputs()
    masked = np.zeros((RANKS, RANKS), bool)
    masked[:, 1] = masked[1, :] = True
    np.fill_diagonal(masked, False)
    for r in range(RANKS):
        buf.mask_ranks(np.flatnonzero(masked[r]).tolist(), on=r)
    _, aux = jax.block_until_ready(moe(x))
    buf.unmask_ranks()
    weights = moe._weights()
    idx = np.asarray(route(x, weights["router_kernel"], weights["expert_bias"], moe.router_config).topk_idx)
    idx = idx.reshape(RANKS, TOKENS, TOPK)
    expected = O.low_latency_dispatch(np.zeros((RANKS, TOKENS, D_MODEL), O.BF16), idx, EXPERTS, TOKENS,
                                      masked=masked).num_masked.sum()
    assert expected > 0, "the case should route some tokens across the cut"
    assert int(aux.num_dropped) == expected


@pytest.mark.parametrize("dispatcher", ["xla", "normal"])
def test_chunked_block_matches_dense_reference(dispatcher):
    """num_chunks=2: each half of every rank's tokens dispatched, through the experts and combined on its own;
    the same outputs, losses, counts and gradients."""
    assert_matches_reference(run(make_moe(dispatcher, num_chunks=2)), reference("softmax"), 1e-5)


@pytest.mark.parametrize("router", ["sigmoid_bias_grouped", "softmax_grouped_unnormalised"])
def test_router_variant_matches_dense_reference(router):
    assert_matches_reference(run(make_moe("xla", router)), reference(router), 1e-5)


def test_router_selection_rules():
    """Grouped top-k picks inside the best groups; the bias moves the selection but not the weights."""
    config = RouterConfig(EXPERTS, TOPK, "sigmoid", n_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    x, _ = inputs()
    kernel = jax.random.normal(jax.random.key(2), (D_MODEL, EXPERTS)) * D_MODEL ** -0.5
    bias = jnp.zeros(EXPERTS).at[3].set(10.0)  # expert 3 wins every selection, on its unbiased score
    routing = route(x, kernel, bias, config)
    idx, weights, scores = map(np.asarray, (routing.topk_idx, routing.topk_weights, routing.scores))
    assert (idx == 3).any(axis=1).all()
    picked = np.take_along_axis(scores, idx, axis=1)
    np.testing.assert_allclose(weights, 2.5 * picked / picked.sum(axis=1, keepdims=True), rtol=1e-6)
    unbiased = np.asarray(route(x, kernel, None, config).topk_idx)
    group_size = EXPERTS // 4
    grouped = scores.reshape(len(x), 4, group_size)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # DeepSeek-V3: sum of a group's best two
    best_groups = np.argsort(-group_scores, axis=1)[:, :2]
    assert all(set(row // group_size) <= set(groups) for row, groups in zip(unbiased, best_groups))


def test_inside_callers_shard_map():
    """The module merged inside the caller's shard_map, its state passed with its partition specs, gives the
    global view's outputs, statistics and gradients; whole (unsliced) expert weights there are refused."""
    moe = make_moe("xla")
    graphdef, state = nnx.split(moe)
    x, cotangent = inputs()

    def sharded(in_specs):
        return jax.shard_map(lambda s, x, c: objective(nnx.merge(graphdef, s), x, c, axis_name="ep"),
                             mesh=mesh_of(RANKS), in_specs=(in_specs, P("ep"), P("ep")),
                             out_specs=(P(), (P("ep"), P())))

    step = jax.jit(jax.value_and_grad(sharded(nnx.get_partition_spec(state)), argnums=(0, 1), has_aux=True))
    with jax.default_matmul_precision("highest"):
        (_, (y, aux)), (d_state, d_x) = step(state, x, cotangent)
    assert_close((y, aux, nnx.to_pure_dict(d_state), d_x), run(moe), 1e-5, "shard_map vs global view")
    with pytest.raises(ValueError, match="nnx.get_partition_spec"):
        sharded(P())(state, x, cotangent)


def test_jit_grad_checkpoint():
    """Gradients through jax.checkpoint of the functional form and through nnx.remat equal the plain ones."""
    moe = make_moe("xla")
    graphdef, state = nnx.split(moe)
    x, cotangent = inputs()
    _, _, expected_d_params, expected_d_x = run(moe)

    def rematerialised(state, x, cotangent):
        return jax.checkpoint(lambda s, x: objective(nnx.merge(graphdef, s), x, cotangent)[0])(state, x)

    with jax.default_matmul_precision("highest"):
        d_state, d_x = jax.jit(jax.grad(rematerialised, argnums=(0, 1)))(state, x, cotangent)
        nnx_d_params = nnx.jit(nnx.grad(lambda m, x, c: nnx.remat(objective)(m, x, c)[0]))(moe, x, cotangent)
    assert_close((nnx.to_pure_dict(d_state), d_x), (expected_d_params, expected_d_x), 1e-5, "jax.checkpoint")
    assert_close(nnx.to_pure_dict(nnx_d_params), expected_d_params, 1e-5, "nnx.remat")


def test_linen_wrapper():
    """moe_linen: init and apply under jit; the result equals the dense reference built from its params."""
    buffer = jax_ep.Buffer(mesh_of(RANKS), "ep", backend="xla")
    block = moe_linen(D_MODEL, D_FF, EXPERTS, TOPK, buffer=buffer, shared_d_ff=SHARED_D_FF)
    x, cotangent = inputs()
    variables = jax.jit(block.init)(jax.random.key(3), x)
    params = meta.unbox(variables["params"])
    w_gate, w_up = jnp.split(params["w_gate_up"], 2, axis=-1)
    shared_w_gate, shared_w_up = jnp.split(params["shared_w_gate_up"], 2, axis=-1)
    reference_block = from_dense(params["router_kernel"], w_gate, w_up, params["w_down"],
                                 num_experts_per_tok=TOPK, shared_w_gate=shared_w_gate, shared_w_up=shared_w_up,
                                 shared_w_down=params["shared_w_down"], dispatcher="none")
    with jax.default_matmul_precision("highest"):
        assert_close(jax.jit(block.apply)(variables, x), reference_block(x), 1e-5, "linen vs reference")
    d_params = jax.jit(jax.grad(lambda v: jnp.sum(block.apply(v, x)[0] * cotangent)))(variables)
    assert jax.tree.map(jnp.shape, d_params) == jax.tree.map(jnp.shape, variables)


class DenseExpert(nnx.Module):
    def __init__(self, d_model, d_ff, *, rngs):
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DenseMoE(nnx.Module):
    """A dense MoE block as plain Flax model code writes one (Mixtral's router, a shared expert as in
    Qwen-MoE): every expert runs on every token, masked by its gate weight."""

    def __init__(self, *, rngs):
        self.router = nnx.Linear(D_MODEL, EXPERTS, use_bias=False, rngs=rngs)
        self.experts = nnx.List([DenseExpert(D_MODEL, D_FF, rngs=rngs) for _ in range(EXPERTS)])
        self.shared_expert = DenseExpert(D_MODEL, SHARED_D_FF, rngs=rngs)

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x), axis=-1)
        weights, chosen = jax.lax.top_k(probs, TOPK)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        out = self.shared_expert(x)
        for e, expert in enumerate(self.experts):
            gate = jnp.sum(jnp.where(chosen == e, weights, 0.0), axis=-1, keepdims=True)
            out = out + gate * expert(x)
        return out


def test_swap_in_dense_flax_block():
    """from_dense turns the dense block's trained weights into the expert-parallel block: same outputs."""
    dense = DenseMoE(rngs=nnx.Rngs(5))

    def stacked(name):
        return jnp.stack([getattr(expert, name).kernel[...] for expert in dense.experts])

    shared = dense.shared_expert
    moe = from_dense(dense.router.kernel[...], stacked("gate"), stacked("up"), stacked("down"),
                     num_experts_per_tok=TOPK, shared_w_gate=shared.gate.kernel[...], shared_w_up=shared.up.kernel[...],
                     shared_w_down=shared.down.kernel[...], mesh=mesh_of(RANKS), dispatcher="normal")
    assert moe.w_gate_up[...].sharding.spec == P("ep", None, None)
    x, _ = inputs()
    with jax.default_matmul_precision("highest"):
        y, _ = nnx.jit(lambda m, x: m(x))(moe, x)
        expected = dense(x)
    assert_close(y, expected, 1e-5, "swapped-in vs dense block")


@pytest.mark.parametrize("expert_alignment, num_chunks", [(1, 1), (2, 1), (2, 2)])
def test_capacity_drops_are_counted(expert_alignment, num_chunks):
    check_capacity_drops("xla", expert_alignment, num_chunks=num_chunks)


def test_update_expert_bias():
    moe = make_moe("none", "sigmoid_bias_grouped")
    before = np.asarray(moe.expert_bias[...])
    load = jnp.array([4, 0, 2, 2, 1, 3, 2, 2], jnp.int32)  # mean 2
    moe.update_expert_bias(load, 0.01)
    step = np.asarray(moe.expert_bias[...]) - before
    np.testing.assert_allclose(step, 0.01 * np.sign(2 - np.asarray(load)), atol=1e-7)
    with pytest.raises(ValueError, match="expert_bias=True"):
        make_moe("none").update_expert_bias(load, 0.01)


def test_linen_wrapper_expert_bias_update():
    """The Linen wrapper keeps the expert bias in the "ExpertBias" collection, and the balancing step called
    through the bridge moves it by rate * sign(mean load - load) (DeepSeek-V3's rule, written out here)."""
    block = moe_linen(D_MODEL, D_FF, EXPERTS, TOPK, buffer=jax_ep.Buffer(mesh_of(RANKS), "ep", backend="xla"),
                      expert_bias=True, score_function="sigmoid")
    x, _ = inputs()
    variables = jax.jit(block.init)(jax.random.key(3), x)
    assert set(variables) == {"params", "ExpertBias"} and "expert_bias" not in variables["params"]
    _, aux = jax.jit(block.apply)(variables, x)
    rate = 1e-3
    _, updated = jax.jit(lambda v, load: block.apply(v, load, rate, nnx_method="update_expert_bias",
                                                     mutable=["ExpertBias"]))(variables, aux.tokens_per_expert)
    load = np.asarray(aux.tokens_per_expert, np.float64)
    expected = np.asarray(variables["ExpertBias"]["expert_bias"]) + rate * np.sign(load.mean() - load)
    np.testing.assert_allclose(np.asarray(updated["ExpertBias"]["expert_bias"]), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("build, message", [
    (lambda: make_moe("ragged"), "dispatcher must be one of"),
    (lambda: MoE(D_MODEL, D_FF, EXPERTS, TOPK, dispatcher="xla", rngs=nnx.Rngs(0)), "needs a mesh"),
    (lambda: MoE(D_MODEL, D_FF, EXPERTS, TOPK, mesh=mesh_of(RANKS), dispatcher="low_latency", rngs=nnx.Rngs(0)),
     "needs max_tokens_per_rank"),
    (lambda: make_moe("xla", expert_alignment=0), "expert_alignment must be a positive integer, got 0"),
    (lambda: make_moe("xla", num_chunks=0), "num_chunks must be a positive integer, got 0"),
    (lambda: make_moe("low_latency", num_chunks=2), "num_chunks applies to the 'normal' and 'xla' dispatchers"),
    (lambda: make_moe("xla", num_chunks=3)(inputs()[0]), "num_chunks=3 must divide the 8 tokens per rank"),
    (lambda: make_moe("xla", capacity_factor=-1.0), "capacity_factor must be a positive number or None, got -1.0"),
    (lambda: make_moe("none", capacity_factor=1.25), "capacity_factor applies to the 'normal' and 'xla'"),
    (lambda: make_moe("xla")(jnp.zeros((8, D_MODEL + 1))), f"x must end in d_model={D_MODEL} channels"),
    (lambda: make_moe("low_latency", buffer=jax_ep.Buffer(mesh_of(RANKS), "ep", backend="xla")),
     "dispatcher='low_latency' needs a Buffer made with num_max_dispatch_tokens_per_rank"),
    (lambda: make_moe("low_latency", buffer=low_latency_buffer(hidden=2 * D_MODEL)),
     f"the buffer's hidden is {2 * D_MODEL}, the block's d_model {D_MODEL}"),
    (lambda: make_moe("low_latency", buffer=low_latency_buffer(tokens=2 * TOKENS)),
     f"the buffer's num_max_dispatch_tokens_per_rank is {2 * TOKENS}, the block's max_tokens_per_rank {TOKENS}"),
    (lambda: MoE(D_MODEL, D_FF, RANKS + 1, TOPK, mesh=mesh_of(RANKS), dispatcher="xla", rngs=nnx.Rngs(0)),
     f"num_experts={RANKS + 1} must be a multiple of the EP axis size {RANKS}"),
    (lambda: RouterConfig(EXPERTS, TOPK, n_groups=3), "n_groups=3 must divide"),
    (lambda: RouterConfig(EXPERTS, 3, n_groups=4, topk_groups=1), "num_experts_per_tok=3 must be in"),
    (lambda: from_dense(jnp.zeros((D_MODEL, EXPERTS + 1)), *dense_shaped_experts(), num_experts_per_tok=TOPK,
                        dispatcher="none"), "router_kernel has shape"),
    (lambda: from_dense(jnp.zeros((D_MODEL, EXPERTS)), *dense_shaped_experts(), num_experts_per_tok=TOPK,
                        shared_w_gate=jnp.zeros((D_MODEL, SHARED_D_FF)), dispatcher="none"),
     "all three shared expert weights"),
    (lambda: from_dense(jnp.zeros((D_MODEL, EXPERTS)), jnp.zeros((EXPERTS, D_MODEL, D_FF)),
                        jnp.zeros((EXPERTS, D_MODEL, D_FF + 1)), jnp.zeros((EXPERTS, D_FF, D_MODEL)),
                        num_experts_per_tok=TOPK, dispatcher="none"), "w_gate .* and w_up .* must have one shape"),
])
def test_bad_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def low_latency_buffer(hidden: int = D_MODEL, tokens: int = TOKENS) -> jax_ep.Buffer:
    return jax_ep.Buffer(mesh_of(RANKS), "ep", backend="xla", num_max_dispatch_tokens_per_rank=tokens, hidden=hidden,
                         num_experts=EXPERTS)


def dense_shaped_experts():
    return jnp.zeros((EXPERTS, D_MODEL, D_FF)), jnp.zeros((EXPERTS, D_MODEL, D_FF)), jnp.zeros((EXPERTS, D_FF, D_MODEL))


def test_global_view_on_a_mesh_with_explicit_axes():
    """jax.make_mesh's meshes have explicit axes, on which shard_map takes only inputs laid out as its in_specs
    say: the block lays out its tokens and weights itself, and gives the results of an auto-axis mesh (under
    jax.set_mesh, as JAX asks of explicit meshes for differentiation)."""
    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    x = jax.random.normal(jax.random.key(0), (32, 128))
    results = {}
    for name, ep_mesh in [("auto", Mesh(np.array(devices), ("ep",))),
                          ("explicit", jax.make_mesh((4,), ("ep",), devices=devices,
                                                     axis_types=(jax.sharding.AxisType.Explicit,)))]:
        moe = MoE(128, 64, 8, 2, mesh=ep_mesh, dispatcher="xla", rngs=nnx.Rngs(0))
        with jax.set_mesh(ep_mesh):
            y, _ = moe(x)
            y_jit, _ = nnx.jit(lambda m, x: m(x))(moe, x)
            grads = nnx.grad(lambda m, x: jnp.sum(m(x)[0]))(moe, x)
        results[name] = [np.asarray(a) for a in (y, y_jit, grads.w_gate_up[...], grads.router_kernel[...])]
    for auto, explicit in zip(results["auto"], results["explicit"]):
        np.testing.assert_allclose(explicit, auto, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_chunks", [1, 2])
@pytest.mark.usefixtures("triton_lowers_for_an_h200")
def test_block_lowers_for_cuda_with_the_grouped_kernels_at_two_ranks(monkeypatch, num_chunks):
    """The GPU tests' repeated block step (tests/gpu/test_flax_moe_gpu.py: D=F=256, 8 experts, K=2, 512 tokens) at
    two ranks, with jax_ep's grouped kernels chosen as on a Hopper GPU, lowers for CUDA forward + backward, and its
    grouped kernels take rows in whole 8-row tiles: its default capacity, 2 x 256 x 2 + 4 x 7 = 1052 rows a rank
    (540 in two chunks), is rounded up to 1056 (544), so no grouped matmul pads its rows. (With 1052 rows and no
    padding this lowering failed, as the step did on two H200s.)"""
    import importlib

    gm_module = importlib.import_module("jax_ep.grouped_matmul")
    ga_module = importlib.import_module("jax_ep.grouped_activation")
    if gm_module._pallas_modules().ours is None:
        pytest.skip("this JAX has no Pallas Mosaic GPU")
    monkeypatch.setattr(gm_module, "_hopper_unsupported_reason", lambda: None)
    monkeypatch.setattr(ga_module, "resolve_implementation", lambda x, w, implementation="auto": "pallas")
    monkeypatch.setattr(gm_module, "_num_sms", lambda budget=None: 132)  # an H200's (no GPU here to ask)
    moe = MoE(256, 256, 8, 2, mesh=mesh_of(2), dispatcher="xla", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
              num_chunks=num_chunks, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(moe)
    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)

    def step(state, x):
        def loss(state, x):
            y, aux = nnx.merge(graphdef, state)(x)
            return jnp.sum(y.astype(jnp.float32)) + aux.load_balancing_loss
        return jax.value_and_grad(loss, argnums=(0, 1))(state, x)

    rows = []
    original = gm_module.pallas_grouped_op

    def recording(op, kernels, lhs, *args, **kwargs):
        rows.append(lhs.shape[0])
        return original(op, kernels, lhs, *args, **kwargs)

    monkeypatch.setattr(gm_module, "pallas_grouped_op", recording)
    monkeypatch.setattr(ga_module, "pallas_grouped_op", recording)
    text = jax.jit(step).trace(state, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text
    assert set(rows) == {1056 if num_chunks == 1 else 544}, rows
