"""`MoE`: an expert-parallel mixture-of-experts block (flax.nnx) on jax_ep's dispatch and combine."""
from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _checks
from jax_ep.expert_major import default_capacity, padding_rows
from jax_ep.flax.experts import dense_gates, grouped_swiglu, swiglu
from jax_ep.flax.routing import RouterConfig, route, router_statistics
from jax_ep.grouped_matmul import GROUP_ROW_ALIGNMENT

Dispatcher = Literal["normal", "low_latency", "xla", "none"]
DISPATCHERS = ("normal", "low_latency", "xla", "none")
EXPERT_WEIGHTS = ("w_gate_up", "w_down")  # [E, D, 2F], [E, F, D]: sharded over the EP axis
SHARED_WEIGHTS = ("shared_w_gate_up", "shared_w_down")  # [D, 2Fs], [Fs, D]: replicated


class ExpertBias(nnx.Variable):
    """Per-expert bias added to the router scores for the top-k selection only (DeepSeek-V3). Not an
    `nnx.Param`: optimizers over Params leave it alone; `MoE.update_expert_bias` moves it with the load."""


class MoEAux(NamedTuple):
    load_balancing_loss: jax.Array  # float32: E/(K T) sum_e count_e P_e over all tokens; 1 when balanced
    router_z_loss: jax.Array  # float32: mean logsumexp(logits)^2
    tokens_per_expert: jax.Array  # int32 [E]: (token, expert) assignments over all tokens
    # int32, over the ranks: received (token, expert) pairs that did not fit the capacity; with the low_latency
    # dispatcher, top-k entries not sent because their expert's rank is masked (jax_ep.masks)
    num_dropped: jax.Array


def _axis_bound(axis_name: str) -> bool:
    """Whether we are inside a shard_map (or another map) over `axis_name`."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def _laid_out(mesh: Mesh, values, specs):
    """`values` in the layout of `specs` on a mesh with explicit axes (jax.make_mesh's default): shard_map takes
    such inputs only as its in_specs lay them out, while on auto axes it moves them itself."""
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return values
    return jax.tree.map(lambda value, spec: jax.sharding.reshard(value, NamedSharding(mesh, spec)), values, specs,
                        is_leaf=lambda x: x is None)


def _expert_init():
    # fan-in scaling per expert: the input axis is -2, the expert axis a batch axis.
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                             batch_axis=(0,))


# SMs a block's own Buffer leaves to kernels that XLA may run on other streams beside the block, those of its
# asynchronous collectives (NCCL's take a few tens): a normal-mode kernel needs every one of its blocks resident at
# once, so one that wanted SMs such a kernel holds would wait for it.
SMS_LEFT_FOR_COLLECTIVES = 32


def block_config(mesh: Mesh) -> jax_ep.Config:
    """The Config of a block's own normal-mode Buffer: its kernels on the SMs of the mesh's GPUs (the fewest any has)
    but SMS_LEFT_FOR_COLLECTIVES, at least the default's: the block's stages run one after another, so no
    computation of the block runs beside its communication. Elsewhere (no SM count: CPU) the default."""
    counts = [getattr(device, "core_count", None) for device in mesh.devices.flat]
    if not all(counts):
        return jax_ep.Config()
    return jax_ep.Config(num_sms=max(jax_ep.Config().num_sms, min(counts) - SMS_LEFT_FOR_COLLECTIVES))


class MoE(nnx.Module):
    """A mixture-of-experts block: router, SwiGLU experts (optionally plus shared experts), returning
    `(y, MoEAux)` with y shaped like x ([..., d_model]).

    dispatcher:
      "normal"       jax_ep.dispatch / combine on a Buffer with `backend` ("auto": the CUDA kernels where built)
      "xla"          the same ops on a backend="xla" Buffer (portable; the reference of the kernels)
      "low_latency"  jax_ep.low_latency_dispatch / combine (BF16 on the wire); needs max_tokens_per_rank
      "none"         no communication: every token through its top-k experts densely (E x the expert
                     FLOPs); the single-device reference
    Weights: router_kernel [D, E], w_gate_up [E, D, 2F] (each expert's gate kernel in the first F columns, its
    up projection's in the last F: one matmul computes both) and w_down [E, F, D] (sharded over `axis_name`
    when a mesh is given), shared_w_gate_up [D, 2Fs] and shared_w_down [Fs, D] when shared_d_ff is set,
    expert_bias [E] (`ExpertBias`) when asked. `from_dense` takes separate gate and up kernels.

    Two ways to call it:
      global view: x holds every token (leading axes flattened, their count a multiple of the EP size);
        the block opens its own jax.shard_map over `mesh` with the tokens sharded over `axis_name`.
      inside your shard_map over `axis_name` (detected): x holds this rank's tokens, and the expert weights
        must be this rank's slice [E/R, ...]. Pass the module's state in with its partition specs:
            graphdef, state = nnx.split(moe)
            def body(state, x):
                return nnx.merge(graphdef, state)(x)
            jax.shard_map(body, mesh=mesh, in_specs=(nnx.get_partition_spec(state), P("ep")),
                          out_specs=(P("ep"), P()))
      Either way the losses and counts in MoEAux cover the tokens of every rank on the EP axis.

    Router options (see RouterConfig): score_function "softmax" | "sigmoid", expert_bias (selection-only
    bias, DeepSeek-V3), n_groups / topk_groups (grouped top-k), norm_topk_prob, routed_scaling_factor.
    expert_alignment (normal / xla): each local expert's rows start at a multiple of it, the expert's group padded
    with zero rows to a multiple of it (the expert-major dispatch's expert_alignment). The default, 8 rows
    (jax_ep.grouped_matmul.GROUP_ROW_ALIGNMENT), starts every group where the grouped-matmul kernels' loads
    start; 1 packs the rows without padding.
    num_chunks n (normal / xla): the tokens go through dispatch, experts and combine in n chunks of T/n (n must
    divide each rank's T), so that XLA may run one chunk's communication beside another's matmuls; the capacity
    below is then per chunk (T/n in place of T). 1 (the default): the whole batch at once; more chunks measured
    slower at EP2 (every chunk's grouped matmuls read all the experts' weights again; docs/perf-log.md).
    capacity_factor c (normal / xla): each rank's rows hold ceil(c * T * K) (token, expert) pairs (the mean
    number a rank receives under uniform routing is T * K) plus the padding its experts' groups may need,
    (E/R) * (expert_alignment - 1) rows, so that the alignment drops no pair; the pairs past the last row are
    dropped and counted in MoEAux.num_dropped. None: R * T * min(K, E/R) pairs and the padding, which never drops.
    Either way the rows are rounded up to a multiple of 8, the grouped kernels' row tiles.
    buffer: an existing jax_ep.Buffer to use (share one among layers; pass one to the Linen wrapper, which
    builds the module again at every apply); by default the block makes its own from mesh and axis_name, whose
    kernels take the GPU's SMs but 32 left to XLA's collectives (`block_config`): the block runs its stages one
    after another, so none of its computation runs beside its communication.
    dtype: computation dtype of the experts and of the tokens on the wire (None: that of x); the router runs
    in float32. param_dtype: dtype of the weights.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, num_experts_per_tok: int, *,
                 mesh: Mesh | None = None, axis_name: str = "ep", dispatcher: Dispatcher = "normal",
                 backend: str = "auto", buffer: jax_ep.Buffer | None = None, max_tokens_per_rank: int | None = None,
                 score_function: Literal["softmax", "sigmoid"] = "softmax", expert_bias: bool = False,
                 n_groups: int = 1, topk_groups: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, shared_d_ff: int | None = None,
                 capacity_factor: float | None = None, expert_alignment: int = GROUP_ROW_ALIGNMENT,
                 num_chunks: int = 1, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"jax_ep.flax.MoE: dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        self.expert_alignment = _checks.positive("flax.MoE", "expert_alignment", expert_alignment)
        self.num_chunks = _checks.positive("flax.MoE", "num_chunks", num_chunks)
        if num_chunks > 1 and dispatcher not in ("normal", "xla"):
            raise ValueError(f"jax_ep.flax.MoE: num_chunks applies to the 'normal' and 'xla' dispatchers, got "
                             f"num_chunks={num_chunks} with dispatcher={dispatcher!r}")
        if capacity_factor is not None:
            if not (isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor)
                    and capacity_factor > 0):
                raise ValueError(f"jax_ep.flax.MoE: capacity_factor must be a positive number or None, got "
                                 f"{capacity_factor!r}")
            if dispatcher not in ("normal", "xla"):
                raise ValueError(f"jax_ep.flax.MoE: capacity_factor applies to the 'normal' and 'xla' dispatchers, "
                                 f"got capacity_factor={capacity_factor} with dispatcher={dispatcher!r}")
        self.router_config = RouterConfig(num_experts, num_experts_per_tok, score_function, n_groups,
                                          topk_groups, norm_topk_prob, routed_scaling_factor)
        self.d_model, self.num_experts, self.dispatcher = d_model, num_experts, dispatcher
        self.capacity_factor, self.dtype = capacity_factor, dtype
        self.buffer = None if dispatcher == "none" else self._make_buffer(
            buffer, mesh, axis_name, backend, max_tokens_per_rank)
        self.mesh = self.buffer.mesh if self.buffer is not None else mesh
        self.axis_name = self.buffer.axis_name if self.buffer is not None else axis_name

        def param(init, shape, sharding):
            if self.mesh is not None:
                init = nnx.with_partitioning(init, sharding, mesh=self.mesh)
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        replicated = (None, None)
        by_expert = (self.axis_name, None, None)
        self.router_kernel = param(nnx.initializers.lecun_normal(), (d_model, num_experts), replicated)
        self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32)) if expert_bias else None
        self.w_gate_up = param(_expert_init(), (num_experts, d_model, 2 * d_ff), by_expert)
        self.w_down = param(_expert_init(), (num_experts, d_ff, d_model), by_expert)
        self.shared_d_ff = shared_d_ff
        if shared_d_ff:
            self.shared_w_gate_up = param(nnx.initializers.lecun_normal(), (d_model, 2 * shared_d_ff), replicated)
            self.shared_w_down = param(nnx.initializers.lecun_normal(), (shared_d_ff, d_model), replicated)

    def _make_buffer(self, buffer, mesh, axis_name, backend, max_tokens_per_rank) -> jax_ep.Buffer:
        if buffer is not None:
            self._check_buffer(buffer, max_tokens_per_rank)
            return buffer
        if mesh is None:
            raise ValueError(f"jax_ep.flax.MoE: dispatcher={self.dispatcher!r} needs a mesh (or a buffer)")
        if axis_name in mesh.shape:  # (else the Buffer names the missing axis)
            self._check_experts_split(int(mesh.shape[axis_name]))
        if self.dispatcher != "low_latency":
            return jax_ep.Buffer(mesh, axis_name, backend="xla" if self.dispatcher == "xla" else backend,
                                 config=block_config(mesh))
        if max_tokens_per_rank is None:
            raise ValueError("jax_ep.flax.MoE: dispatcher='low_latency' needs max_tokens_per_rank (the most tokens "
                             "one rank sends per call; it sizes the receive buffers)")
        return jax_ep.Buffer(mesh, axis_name, backend=backend, num_max_dispatch_tokens_per_rank=max_tokens_per_rank,
                             hidden=self.d_model, num_experts=self.num_experts)

    def _check_experts_split(self, num_ranks: int) -> None:
        if self.num_experts % num_ranks:
            raise ValueError(f"jax_ep.flax.MoE: num_experts={self.num_experts} must be a multiple of the EP axis size "
                             f"{num_ranks} (each rank holds num_experts / R experts)")

    def _check_buffer(self, buffer: jax_ep.Buffer, max_tokens_per_rank) -> None:
        """A Buffer passed in must fit the block: the xla backend for dispatcher='xla', and for 'low_latency' the
        sizes its receive buffers were made for (the ops would refuse them only at the first call)."""
        self._check_experts_split(buffer.num_ranks)
        if self.dispatcher == "xla" and buffer.backend != "xla":
            raise ValueError(f"jax_ep.flax.MoE: dispatcher='xla' needs a backend='xla' Buffer, got {buffer!r}")
        if self.dispatcher != "low_latency":
            return
        if buffer.num_max_dispatch_tokens_per_rank is None:
            raise ValueError("jax_ep.flax.MoE: dispatcher='low_latency' needs a Buffer made with "
                             "num_max_dispatch_tokens_per_rank, hidden and num_experts (low-latency sizes)")
        # The Buffer's size, the block's, and the block's argument that gives it.
        sizes = {"hidden": (buffer.hidden, self.d_model, "d_model"),
                 "num_experts": (buffer.num_experts, self.num_experts, "num_experts")}
        if max_tokens_per_rank is not None:
            sizes["num_max_dispatch_tokens_per_rank"] = (buffer.num_max_dispatch_tokens_per_rank,
                                                         max_tokens_per_rank, "max_tokens_per_rank")
        for name, (got, wanted, argument) in sizes.items():
            if got != wanted:
                raise ValueError(f"jax_ep.flax.MoE: the buffer's {name} is {got}, the block's {argument} {wanted}")

    def _weights(self) -> dict:
        names = ("router_kernel", *EXPERT_WEIGHTS) + (SHARED_WEIGHTS if self.shared_d_ff else ())
        weights = {name: getattr(self, name)[...] for name in names}
        weights["expert_bias"] = None if self.expert_bias is None else self.expert_bias[...]
        return weights

    def __call__(self, x) -> tuple[jax.Array, MoEAux]:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"jax_ep.flax.MoE: x must end in d_model={self.d_model} channels, got shape {x.shape}")
        tokens = x.reshape(-1, self.d_model)
        weights = self._weights()
        if self.dispatcher == "none":
            y, aux = self._forward(weights, tokens, axis_name=None)
        elif _axis_bound(self.axis_name):
            y, aux = self._forward(weights, tokens, axis_name=self.axis_name)
        else:
            specs = {name: P(self.axis_name) if name in EXPERT_WEIGHTS else P() for name in weights}
            weights, tokens = _laid_out(self.mesh, (weights, tokens), (specs, P(self.axis_name)))
            y, aux = jax.shard_map(
                lambda w, t: self._forward(w, t, axis_name=self.axis_name), mesh=self.mesh,
                in_specs=(specs, P(self.axis_name)), out_specs=(P(self.axis_name), MoEAux(P(), P(), P(), P())),
            )(weights, tokens)
        return y.reshape(x.shape[:-1] + (self.d_model,)), aux

    def _forward(self, weights: dict, x, axis_name: str | None):
        """The block on the tokens x [T, D] given; with axis_name, per rank inside a shard_map over it."""
        num_ranks = 1 if axis_name is None else jax.lax.axis_size(axis_name)
        expected = self.num_experts // num_ranks
        if weights["w_gate_up"].shape[0] != expected:
            raise ValueError(
                f"jax_ep.flax.MoE: expected the expert weights of {expected} experts here, got "
                f"{weights['w_gate_up'].shape[0]}; inside a shard_map pass the module state with "
                f"in_specs=nnx.get_partition_spec(state) (each rank holds its slice of the experts)")
        dtype = self.dtype or x.dtype
        routing = route(x, weights["router_kernel"], weights["expert_bias"], self.router_config)
        x = x.astype(dtype)
        experts = [weights[name].astype(dtype) for name in EXPERT_WEIGHTS]
        num_dropped = jnp.zeros((), jnp.int32)
        if self.dispatcher == "none":
            gates = dense_gates(routing.topk_idx, routing.topk_weights, self.num_experts)
            y = jnp.einsum("te,etd->td", gates, swiglu(x[None], *experts))
        elif self.dispatcher == "low_latency":
            # Low-latency ops move BF16 and return the gate-weighted sum over the top-k experts.
            ll = jax_ep.low_latency_dispatch(self.buffer, x.astype(jnp.bfloat16), routing.topk_idx, use_fp8=False)
            # Rows past recv_count are unspecified (the cuda kernels leave old bytes there, maybe NaN): zero them,
            # or the expert weights' gradients (sum over rows of row * 0) could turn NaN.
            valid = jnp.arange(ll.recv_x.shape[1])[None, :] < ll.recv_count[:, None]
            recv_x = jnp.where(valid[..., None], ll.recv_x, jnp.zeros((), ll.recv_x.dtype))
            expert_out = swiglu(recv_x, *experts)  # [L, R*M, D]; combine reads only the recv_count valid rows
            y = jax_ep.low_latency_combine(self.buffer, expert_out.astype(jnp.bfloat16), routing.topk_idx,
                                           routing.topk_weights, ll.handle)
            # With masked ranks (Config(on_timeout="mask")), the entries naming their experts went nowhere.
            num_dropped = jax.lax.psum(ll.num_masked, axis_name)
        else:
            # Rows are (token, local expert) pairs grouped by expert: the grouped matmuls take them as they come,
            # and combine applies the gate weights while it sums each token's pairs. With num_chunks > 1 each
            # chunk of the tokens goes through on its own: one chunk's communication does not depend on another's
            # matmuls, so XLA may run them at once (the xla backend's collectives are asynchronous).
            num_tokens = x.shape[0]
            if num_tokens % self.num_chunks:
                raise ValueError(f"jax_ep.flax.MoE: num_chunks={self.num_chunks} must divide the {num_tokens} "
                                 "tokens per rank")
            chunk = num_tokens // self.num_chunks
            outputs = []
            for first in range(0, num_tokens, chunk):
                part = slice(first, first + chunk)
                d = jax_ep.dispatch(self.buffer, x[part], routing.topk_idx[part], routing.topk_weights[part],
                                    num_experts=self.num_experts, max_recv_tokens=self._capacity(chunk, num_ranks),
                                    expert_alignment=self.expert_alignment, layout="expert_major")
                # The combine reads only the pairs' rows: the rows past the groups (the capacity's spare, by
                # default about R times the rows the groups fill) cost the expert FFN no stores.
                expert_out = grouped_swiglu(d.recv_x, d.num_recv_tokens_per_expert, *experts, zero_past_groups=False)
                outputs.append(jax_ep.combine(self.buffer, expert_out.astype(dtype), d.handle,
                                              weights=d.recv_weights).x)
                num_dropped = num_dropped + d.num_dropped
            y = jnp.concatenate(outputs)
            num_dropped = jax.lax.psum(num_dropped, axis_name)
        if self.shared_d_ff:
            y = y + swiglu(x, *(weights[name].astype(dtype) for name in SHARED_WEIGHTS))
        statistics = router_statistics(routing, self.router_config, axis_name)
        return y.astype(dtype), MoEAux(*statistics, num_dropped)

    def _capacity(self, num_tokens: int, num_ranks: int) -> int:
        """Rows per rank (the expert-major dispatch's max_recv_tokens): the default that never drops, or
        capacity_factor times the mean number of pairs plus the experts' padding, at most that default; rounded up
        to a multiple of GROUP_ROW_ALIGNMENT, the row tiles the grouped matmuls' and the SwiGLU's kernels take
        whole (other counts cost the grouped matmuls a padded copy of their row operands)."""
        num_topk = self.router_config.num_experts_per_tok
        num_local_experts = self.num_experts // num_ranks
        rows = default_capacity(num_ranks, num_tokens, num_topk, num_local_experts, self.expert_alignment)
        if self.capacity_factor is not None:
            pairs = math.ceil(self.capacity_factor * num_tokens * num_topk)
            rows = max(1, min(rows, pairs + padding_rows(num_local_experts, self.expert_alignment)))
        return -(-rows // GROUP_ROW_ALIGNMENT) * GROUP_ROW_ALIGNMENT

    def update_expert_bias(self, tokens_per_expert, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing step: raise the bias of experts that got fewer than
        the mean number of tokens, lower the others', by `rate` (tokens_per_expert from MoEAux)."""
        if self.expert_bias is None:
            raise ValueError("jax_ep.flax.MoE.update_expert_bias: create the block with expert_bias=True")
        load = tokens_per_expert.astype(jnp.float32)
        self.expert_bias[...] = self.expert_bias[...] + rate * jnp.sign(jnp.mean(load) - load)
