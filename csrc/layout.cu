// Dispatch layout on the GPU: one thread per token; per-block histograms in shared memory are
// flushed to global counters with integer atomics (order-independent, so the result is deterministic).
#include "api.h"
#include "cuda_check.h"

namespace jax_ep {
namespace {

constexpr int kLayoutThreads = 256;

__global__ void layout_kernel(const int32_t* __restrict__ topk_idx, int num_tokens, int num_topk, int num_experts,
                              int num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                              bool* is_token_in_rank, int32_t* invalid_ids) {
  extern __shared__ int32_t block_counts[];  // [num_ranks + num_experts + 1]
  int32_t* rank_counts = block_counts;
  int32_t* expert_counts = block_counts + num_ranks;
  int32_t* invalid_count = expert_counts + num_experts;
  for (int i = threadIdx.x; i < num_ranks + num_experts + 1; i += blockDim.x) block_counts[i] = 0;
  __syncthreads();

  const int experts_per_rank = num_experts / num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < num_tokens) {
    const int32_t* ids = topk_idx + static_cast<int64_t>(t) * num_topk;
    bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
    for (int r = 0; r < num_ranks; ++r) in_rank[r] = false;
    for (int k = 0; k < num_topk; ++k) {
      const int32_t e = ids[k];
      if (e == -1) continue;
      if (e < -1 || e >= num_experts) { atomicAdd(invalid_count, 1); continue; }
      bool repeated = false;  // count a token once per expert
      for (int j = 0; j < k; ++j) repeated |= (ids[j] == e);
      if (!repeated) atomicAdd(&expert_counts[e], 1);
      const int r = e / experts_per_rank;
      if (!in_rank[r]) { in_rank[r] = true; atomicAdd(&rank_counts[r], 1); }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
    if (rank_counts[i]) atomicAdd(&num_tokens_per_rank[i], rank_counts[i]);
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
    if (expert_counts[i]) atomicAdd(&num_tokens_per_expert[i], expert_counts[i]);
  if (threadIdx.x == 0 && *invalid_count) atomicAdd(invalid_ids, *invalid_count);
}

}  // namespace

cudaError_t layout_cuda(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                        int64_t num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                        bool* is_token_in_rank, int32_t* invalid_ids, cudaStream_t stream) {
  JAX_EP_CUDA_RETURN(cudaMemsetAsync(num_tokens_per_rank, 0, num_ranks * sizeof(int32_t), stream));
  JAX_EP_CUDA_RETURN(cudaMemsetAsync(num_tokens_per_expert, 0, num_experts * sizeof(int32_t), stream));
  JAX_EP_CUDA_RETURN(cudaMemsetAsync(invalid_ids, 0, sizeof(int32_t), stream));
  if (num_tokens == 0) return cudaSuccess;
  const int blocks = static_cast<int>((num_tokens + kLayoutThreads - 1) / kLayoutThreads);
  const size_t smem = (num_ranks + num_experts + 1) * sizeof(int32_t);
  layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(
      topk_idx, static_cast<int>(num_tokens), static_cast<int>(num_topk), static_cast<int>(num_experts),
      static_cast<int>(num_ranks), num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, invalid_ids);
  return cudaGetLastError();
}

}  // namespace jax_ep
