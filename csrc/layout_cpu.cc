#include <algorithm>
#include <vector>

#include "api.h"

namespace jax_ep {

void layout_cpu(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                int64_t num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                bool* is_token_in_rank, int32_t* invalid_ids) {
  const int64_t experts_per_rank = num_experts / num_ranks;
  std::fill(num_tokens_per_rank, num_tokens_per_rank + num_ranks, 0);
  std::fill(num_tokens_per_expert, num_tokens_per_expert + num_experts, 0);
  std::fill(is_token_in_rank, is_token_in_rank + num_tokens * num_ranks, false);
  int32_t invalid = 0;
  // Last token that was counted for each expert: dedupes repeated ids within one token.
  std::vector<int64_t> last_token_of_expert(num_experts, -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    bool* in_rank = is_token_in_rank + t * num_ranks;
    for (int64_t k = 0; k < num_topk; ++k) {
      const int32_t e = topk_idx[t * num_topk + k];
      if (e == -1) continue;
      if (e < -1 || e >= num_experts) { ++invalid; continue; }
      if (last_token_of_expert[e] != t) {
        last_token_of_expert[e] = t;
        ++num_tokens_per_expert[e];
      }
      in_rank[e / experts_per_rank] = true;
    }
    for (int64_t r = 0; r < num_ranks; ++r) num_tokens_per_rank[r] += in_rank[r] ? 1 : 0;
  }
  *invalid_ids = invalid;
}

}  // namespace jax_ep
