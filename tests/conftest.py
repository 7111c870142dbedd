import os

# 8 virtual CPU devices for the EP tests; must be set before jax initialises its backends. On a GPU machine
# jax.devices() are the GPUs, so the same tests run there on as many ranks as there are GPUs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


def mesh_of(num_ranks: int, axis_name: str = "ep") -> Mesh:
    """A 1-D mesh of the first `num_ranks` devices; skips the test where there are fewer."""
    devices = jax.devices()
    if len(devices) < num_ranks:
        pytest.skip(f"needs {num_ranks} devices, {len(devices)} present")
    return Mesh(np.array(devices[:num_ranks]), (axis_name,))


def with_standin_backend(buffer, backend_type, *args, **kwargs):
    """`buffer` (an xla Buffer) holding instead a backend object of `backend_type` built from its facts (id, mesh,
    axis, config) and `args`, which allocated nothing: enough to lower that backend's ops on a machine without
    GPUs, where nothing of it runs. The one place tests swap a Buffer's backend."""
    buffer.backend_impl = backend_type(buffer.buffer_id, buffer.mesh, buffer.axis_name, buffer.config, *args, **kwargs)
    return buffer
