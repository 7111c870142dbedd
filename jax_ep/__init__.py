"""jax_ep: expert-parallel (MoE) dispatch and combine for JAX.

Create a `Buffer` outside `jit` from a mesh and its EP axis, then call the ops inside `jax.shard_map`
over that axis. See README.md and docs/design.md ("Semantics") for the exact semantics.
"""
from jax_ep import _native  # noqa: F401  (registers the FFI targets at import)
from jax_ep.backends.cuda.internode import internode_buffer_bytes
from jax_ep.backends.cuda.intranode import normal_buffer_bytes
from jax_ep.buffer import Buffer
from jax_ep.config import Config, low_latency_buffer_bytes
from jax_ep.fp8 import per_token_cast_to_fp8
from jax_ep.grouped_matmul import grouped_matmul
from jax_ep.ops import (
    LowLatencyPending,
    combine,
    dispatch,
    get_dispatch_layout,
    low_latency_combine,
    low_latency_combine_recv,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
)
from jax_ep.types import (
    CombineResult,
    DispatchLayout,
    DispatchResult,
    ExpertMajorDispatchResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

__version__ = "0.1.0"

__all__ = [
    "Buffer", "Config", "low_latency_buffer_bytes", "normal_buffer_bytes", "internode_buffer_bytes",
    "per_token_cast_to_fp8", "grouped_matmul",
    "get_dispatch_layout", "dispatch", "combine",
    "low_latency_dispatch", "low_latency_combine",
    "low_latency_dispatch_send", "low_latency_dispatch_recv",
    "low_latency_combine_send", "low_latency_combine_recv", "LowLatencyPending",
    "DispatchLayout", "DispatchResult", "ExpertMajorDispatchResult", "CombineResult", "LowLatencyDispatchResult", "LowLatencyHandle",
]

