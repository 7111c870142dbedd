// Decoding of the expert-major ops' operands and results (api.h: ExpertMajorDispatchArgs and the three after it),
// shared by the intranode and internode handlers, which add their modes' parts and launch.
#pragma once
#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "api.h"
#include "handlers.h"

namespace jax_ep::ffi_handlers {

// args: x payloads (num_payloads), topk_idx [T, K], [topk_weights [T, K]]; rets: recv payloads, [recv_weights],
// group_sizes [L], group_offsets [L], num_kept, num_dropped, invalid_ids, rows_needed, recv_src_index [C],
// is_token_in_rank [T, R], pair_row [R*T, min(K, L)], topk_row [R*T, K], rows_end [1], block_counts (scratch [rows, E]).
// `extra_rets` more results follow (the mode's handle parts), left in rets for the caller. Decoded into *out.
inline ffi::Error DecodeExpertMajorDispatch(const char* op, int ranks, const std::vector<ffi::AnyBuffer>& args,
                                            const std::vector<ffi::AnyBuffer>& rets, size_t extra_rets,
                                            int64_t num_payloads, int64_t num_experts, int64_t expert_alignment,
                                            ExpertMajorDispatchArgs* out) {
  if (num_payloads < 1 || num_payloads > 2) return Invalid(op, "num_payloads must be 1 or 2");
  const size_t payloads = static_cast<size_t>(num_payloads);
  if (args.size() != payloads + 1 && args.size() != payloads + 2) return Invalid(op, "wrong number of operands");
  const bool has_weights = args.size() == payloads + 2;
  if (rets.size() != payloads + (has_weights ? 13 : 12) + extra_rets) return Invalid(op, "wrong number of results");
  const ffi::AnyBuffer& topk_idx = args[payloads];
  const auto idx_dims = topk_idx.dimensions();
  if (topk_idx.element_type() != ffi::DataType::S32 || idx_dims.size() != 2 || idx_dims[1] < 1 ||
      idx_dims[1] > kNormalMaxTopk)
    return Invalid(op, "topk_idx must be int32 [num_tokens, 1 to " + std::to_string(kNormalMaxTopk) + "]");
  if (num_experts < ranks || num_experts % ranks || num_experts > kExpertMajorMaxExperts)
    return Invalid(op, "num_experts must be a multiple of the ranks, at most " +
                           std::to_string(kExpertMajorMaxExperts));
  if (expert_alignment < 1) return Invalid(op, "expert_alignment must be positive");
  ExpertMajorDispatchArgs& a = *out;
  a.num_payloads = static_cast<int32_t>(payloads);
  a.num_tokens = idx_dims[0];
  a.num_topk = idx_dims[1];
  a.num_experts = num_experts;
  a.capacity = LeadingDim(rets[0]);
  a.expert_alignment = expert_alignment;
  // Group offsets and pair rows are int32: the padded groups and the capacity must fit them (Python refuses first).
  const int64_t local_experts = num_experts / ranks;
  if (a.capacity > INT32_MAX ||
      ranks * a.num_tokens * std::min<int64_t>(a.num_topk, local_experts) + local_experts * (expert_alignment - 1) >
          INT32_MAX)
    return Invalid(op, "expert_alignment and the capacity let the rows pass int32 indices");
  for (size_t p = 0; p < payloads; ++p) {
    if (LeadingDim(args[p]) != a.num_tokens || LeadingDim(rets[p]) != a.capacity || RowBytes(args[p]) != RowBytes(rets[p]))
      return Invalid(op, "payload shapes disagree with topk_idx or the capacity");
    a.x[p] = args[p].untyped_data();
    a.x_row_bytes[p] = RowBytes(args[p]);
    a.recv_x[p] = rets[p].untyped_data();
  }
  a.topk_idx = DataOf<int32_t>(topk_idx);
  size_t i = payloads;
  if (has_weights) {
    if (!IsMatrix(args[payloads + 1], ffi::DataType::F32, a.num_tokens, a.num_topk) ||
        !IsVector(rets[i], ffi::DataType::F32, a.capacity))
      return Invalid(op, "topk_weights must be float32 like topk_idx, recv_weights float32 [capacity]");
    a.topk_weights = DataOf<float>(args[payloads + 1]);
    a.recv_weights = MutableDataOf<float>(rets[i++]);
  }
  const int64_t local = num_experts / ranks, items = ranks * a.num_tokens;
  const int64_t pair_columns = std::min<int64_t>(a.num_topk, local);
  const struct {
    int32_t** out;
    int64_t size;
  } int_results[] = {{&a.group_sizes, local}, {&a.group_offsets, local}, {&a.num_kept, 1},   {&a.num_dropped, 1},
                     {&a.invalid_ids, 1},     {&a.rows_needed, 1},     {&a.recv_src_index, a.capacity}};
  for (const auto& result : int_results) {
    if (rets[i].element_type() != ffi::DataType::S32 || static_cast<int64_t>(rets[i].element_count()) != result.size)
      return Invalid(op, "result " + std::to_string(i) + " must be int32 of " + std::to_string(result.size));
    *result.out = MutableDataOf<int32_t>(rets[i++]);
  }
  if (!IsMatrix(rets[i], ffi::DataType::PRED, a.num_tokens, ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a.is_token_in_rank = MutableDataOf<bool>(rets[i++]);
  if (!IsMatrix(rets[i], ffi::DataType::S32, items, pair_columns))
    return Invalid(op, "pair_row must be int32 [num_ranks * num_tokens, min(num_topk, local experts)]");
  a.pair_row = MutableDataOf<int32_t>(rets[i++]);
  if (!IsMatrix(rets[i], ffi::DataType::S32, items, a.num_topk))
    return Invalid(op, "topk_row must be int32 [num_ranks * num_tokens, num_topk]");
  a.topk_row = MutableDataOf<int32_t>(rets[i++]);
  if (rets[i].element_type() != ffi::DataType::S32 || rets[i].element_count() != 1)
    return Invalid(op, "rows_end must be int32 [1]");
  a.rows_end = MutableDataOf<int32_t>(rets[i++]);
  const auto scratch_dims = rets[i].dimensions();
  if (rets[i].element_type() != ffi::DataType::S32 || scratch_dims.size() != 2 || scratch_dims[1] != num_experts)
    return Invalid(op, "block_counts must be int32 [rows, num_experts]");
  a.block_counts = MutableDataOf<int32_t>(rets[i]);
  a.block_count_rows = scratch_dims[0];
  return ffi::Error::Success();
}

// The launch functions' cudaErrorInvalidValue after DecodeExpertMajorDispatch.
inline const char* kBlockCountsTooFew = "block_counts must have a row per block of the launch (num_sms)";


// args: x [T, ...], pair_row [R*T, P], recv_src_index [C], rows_end [1]; ret: recv_x [C, ...]. Decoded into *out.
inline ffi::Error DecodeExpertMajorCachedDispatch(const char* op, int num_ranks, const ffi::AnyBuffer& x,
                                                  const ffi::AnyBuffer& pair_row, const ffi::AnyBuffer& recv_src_index,
                                                  const ffi::AnyBuffer& rows_end, const ffi::AnyBuffer& recv_x,
                                                  ExpertMajorCachedDispatchArgs* out) {
  ExpertMajorCachedDispatchArgs& a = *out;
  a.x = x.untyped_data();
  a.row_bytes = RowBytes(x);
  a.num_tokens = LeadingDim(x);
  a.capacity = LeadingDim(recv_x);
  const auto pair_dims = pair_row.dimensions();
  if (pair_row.element_type() != ffi::DataType::S32 || pair_dims.size() != 2 ||
      pair_dims[0] != num_ranks * a.num_tokens)
    return Invalid(op, "pair_row must be int32 [num_ranks * num_tokens, pair columns]");
  a.num_pair_columns = pair_dims[1];
  if (!IsVector(recv_src_index, ffi::DataType::S32, a.capacity) || RowBytes(recv_x) != a.row_bytes)
    return Invalid(op, "recv_src_index, x and the result disagree in shape");
  if (rows_end.element_type() != ffi::DataType::S32 || rows_end.element_count() != 1)
    return Invalid(op, "rows_end must be int32 [1]");
  a.pair_row = DataOf<int32_t>(pair_row);
  a.recv_src_index = DataOf<int32_t>(recv_src_index);
  a.rows_end = DataOf<int32_t>(rows_end);
  a.recv_x = recv_x.untyped_data();
  return ffi::Error::Success();
}

// args: d_out [T, ...], y [C, ...], pair_row [R*T, P], recv_src_index [C], rows_end [1], then weights float32 [C]
// when `weighted`; rets: d_y [C, ...] of y's type, then d_weights float32 [C] when `weighted`.
// `optional` holds the operands after rows_end; d_weights is null without weights. Decoded into *out.
inline ffi::Error DecodeExpertMajorCombineBackward(const char* op, int num_ranks, const ffi::AnyBuffer& d_out,
                                                   const ffi::AnyBuffer& y, const ffi::AnyBuffer& pair_row,
                                                   const ffi::AnyBuffer& recv_src_index, const ffi::AnyBuffer& rows_end,
                                                   const std::vector<ffi::AnyBuffer>& optional,
                                                   const ffi::AnyBuffer& d_y,
                                                   const ffi::AnyBuffer* d_weights,
                                                   int64_t weighted, ExpertMajorCombineBackwardArgs* out) {
  if (weighted != 0 && weighted != 1) return Invalid(op, "weighted must be 0 or 1");
  if (optional.size() != static_cast<size_t>(weighted) || (d_weights != nullptr) != (weighted == 1))
    return Invalid(op, "expects d_out, y, pair_row, recv_src_index, rows_end, [weights]; d_y, [d_weights]");
  ExpertMajorCombineBackwardArgs& a = *out;
  if (auto err = DecodeExpertMajorCachedDispatch(op, num_ranks, d_out, pair_row, recv_src_index, rows_end, d_y, &a.rows);
      err.failure())
    return err;
  if (!AsFloatType(d_out.element_type(), &a.type) || y.element_type() != d_out.element_type() ||
      d_y.element_type() != d_out.element_type() || LeadingDim(y) != a.rows.capacity ||
      RowBytes(y) != a.rows.row_bytes || a.rows.row_bytes % 16 != 0)
    return Invalid(op, "d_out, y and d_y must be float32, bfloat16 or float16 rows of one type and width (whole "
                       "16-byte vectors), y and d_y of capacity rows");
  a.y = y.untyped_data();
  if (weighted) {
    if (!IsVector(optional[0], ffi::DataType::F32, a.rows.capacity) ||
        !IsVector(*d_weights, ffi::DataType::F32, a.rows.capacity))
      return Invalid(op, "weights and d_weights must be float32 [capacity]");
    a.weights = DataOf<float>(optional[0]);
    a.d_weights = MutableDataOf<float>(*d_weights);
  }
  return ffi::Error::Success();
}

// args: y [C, ...], pair_row [R*T, P], is_token_in_rank [T, R], then weights float32 [C] when `weighted`, then the
// bias [T, ...] when given; rets: out [T, ...] of y's type or float32, and in a group of one process the slots
// ((R - 1) * T rows of y's row bytes, any type) where the peers store their partials.
// `optional` holds the operands after is_token_in_rank: [weights], [bias]. Decoded into *out (the result's and the
// bias' types and pointers as DecodeCombineOutput).
inline ffi::Error DecodeExpertMajorCombine(const char* op, int num_ranks, const ffi::AnyBuffer& y,
                                           const ffi::AnyBuffer& pair_row, const ffi::AnyBuffer& is_token_in_rank,
                                           const std::vector<ffi::AnyBuffer>& optional, const ffi::AnyBuffer& result,
                                           int64_t weighted, ExpertMajorCombineArgs* out) {
  if (weighted != 0 && weighted != 1) return Invalid(op, "weighted must be 0 or 1");
  if (optional.size() < static_cast<size_t>(weighted) || optional.size() > static_cast<size_t>(weighted) + 1)
    return Invalid(op, "expects y, pair_row, is_token_in_rank, [weights], [bias]");
  const std::optional<ffi::AnyBuffer> bias =
      optional.size() > static_cast<size_t>(weighted) ? std::optional<ffi::AnyBuffer>(optional.back()) : std::nullopt;
  ExpertMajorCombineArgs& a = *out;
  if (auto err = DecodeCombineOutput(op, y, result, bias, &a); err.failure()) return err;
  const auto pair_dims = pair_row.dimensions();
  if (pair_row.element_type() != ffi::DataType::S32 || pair_dims.size() != 2 || pair_dims[0] != num_ranks * a.num_tokens)
    return Invalid(op, "pair_row must be int32 [num_ranks * num_tokens, pair columns]");
  if (!IsMatrix(is_token_in_rank, ffi::DataType::PRED, a.num_tokens, num_ranks))
    return Invalid(op, "is_token_in_rank must be bool [num_tokens, num_ranks]");
  a.pair_row = DataOf<int32_t>(pair_row);
  a.num_pair_columns = pair_dims[1];
  a.is_token_in_rank = DataOf<bool>(is_token_in_rank);
  if (weighted) {
    if (!IsVector(optional[0], ffi::DataType::F32, a.capacity)) return Invalid(op, "weights must be float32 [capacity]");
    a.weights = DataOf<float>(optional[0]);
  }
  if (a.num_pair_columns < 1 || a.num_pair_columns > kNormalMaxTopk)
    return Invalid(op, "pair_row must have 1 to " + std::to_string(kNormalMaxTopk) + " columns");
  return ffi::Error::Success();
}

}  // namespace jax_ep::ffi_handlers
