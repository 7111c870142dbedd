"""The interface every backend implements.

A Buffer creates one backend object when it is created and keeps it (`Buffer.backend_impl`); the ops of
jax_ep/ops.py check their arguments, then call its methods inside `shard_map` over the Buffer's EP axis (per rank:
arrays are this rank's). docs/design.md ("Semantics") says what each computes. The backends:

- `jax_ep.backends.xla.XlaBackend`: pure JAX collectives on any platform (`Buffer.backend` "xla").
- `jax_ep.backends.cuda.intranode.IntranodeBackend`: the CUDA kernels of one NVLink domain, normal and
  low-latency modes (`Buffer.backend` "cuda").
- `jax_ep.backends.cuda.internode.InternodeBackend`: the CUDA kernels over several nodes, normal mode only
  (`Buffer.backend` "cuda", `Buffer.internode` True).

A backend object is an immutable, hashable record of what its calls need from the Buffer (its EP axis, its ids in
the native runtime, sizes, timeouts): the ops pass it to `jax.custom_vjp` functions as a static argument. Device
memory is allocated while the Buffer is created and freed by `destroy()`; nothing else changes it.

The methods take arguments already checked by the ops (types, shapes, sizes); a backend raises only for what its
own kernels cannot do (their limits, a workspace too small, a handle it cannot combine along).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LowLatencyCast:
    """How the low-latency dispatch casts its rows (docs/design.md, "FP8 payloads")."""

    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False


class Backend(abc.ABC):
    """One backend of a Buffer. The low-latency methods are those of a backend that runs low-latency ops; the
    others raise from `check_low_latency`, which the ops call first."""

    name: ClassVar[str]  # Buffer.backend: "xla" or "cuda"
    internode: ClassVar[bool] = False  # whether it runs the internode kernels (Buffer.internode)
    # How its low-latency kernels reach their peers, "peer_stores" or "nvshmem"; None where no low-latency kernels
    # run (Buffer.low_latency_transport).
    low_latency_transport: str | None = None

    # ---- normal mode ------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def dispatch(self, x_leaves: tuple, topk_idx, topk_weights, *, num_experts: int, capacity: int,
                 expert_alignment: int) -> tuple:
        """Normal dispatch of x_leaves (one [T, ...] array, or the FP8 pair) along topk_idx [T, K]. Returns
        (recv leaves [C, ...], recv_topk_idx, recv_topk_weights or None, num_recv_tokens,
        num_recv_tokens_per_expert, num_dropped, invalid_ids, handle); the handle starts with recv_src_index and
        is_token_in_rank, so that any backend's cached dispatch can follow it."""

    @abc.abstractmethod
    def all_gather(self, x) -> jax.Array:
        """x [n, ...] of every rank -> [R*n, ...] in rank order, on every rank (strict's agreement on the counts).
        The cuda backends use their own kernels: XLA's collectives on GPUs are NCCL's, which refuses two ranks on
        one GPU."""

    @abc.abstractmethod
    def cached_dispatch(self, leaf, handle) -> jax.Array:
        """New data [T, ...] placed along the routing of `handle` (a normal-mode handle of any backend) -> [C, ...]."""

    @abc.abstractmethod
    def combine(self, y, handle, *, bias=None, out_dtype=jnp.float32) -> jax.Array:
        """y [C, ...] -> [T, ...] of out_dtype: each token's rows summed in float32 (in the order docs/design.md
        gives this backend), plus `bias` in float32, cast once."""

    # ---- the expert-major layout (jax_ep/expert_major.py) ------------------------------------------------------

    def runs_expert_major_kernels(self, num_experts: int, num_topk: int) -> bool:
        """Whether this backend's own kernels run an expert-major dispatch with these sizes (the methods below);
        else the composed path does, on the normal-mode methods above."""
        return False

    def expert_major_dispatch(self, x_leaves: tuple, topk_idx, topk_weights, *, num_experts: int, capacity: int,
                              expert_alignment: int) -> tuple:
        """Expert-major dispatch by the backend's kernels. Returns (recv leaves [C, ...], pair weights [C] or None,
        group sizes [L], group offsets [L], kept pairs, dropped pairs, invalid ids, ExpertMajorHandle (by_kernels),
        the capacity that keeps every pair)."""
        raise self._no_expert_major_kernels()

    def expert_major_cached_dispatch(self, leaf, handle) -> jax.Array:
        """leaf [T, ...] on the rows of a by_kernels handle -> [C, ...]."""
        raise self._no_expert_major_kernels()

    def expert_major_combine(self, y, weights, pair_row, handle, *, bias=None, out_dtype=jnp.float32) -> jax.Array:
        """y [C', ...] -> [T, ...] of out_dtype along a by_kernels handle, with `pair_row` [R*T, P'] naming each
        received token's rows of y (the handle's, or rows of another table): per rank each token's rows weighted by
        `weights` [C'] (or not) and summed in float32, rounded to y's dtype; those partials summed home in float32
        in rank order, plus `bias`, cast once."""
        raise self._no_expert_major_kernels()

    def expert_major_combine_backward(self, d_out, y, weights, handle) -> tuple:
        """The VJP of the combine of y [C, ...] along a by_kernels handle, for its cotangent d_out [T, ...] (y's
        dtype): (d_y [C, ...] of y's dtype, d_weights float32 [C] or None without weights). On a row with a pair
        d_y = weights[row] * d_out[token] (the float32 product rounded) and d_weights = the float32 dot of
        d_out[token] and y[row]; on every other row d_weights is zero, and so is d_y up to
        _C.limits()["expert_major_grad_zero_rows"] rows past the last group (unspecified after them)."""
        raise self._no_expert_major_kernels()

    def _no_expert_major_kernels(self) -> TypeError:
        return TypeError("jax_ep: this expert-major handle comes from the cuda backend's kernels; pass it to ops of a "
                         f"Buffer of that backend (this Buffer's backend is {self.name!r})")

    # ---- low-latency mode -------------------------------------------------------------------------------------

    def check_low_latency(self, op: str, *, num_experts: int) -> None:
        """Raises when this Buffer cannot run low-latency op `op` with `num_experts` experts."""
        raise NotImplementedError(f"jax_ep.{op}: the low-latency ops are not available on this Buffer ({self.name} "
                                  f"backend{', internode' if self.internode else ''})")

    def low_latency_dispatch_send(self, x, topk_idx, *, num_experts: int, num_max_tokens: int,
                                  cast: LowLatencyCast) -> Any:
        """Send half of the low-latency dispatch of x bfloat16 [T, H]: the state its receive half takes."""
        raise NotImplementedError(self.name)

    def low_latency_dispatch_recv(self, state, *, num_experts: int, num_max_tokens: int,
                                  cast: LowLatencyCast, masked=None) -> tuple:
        """Receive half: (recv leaves [L, R*M, ...], recv_count [L], handle, invalid_ids); nothing from the ranks
        in `masked` (bool [R], or None: none; see jax_ep.masks)."""
        raise NotImplementedError(self.name)

    def low_latency_combine_send(self, y, handle, topk_idx, topk_weights, *, num_experts: int,
                                 num_max_tokens: int, compression: str | None = None, masked=None) -> Any:
        """Send half of the low-latency combine of y bfloat16 [L, R*M, H]: the state its receive half takes.
        `compression`: None, or one of COMBINE_COMPRESSIONS (the rows travel in that format); nothing returned to
        the ranks in `masked`."""
        raise NotImplementedError(self.name)

    def low_latency_mask(self, op: str):
        """bool [R]: the ranks this rank masks (jax_ep.masks), read when op runs (inside the shard_map)."""
        raise NotImplementedError(f"jax_ep.{op}: masked ranks (Config(on_timeout='mask')) are not available on "
                                  f"the {self.name} backend yet")

    def reset_low_latency(self, *, num_max_tokens: int, hidden: int, num_experts: int, resets: int) -> None:
        """Buffer.reset_low_latency (collective; its `resets`-th call): every local rank's low-latency state as new,
        with no masks."""
        raise NotImplementedError(self.name)

    def low_latency_combine_recv(self, state, *, num_experts: int, num_max_tokens: int,
                                 compression: str | None = None) -> jax.Array:
        """Receive half: bfloat16 [T, H], the top-k weighted sum of each token's expert rows."""
        raise NotImplementedError(self.name)

    # ---- lifetime ---------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def destroy(self) -> str:
        """Frees the device memory created with this backend; returns '' or the problems met."""

    @abc.abstractmethod
    def errors(self) -> list[str]:
        """One line per rank of this process whose kernel timed out waiting for a peer (op, rank, peer, call)."""
