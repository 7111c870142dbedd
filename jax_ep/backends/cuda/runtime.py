"""What the cuda backend's modes share while a Buffer is created and destroyed: the EP groups of a mesh, the
`jax.distributed` key-value store through which the processes of a group create a Buffer together and the name a
Buffer has there, the hosts of the processes, and the NVSHMEM symmetric region of the low-latency ops."""
from __future__ import annotations

import functools
import json
import socket
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax._src import distributed

from jax_ep import _native, nvshmem
from jax_ep.config import DEFAULT_HOST_TIMEOUT_S

def timeout_ns(config) -> int:
    """The kernels' bound on every spin-wait, from `Config.timeout_s`."""
    return int(config.timeout_s * 1e9)


def kv_client():
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax_ep.Buffer: the EP axis spans processes but jax.distributed is not initialized")
    return client


def exchange(publish: Mapping[str, str], read: Sequence[str], timeout_s: float) -> list[str | None]:
    """One step of a collective through the jax.distributed key-value store: publishes every key of `publish`,
    then reads every key of `read` in order, each wait bounded by `timeout_s`. A key that was not published in
    time reads as None: the caller says what that means (an error naming the process, or a vote against)."""
    client = kv_client()
    for key, value in publish.items():
        client.key_value_set(key, value)
    values = []
    for key in read:
        try:
            values.append(client.blocking_key_value_get(key, int(timeout_s * 1000)))
        except Exception:  # the client raises a runtime error on its deadline
            values.append(None)
    return values


def require_published(values: Sequence[str | None], publishers: Sequence[str], task: str,
                      timeout_s: float) -> list[str]:
    """`values` as `exchange` read them, once every key was published; else an error naming the first of
    `publishers` (who was to publish each value) that did not `task` within `timeout_s`."""
    for publisher, value in zip(publishers, values):
        if value is None:
            raise RuntimeError(f"jax_ep.Buffer: {publisher} did not {task} within {timeout_s} s")
    return list(values)


def require_same_sizes(mine: dict, published: str, who: str, what: str) -> None:
    """Raises naming `who` when the sizes it published (JSON) differ from `mine`: every rank of a Buffer must
    create it with the same sizes, and all raise together before any collective allocation would wait forever."""
    theirs = {key: value for key, value in json.loads(published).items() if key in mine}
    if theirs != mine:
        raise ValueError(f"jax_ep.Buffer: {who} created {what} with {theirs}, this process with {mine}; every rank "
                         "must pass the same sizes")


def ep_groups(mesh, axis_name: str) -> np.ndarray:
    """Devices as [groups, R]: one row per EP group (every combination of the other mesh axes), in rank order."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(axis_name)
    return np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])


def spans_processes(mesh, axis_name: str) -> bool:
    """Whether some EP group has ranks in several processes."""
    return any(len({d.process_index for d in group}) > 1 for group in ep_groups(mesh, axis_name))


def local_ordinals(mesh) -> tuple[int, ...]:
    """CUDA ordinals of the mesh's devices in this process (XLA's DeviceOrdinal is the local hardware id)."""
    return tuple(int(d.local_hardware_id) for d in mesh.devices.flat if d.process_index == jax.process_index())


# Buffers created so far over each set of devices (by global device id): the key-value store names a Buffer by
# its devices and this count, which every process of the set agrees on (creation is collective), whatever
# other Buffers a process made on its own.
_creations_per_devices: dict[tuple[int, ...], int] = {}


def collective_name(mesh) -> str:
    """The key-value store's name of the Buffer being created over `mesh` (call it once per such Buffer, on every
    process of the mesh)."""
    devices = tuple(sorted(int(d.id) for d in mesh.devices.flat))
    count = _creations_per_devices[devices] = _creations_per_devices.get(devices, 0) + 1
    return "jax_ep/buffer/{}/{}".format("-".join(map(str, devices)), count)


@functools.cache
def process_hosts() -> tuple[str, ...]:
    """The host name of every jax process, by process index (collective the first time: every process publishes
    its own in the jax.distributed key-value store, before any Buffer's Config is at hand: the default bound)."""
    timeout_s = DEFAULT_HOST_TIMEOUT_S
    if jax.process_count() == 1:
        return (socket.gethostname(),)
    key = "jax_ep/host/{}".format
    processes = range(jax.process_count())
    hosts = exchange({key(jax.process_index()): socket.gethostname()}, [key(p) for p in processes], timeout_s)
    return tuple(require_published(hosts, [f"process {p}" for p in processes],
                                   "publish its host (finding the nodes of the EP axis is collective)", timeout_s))


# ---- the NVSHMEM symmetric region of the low-latency ops ---------------------------------------------------------

def create_symmetric_region(buffer_id: int, mesh, axis_name: str, timeout_s: float, nbytes: int, *,
                            ranks_per_node: int) -> None:
    """Symmetric memory on this process's GPU, allocated collectively by every process (the caller checked one
    process per GPU over every process, so the PE of a rank is its process index, and that every process creates
    this Buffer with the same sizes, so every PE enters the allocation with the same size). The ranks of a node
    (`ranks_per_node` consecutive ranks; 1: each rank alone) reach each other's regions by plain stores, the others
    by NVSHMEM puts. When this call initialises NVSHMEM, its heap is sized for this region (jax_ep.nvshmem)."""
    nvshmem.initialize(timeout_s, symmetric_bytes=nbytes)  # collective once per process; then a no-op
    me = jax.process_index()
    (group,) = [g for g in ep_groups(mesh, axis_name) if any(d.process_index == me for d in g)]
    device = next(d for d in group if d.process_index == me)
    _native._C.nvshmem_region_create(buffer_id, int(device.local_hardware_id), nbytes,
                                     [int(d.process_index) for d in group], ranks_per_node)


def agree_to_free(collective_name: str | None, processes, timeout_s: float, healthy: bool, what: str) -> tuple[bool, list[str]]:
    """Before a collective free of symmetric memory (`what`, for the message): every process publishes whether it
    can take part, reads the others' answers (bounded), and all free only when all can (a GPU whose kernel timed
    out cannot, and the others would wait for it in the free); else each forgets its memory, leaking it until the
    process ends. Returns (free, the problems met)."""
    answers = {jax.process_index(): "ok" if healthy else "unhealthy"}
    if len(processes) > 1:
        key = f"{collective_name}/nvshmem_free/{{}}".format
        published = exchange({key(jax.process_index()): answers[jax.process_index()]},
                             [key(p) for p in processes], timeout_s)
        answers.update((p, "absent" if answer is None else answer) for p, answer in zip(processes, published))
    release = all(answer == "ok" for answer in answers.values())
    return release, [] if release else [f"{what} was not freed (processes: {answers})"]


def destroy_symmetric_region(buffer_id: int, collective_name: str | None, processes, timeout_s: float,
                             healthy: bool) -> list[str]:
    """Frees the Buffer's low-latency symmetric region when every process can (`agree_to_free`), else forgets it.
    Returns the problems met."""
    release, problems = agree_to_free(collective_name, processes, timeout_s, healthy,
                                      f"the NVSHMEM region of Buffer #{buffer_id}")
    errors = _native._C.nvshmem_region_destroy(buffer_id, release)
    return problems + ([errors] if errors else [])
