// jax_ep launch API: the only interface between the kernels/runtime (csrc/) and the XLA FFI handlers
// (xla_ffi/). Plain pointers, sizes and streams in; no XLA, nanobind or Python types.
#pragma once
#include <cstdint>

namespace jax_ep {

// Dispatch layout (ARCHITECTURE.md §3). topk_idx is [num_tokens, num_topk]; an id outside
// [-1, num_experts) is treated as -1 and counted in *invalid_ids. A token counts once per rank and
// once per expert however many of its top-k entries name that rank or expert.
// Outputs: num_tokens_per_rank [num_ranks], num_tokens_per_expert [num_experts],
// is_token_in_rank [num_tokens, num_ranks] (one byte per flag), invalid_ids (scalar).
void layout_cpu(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                int64_t num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                bool* is_token_in_rank, int32_t* invalid_ids);

}  // namespace jax_ep

#if defined(JAX_EP_WITH_CUDA)
#include <cuda_runtime.h>

namespace jax_ep {

// CUDA form of layout_cpu, enqueued on `stream`; no host synchronisation (graph-capturable).
cudaError_t layout_cuda(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                        int64_t num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                        bool* is_token_in_rank, int32_t* invalid_ids, cudaStream_t stream);

}  // namespace jax_ep
#endif
