"""The `cuda` backend: jax_ep's CUDA kernels called through `jax.ffi.ffi_call` only. Its modes: `intranode` (one
NVLink domain) and `internode` (NVSHMEM between nodes), each with its normal mode and the low-latency mode of
`low_latency`; `normal` holds what the two normal modes' calls share, `runtime` what their creation shares.

Bounded waits: a kernel that waits longer than `Config.timeout_s` for a peer writes a record (op, rank, peer)
to pinned host memory and executes `trap`. The handler cannot see this (under CUDA graphs it does not even
run), so the trap surfaces at the next synchronisation as an XLA runtime error carrying a CUDA launch
failure (e.g. "unspecified launch failure"), and that GPU's CUDA context stays unusable: the process must
restart. `Buffer.errors()` reads the records, also after the trap, and names the op, rank and peer.

Lifetime: compiled programs hold the Buffer's device pointers (CUDA graphs bake them in); do not run a
program after destroying the Buffer it was traced with. Ops of one device must run one at a time, as XLA's
default command-buffer scheduling (LHS) and stream assignment do; `--xla_gpu_command_buffer_scheduling_mode=
CONCURRENT` could overlap two jax_ep calls of one device and is not supported.
"""
