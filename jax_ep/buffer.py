"""`Buffer`: the per-EP-group communication state, created outside `jit` from a mesh and its EP axis."""
from __future__ import annotations

import itertools
import warnings
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh

from jax_ep import environment
from jax_ep._checks import is_int
from jax_ep.backends import Backend
from jax_ep.backends.cuda import internode
from jax_ep.backends.selection import BackendSpec, create_backend, platform_of
from jax_ep.config import HIDDEN_ALIGNMENT, Config

BackendName = Literal["auto", "cuda", "xla"]
LowLatencyTransport = Literal["auto", "nvshmem"]

_buffer_ids = itertools.count(1)
# Staging room per GPU for normal-mode ops in EP groups spanning processes (see Buffer).
DEFAULT_NUM_NVL_BYTES = 1 << 30


class Buffer:
    """Communication state for expert parallelism over one mesh axis.

    Create it outside `jit`; pass it to `jax_ep.dispatch`, `combine`, ... inside a `shard_map` over
    `axis_name`. Low-latency ops need `num_max_dispatch_tokens_per_rank`, `hidden` and `num_experts`
    (the buffer is sized for them and every call is checked against them).
    Use as a context manager or call `destroy()` to release device memory.

    `num_nvl_bytes` (cuda backend, EP groups spanning processes only): per-GPU room where each normal-mode op
    stages the inputs its peers read, since other processes cannot map XLA's buffers; default 1 GiB.
    `jax_ep.normal_buffer_bytes(...)` gives what given shapes need; a call that needs more raises.

    `low_latency_transport` (cuda backend with low-latency sizes): "auto" writes rows and flags with plain stores
    through peer pointers inside the NVLink domain; "nvshmem" puts them into NVSHMEM symmetric memory (one
    process per GPU over every process of the job; creating the Buffer initialises NVSHMEM and is collective).
    An internode Buffer (below) always takes "nvshmem": plain stores to the ranks of its node, puts to the others.
    The environment variable JAX_EP_LL_TRANSPORT=nvshmem makes "auto" mean "nvshmem" (for tests and benchmarks;
    jax_ep.environment lists the overrides, read here, when the Buffer is created).
    The resolved choice is `buffer.low_latency_transport`: "peer_stores", "nvshmem", or None.

    `ranks_per_node`: GPUs per node along the EP axis (EP rank g sits on node g // ranks_per_node). When it is
    below the axis size, or when it is not given and the axis spans several hosts, the cuda backend runs the
    internode normal mode (NVSHMEM between nodes, NVLink inside them; one process per GPU, see
    `jax_ep.backends.cuda.internode`). Setting it on one host (e.g. 2 on 4 GPUs) runs that mode with NVSHMEM carrying the
    traffic between the "nodes". `num_rdma_bytes` (internode mode): the per-GPU NVSHMEM region of the normal-mode
    ops, default 1 GiB; `jax_ep.internode_buffer_bytes(...)` gives what given shapes need; a call that needs more
    raises. With low-latency sizes an internode Buffer also serves the low-latency ops (up to 64 ranks), in a
    region of its own.

    `backend_impl` is the backend object chosen at creation (jax_ep.backends: the interface the ops call);
    `backend` its name, "xla" or "cuda", and `internode` whether it runs the internode kernels.
    """

    def __init__(
        self,
        mesh: Mesh,
        axis_name: str = "ep",
        *,
        config: Config | None = None,
        backend: BackendName = "auto",
        num_max_dispatch_tokens_per_rank: int | None = None,
        hidden: int | None = None,
        num_experts: int | None = None,
        num_nvl_bytes: int | None = None,
        low_latency_transport: LowLatencyTransport = "auto",
        ranks_per_node: int | None = None,
        num_rdma_bytes: int | None = None,
    ):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"jax_ep.Buffer: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name not in mesh.shape:
            raise ValueError(f"jax_ep.Buffer: axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
        self.mesh = mesh
        self.axis_name = axis_name
        self.num_ranks = int(mesh.shape[axis_name])
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"jax_ep.Buffer: config must be a jax_ep.Config, got {type(config).__name__}")
        overrides = environment.overrides()
        self.config = (config if config is not None else Config()).with_overrides(overrides.combine,
                                                                                  overrides.push_warps)
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                            ("num_experts", num_experts), ("num_nvl_bytes", num_nvl_bytes),
                            ("num_rdma_bytes", num_rdma_bytes)):
            if value is not None and not is_int(value):
                raise TypeError(f"jax_ep.Buffer: {name} must be an integer, got {value!r}")
        self.platform = platform_of(mesh)
        if hidden is not None and (hidden <= 0 or hidden % HIDDEN_ALIGNMENT):
            raise ValueError(f"jax_ep.Buffer: hidden must be a positive multiple of {HIDDEN_ALIGNMENT}, got {hidden}")
        if num_experts is not None and (num_experts <= 0 or num_experts % self.num_ranks):
            raise ValueError(
                f"jax_ep.Buffer: num_experts must be a positive multiple of the {self.num_ranks} ranks on "
                f"axis {axis_name!r}, got {num_experts}"
            )
        if num_max_dispatch_tokens_per_rank is not None and num_max_dispatch_tokens_per_rank <= 0:
            raise ValueError(
                f"jax_ep.Buffer: num_max_dispatch_tokens_per_rank must be positive, got {num_max_dispatch_tokens_per_rank}"
            )
        if num_nvl_bytes is not None and num_nvl_bytes < 0:
            raise ValueError(f"jax_ep.Buffer: num_nvl_bytes must be >= 0, got {num_nvl_bytes}")
        if num_rdma_bytes is not None and num_rdma_bytes < 0:
            raise ValueError(f"jax_ep.Buffer: num_rdma_bytes must be >= 0, got {num_rdma_bytes}")
        if ranks_per_node is not None:
            ranks_per_node = internode.ranks_per_node_of(mesh, axis_name, ranks_per_node)  # checks it
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_nvl_bytes = DEFAULT_NUM_NVL_BYTES if num_nvl_bytes is None else int(num_nvl_bytes)
        self.num_rdma_bytes = internode.DEFAULT_NUM_RDMA_BYTES if num_rdma_bytes is None else int(num_rdma_bytes)
        self.buffer_id = next(_buffer_ids)  # this process's name of the Buffer in jax_ep._C
        spec = BackendSpec(self.buffer_id, mesh, axis_name, self.config, self.num_nvl_bytes, self.num_rdma_bytes,
                           ranks_per_node, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.backend_impl: Backend = create_backend(spec, backend, low_latency_transport,
                                                    overrides.low_latency_transport)
        # GPUs per node: the internode backend's (given or found from the hosts), else as given (or None).
        self.ranks_per_node = getattr(self.backend_impl, "ranks_per_node", ranks_per_node)
        self._alive = True
        self._low_latency_resets = 0  # reset_low_latency calls so far (names its barriers)

    @property
    def backend(self) -> str:
        """The backend the Buffer resolved: "xla" or "cuda"."""
        return self.backend_impl.name

    @property
    def internode(self) -> bool:
        """Whether the cuda backend runs the internode kernels."""
        return self.backend_impl.internode

    @property
    def low_latency_transport(self) -> str | None:
        """How the low-latency kernels reach their peers: "peer_stores", "nvshmem", or None where none run."""
        return self.backend_impl.low_latency_transport

    @property
    def alive(self) -> bool:
        return self._alive

    def check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("jax_ep: this Buffer was destroyed; create a new one")

    def destroy(self) -> None:
        """Releases the buffer's device memory. Idempotent."""
        if self._alive:
            problems = self.backend_impl.destroy()
            if problems:
                warnings.warn(f"jax_ep.Buffer.destroy: {problems}", RuntimeWarning, stacklevel=2)
        self._alive = False

    # ---- masked ranks (low-latency ops; jax_ep.masks) -------------------------------------------------------------

    def _masks(self, what: str):
        if self.config.on_timeout != "mask":
            raise ValueError(f"jax_ep.Buffer.{what}: create the Buffer with Config(on_timeout='mask') to mask ranks")
        return self.backend_impl.masks

    def _local_ranks(self) -> list[int]:
        """The EP ranks of this process's devices (all of them with one process driving every GPU)."""
        axis = self.mesh.axis_names.index(self.axis_name)
        return sorted({index[axis] for index, device in np.ndenumerate(self.mesh.devices)
                       if device.process_index == jax.process_index()})

    def _ranks(self, what: str, name: str, ranks, default=None) -> list[int]:
        if ranks is None:
            ranks = list(range(self.num_ranks)) if default is None else default
        ranks = [ranks] if is_int(ranks) else list(ranks)
        bad = [r for r in ranks if not (is_int(r) and 0 <= r < self.num_ranks)]
        if bad:
            raise ValueError(f"jax_ep.Buffer.{what}: {name} must be EP ranks in [0, {self.num_ranks}), got {bad}")
        return [int(r) for r in ranks]

    def mask_ranks(self, ranks, *, on=None) -> None:
        """From its next low-latency call on, each rank of `on` (default: this process's) masks `ranks` (an EP rank
        or several; a rank never masks itself): it sends them nothing and waits for nothing of theirs
        (jax_ep.masks). Call it between calls, with none of this Buffer's programs still running (calls are
        asynchronous: block on the last one's results first); a program reads the masks when it runs. To take a
        rank out on purpose, mask it on every rank, and on it every other rank."""
        masks = self._masks("mask_ranks")
        masks.mask(self._ranks("mask_ranks", "ranks", ranks),
                   self._ranks("mask_ranks", "on", on, default=self._local_ranks()))

    def unmask_ranks(self, ranks=None, *, on=None) -> None:
        """Each rank of `on` (default: this process's) stops masking `ranks` (default: all), from its next call on,
        under the same rule as mask_ranks. A rank let back in resumes with results from every rank at once (the xla
        backend keeps no state between calls). The cuda backend refuses: there reset_low_latency lets ranks back in."""
        masks = self._masks("unmask_ranks")
        masks.unmask(self._ranks("unmask_ranks", "ranks", ranks),
                     self._ranks("unmask_ranks", "on", on, default=self._local_ranks()))

    def reset_low_latency(self) -> None:
        """Collective (every process of the Buffer calls it, between calls, with none of the Buffer's programs
        running): every rank's low-latency state back to a new Buffer's, with no masks and calls counted from 0.
        How a masked rank is let back in once the job has re-synchronised; on the cuda backend the only way (the
        kernels' call numbers, credits and flags restart on every rank together), where each process waits for the
        others before and after (each wait bounded by Config.host_timeout_s)."""
        self.check_alive()
        self._low_latency_resets += 1
        self.backend_impl.reset_low_latency(num_max_tokens=self.num_max_dispatch_tokens_per_rank, hidden=self.hidden,
                                            num_experts=self.num_experts, resets=self._low_latency_resets)

    def masked_ranks(self) -> dict[int, dict[int, int]]:
        """{rank: {masked peer: the call of that rank from which it masks the peer}} for this process's ranks: the
        number of low-latency dispatches the rank had started when the mask took effect."""
        return self._masks("masked_ranks").masked(self._local_ranks())

    def errors(self) -> list[str]:
        """One line per rank of this process whose kernel timed out waiting for a peer (op, rank, peer, call); the
        records survive the trap that ends such a kernel (see jax_ep.backends.cuda)."""
        return self.backend_impl.errors()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        nodes = ""
        if self.internode:
            nodes = f", internode: {self.num_ranks // self.ranks_per_node} nodes x {self.ranks_per_node}"
        return (
            f"Buffer(axis={self.axis_name!r}, ranks={self.num_ranks}, backend={self.backend!r}{nodes}, "
            f"platform={self.platform!r})"
        )
