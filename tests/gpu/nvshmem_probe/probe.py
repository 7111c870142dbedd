"""Diagnostic: jax_ep's NVSHMEM bootstrap (jax_ep._C) with and without JAX holding the GPUs first.
   python3 probe.py bare|jax RANK NUM_RANKS UID_FILE   (rank 0 writes the unique id to UID_FILE)"""
import os
import sys
import time

mode, rank, num_ranks, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "jax":
    import jax

    print(f"rank {rank}: jax sees {jax.devices()}", flush=True)
from jax_ep import _C as C  # importing jax does not start its GPU backend; jax.devices() does

if rank == 0:
    with open(path + ".tmp", "wb") as f:
        f.write(C.nvshmem_unique_id())
    os.rename(path + ".tmp", path)
for _ in range(600):
    if os.path.exists(path):
        break
    time.sleep(0.1)
uid = open(path, "rb").read()
print(f"rank {rank}: init", flush=True)
C.nvshmem_initialize(rank, rank, num_ranks, uid)
print(f"PY RING {mode} {rank} {C.nvshmem_ring_check()} (expect {(rank + num_ranks - 1) % num_ranks})", flush=True)
os._exit(0)
