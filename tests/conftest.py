"""What every suite shares (tests/ on CPU, tests/gpu on GPUs): the mesh of R ranks, jit(shard_map) over it in
either process model, reshaping between global and per-rank arrays, the suites' Buffers, and the stand-in backend
for lowering the cuda paths on CPU."""
import functools
import os

# 8 virtual CPU devices for the EP tests; must be set before jax initialises its backends. On a GPU machine
# jax.devices() are the GPUs, so the same tests run there on as many ranks as there are GPUs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

# Set by tests/gpu/test_multiprocess_gpu.py for the low-latency suite on internode Buffers: the suite's cuda
# low-latency Buffers are internode Buffers of this many ranks per node (their ops take the NVSHMEM transport).
LL_RANKS_PER_NODE = int(os.environ.get("JAX_EP_TEST_RANKS_PER_NODE", "0")) or None


@pytest.fixture
def triton_lowers_for_an_h200(monkeypatch):
    """Lowering for CUDA on a host without a GPU (CI): from jax 0.12 a Pallas Triton kernel asks for the GPU's
    compute capability while it lowers, and without a GPU refuses unless the mesh carries an abstract GPU device
    (which the tests' meshes of CPU devices cannot); it gets an H200's. Earlier JAX lowers without asking."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return
    if hasattr(gpu_info, "get_gpu_info") and hasattr(gpu_info, "get_gpu_info_from_version"):
        monkeypatch.setattr(gpu_info, "get_gpu_info",
                            lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))


@functools.cache
def mesh_of(num_ranks: int, axis_name: str = "ep") -> Mesh:
    """A 1-D mesh of the first `num_ranks` devices (with one process per GPU: every process's GPUs); skips the
    test where there are fewer."""
    devices = jax.devices()
    if len(devices) < num_ranks:
        elsewhere = (f"; tests/gpu/test_multiprocess_gpu.py runs these ranks as {num_ranks} processes"
                     if devices[0].platform == "gpu" else "")
        pytest.skip(f"needs {num_ranks} devices in one process, {len(devices)} present{elsewhere}")
    return Mesh(np.array(devices[:num_ranks]), (axis_name,))


def spmd(num_ranks: int, body, gather: bool = True):
    """jit(shard_map(body)) over mesh_of(num_ranks): every argument and result split along its leading axis. With one
    process per rank, host inputs become global arrays and the results are gathered to every process (unless
    `gather` is False: a program expected to fail runs nothing after it)."""
    mesh = mesh_of(num_ranks)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    if jax.process_count() == 1:
        return fn
    from process_harness import gather_to_every_process

    sharding = NamedSharding(mesh, P("ep"))

    def run(*args):
        args = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i], dtype=a.dtype),
                            args)
        out = fn(*args)
        return gather_to_every_process(out) if gather else out

    return run


def flat(a):
    """Global [R*N, ...] input from a per-rank [R, N, ...] array (None and tuples pass through)."""
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(flat(c) for c in a)
    a = np.asarray(a)
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def ranks(a, R: int):
    """Per-rank [R, N, ...] numpy view of a global [R*N, ...] output."""
    a = np.asarray(a)
    return a.reshape((R, a.shape[0] // R) + a.shape[1:])


@functools.cache
def buffer(num_ranks: int, backend: str, combine: str | None = None) -> jax_ep.Buffer:
    """The suites' normal-mode Buffer of R ranks on `backend`; `combine` ("push" or "pull") its Config.combine (None:
    the process model's method, or $JAX_EP_COMBINE)."""
    return jax_ep.Buffer(mesh_of(num_ranks), "ep", backend=backend, config=jax_ep.Config(combine=combine))


def new_ll_buffer(num_ranks: int, M: int, H: int, E: int, backend: str, timeout_s: float = 30.0,
                  on_timeout: str = "trap") -> jax_ep.Buffer:
    """A Buffer of R ranks for low-latency ops (M tokens per rank, hidden H, E experts) and no normal-mode staging
    (num_nvl_bytes=0, num_rdma_bytes=0: with processes sharing a GPU a gigabyte for each of a suite's Buffers would
    not fit); a cuda one is an internode Buffer where LL_RANKS_PER_NODE is set."""
    nodes = dict(ranks_per_node=LL_RANKS_PER_NODE, num_rdma_bytes=0) if LL_RANKS_PER_NODE and backend == "cuda" else {}
    return jax_ep.Buffer(mesh_of(num_ranks), "ep", backend=backend, num_max_dispatch_tokens_per_rank=M, hidden=H,
                         num_experts=E, config=jax_ep.Config(timeout_s=timeout_s, on_timeout=on_timeout),
                         num_nvl_bytes=0, **nodes)


ll_buffer = functools.cache(new_ll_buffer)  # the suites' low-latency Buffers, alive until the process ends


def with_standin_backend(buffer, backend_type, *args, **kwargs):
    """`buffer` (an xla Buffer) holding instead a backend object of `backend_type` built from its facts (id, mesh,
    axis, config) and `args`, which allocated nothing: enough to lower that backend's ops on a machine without
    GPUs, where nothing of it runs. The one place tests swap a Buffer's backend."""
    buffer.backend_impl = backend_type(buffer.buffer_id, buffer.mesh, buffer.axis_name, buffer.config, *args, **kwargs)
    return buffer
