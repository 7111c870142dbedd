"""Which backend serves a Buffer, and creating it from a plain `BackendSpec` (the one place that chooses)."""
from __future__ import annotations

import dataclasses
import warnings

import jax
from jax.sharding import Mesh

from jax_ep import _native, environment
from jax_ep.backends import Backend
from jax_ep.backends.cuda import internode, intranode
from jax_ep.backends.xla import XlaBackend
from jax_ep.config import LOW_LATENCY_TRANSPORTS, Config

BACKENDS = ("auto", "cuda", "xla")


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a backend is created from: the Buffer's arguments, checked, with defaults filled in."""

    buffer_id: int  # this process's name of the Buffer in jax_ep._C
    mesh: Mesh
    axis_name: str
    config: Config
    num_nvl_bytes: int  # staging room per GPU of normal-mode ops in groups spanning processes
    num_rdma_bytes: int  # NVSHMEM region per GPU of the internode normal-mode ops
    ranks_per_node: int | None  # None: found from the hosts of the mesh's devices
    # Low-latency sizes: all three, or None where the Buffer has no low-latency ops.
    num_max_dispatch_tokens_per_rank: int | None = None
    hidden: int | None = None
    num_experts: int | None = None

    @property
    def num_ranks(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    @property
    def has_low_latency_sizes(self) -> bool:
        return None not in (self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)


def platform_of(mesh: Mesh) -> str:
    platforms = {d.platform for d in mesh.devices.flat}
    if len(platforms) != 1:
        raise ValueError(f"jax_ep.Buffer: the mesh mixes device platforms {sorted(platforms)}")
    return platforms.pop()


def resolve_backend(requested: str, platform: str) -> str:
    """`auto` takes the CUDA kernels on CUDA devices when they were built, else the portable `xla` backend."""
    if requested not in BACKENDS:
        raise ValueError(f"jax_ep: backend must be one of {BACKENDS}, got {requested!r}")
    cuda_kernels = _native.has_target(intranode.DISPATCH_TARGET, "cuda")  # the CUDA normal-mode kernels were built
    if requested == "xla":
        return "xla"
    if requested == "cuda":
        if platform != "gpu":
            raise ValueError(f"jax_ep: backend='cuda' needs CUDA devices, the mesh is on {platform!r}")
        if not cuda_kernels:
            raise RuntimeError(
                "jax_ep: backend='cuda' asked for, but this build has no CUDA dispatch/combine kernels "
                "(see the feature table in README.md); use backend='xla' or 'auto'"
            )
        return "cuda"
    return "cuda" if platform == "gpu" and cuda_kernels else "xla"


def one_process_per_gpu(mesh: Mesh) -> bool:
    """Whether every process of the job owns exactly one device of `mesh` (NVSHMEM's process model: one PE per
    process, and its symmetric allocations are collective over every process)."""
    processes = [d.process_index for d in mesh.devices.flat]
    return len(set(processes)) == len(processes) == jax.process_count()


def resolve_low_latency_transport(requested: str, *, backend: str, low_latency: bool, one_process_per_gpu: bool,
                                  forced: str | None = None) -> str | None:
    """How a Buffer's low-latency kernels reach their peers: "peer_stores" (plain stores through peer pointers
    inside the NVLink domain), "nvshmem" (NVSHMEM puts into symmetric memory), or None where no low-latency
    kernels run (the xla backend, or a Buffer without low-latency sizes).

    `requested` is the Buffer argument: "auto" takes `forced` (the $JAX_EP_LL_TRANSPORT override) when set, else
    peer stores. "nvshmem" needs one process per GPU over every process of the job, and a build with NVSHMEM.
    (An internode Buffer, whose peers are not all in one NVLink domain, takes "nvshmem" whatever this says.)"""
    if requested not in LOW_LATENCY_TRANSPORTS:
        raise ValueError(f"jax_ep.Buffer: low_latency_transport must be one of {LOW_LATENCY_TRANSPORTS}, "
                         f"got {requested!r}")
    if backend != "cuda" or not low_latency:
        if requested == "nvshmem":
            why = (f"this Buffer has the {backend!r} backend" if backend != "cuda" else
                   "this Buffer has no low-latency sizes (num_max_dispatch_tokens_per_rank, hidden, num_experts)")
            raise ValueError(f"jax_ep.Buffer: low_latency_transport='nvshmem' is for the cuda low-latency kernels; {why}")
        return None  # the environment's choice applies only to the Buffers it can apply to
    chosen = (forced or "auto") if requested == "auto" else requested
    if chosen != "nvshmem":
        return "peer_stores"
    source = "low_latency_transport='nvshmem'" if requested == "nvshmem" else f"${environment.LOW_LATENCY_TRANSPORT}=nvshmem"
    if not one_process_per_gpu:
        raise ValueError(f"jax_ep.Buffer: {source} needs one process per GPU over every process of the job "
                         "(jax.distributed.initialize with one local device each, and a mesh holding every process's "
                         "device): NVSHMEM has one PE per process. One process driving several GPUs uses peer "
                         "stores (low_latency_transport='auto')")
    _native.require_nvshmem(source)
    return "nvshmem"


def create_backend(spec: BackendSpec, backend: str, low_latency_transport: str,
                   forced_transport: str | None = None) -> Backend:
    """The backend of a new Buffer (`backend` and `low_latency_transport` as the Buffer was given them;
    `forced_transport` the environment's override), its device memory allocated."""
    resolved = resolve_backend(backend, platform_of(spec.mesh))
    transport = resolve_low_latency_transport(
        low_latency_transport, backend=resolved, low_latency=spec.has_low_latency_sizes,
        one_process_per_gpu=one_process_per_gpu(spec.mesh), forced=forced_transport)
    cuda = _create_cuda(spec, transport, auto=backend == "auto") if resolved == "cuda" else None
    return XlaBackend(spec.axis_name, spec.num_ranks) if cuda is None else cuda


def _create_cuda(spec: BackendSpec, low_latency_transport: str | None, auto: bool) -> Backend | None:
    """The cuda backend's device state: the internode kernels when the EP axis spans several nodes, else the
    intranode ones (with the low-latency region of `low_latency_transport`). None: with backend='auto' a mesh the
    kernels cannot serve falls back to the xla backend (every process sees the same mesh and hosts, so all fall
    back together)."""
    try:
        per_node = internode.ranks_per_node_of(spec.mesh, spec.axis_name, spec.ranks_per_node)
    except internode.IrregularNodesError:
        if not auto:
            raise
        return None
    if per_node < spec.num_ranks:
        reason = internode.unsupported_reason(spec.mesh, spec.axis_name, per_node)
        if reason:
            if not auto:
                raise NotImplementedError(f"jax_ep.Buffer: {reason}")
            warnings.warn(f"jax_ep.Buffer: the EP axis spans {spec.num_ranks // per_node} nodes of {per_node} "
                          f"ranks, but {reason}; backend='auto' uses the xla backend", RuntimeWarning, stacklevel=4)
            return None
        # Its low-latency ops (with low-latency sizes) reach other nodes through NVSHMEM whatever was asked.
        return internode.InternodeBackend.create(spec, per_node, low_latency=low_latency_transport is not None)
    if auto and intranode.unsupported_reason(spec.mesh, spec.axis_name):
        return None  # e.g. more ranks than the kernels support: the portable backend serves it
    try:
        return intranode.IntranodeBackend.create(spec, low_latency_transport)
    except intranode.SpansHostsError:
        if not auto:
            raise
        return None
