// jax_ep launch API: the only interface between the kernels/runtime (csrc/) and the XLA FFI handlers
// (xla_ffi/). Plain pointers, sizes and streams in; no XLA, nanobind or Python types.
#pragma once
#include <cstdint>

#include "kernel_limits.h"  // the limits and sizes below (kMaxIntranodeRanks, ...), shared with jax_ep._C

namespace jax_ep {

// Dispatch layout (docs/design.md, "Layout"). topk_idx is [num_tokens, num_topk]; an id outside
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

#if defined(JAX_EP_WITH_CUDA)
#include <string>
#include <utility>
#include <vector>

namespace jax_ep {

// ---- Normal mode (intranode and internode) ----------------------------------------------------------------------

// Per launch of a normal-mode op: the rank (IntranodeRank or InternodeRank), the grid size (clamped to the device)
// and the spin-wait bound.
template <typename Rank>
struct NormalCall {
  Rank group;
  int32_t num_sms = 0;
  int64_t timeout_ns = 0;
  cudaStream_t stream = nullptr;
};

// Normal dispatch (docs/design.md, "Normal dispatch"): what every mode's dispatch takes and writes; every array is
// this rank's. Payload rows are moved as bytes. Each mode's args add its handle arrays after these fields.
struct NormalDispatchArgs {
  int32_t num_payloads = 0;  // 1, or 2 for the FP8 pair (values, scales)
  const void* x[2] = {};     // [num_tokens, row_bytes] each
  int64_t x_row_bytes[2] = {};
  const int32_t* topk_idx = nullptr;     // [num_tokens, num_topk]
  const float* topk_weights = nullptr;   // [num_tokens, num_topk], or null
  int64_t num_tokens = 0, num_topk = 0, num_experts = 0, capacity = 0, expert_alignment = 1;
  void* recv_x[2] = {};                  // [capacity, row_bytes] each
  int32_t* recv_topk_idx = nullptr;      // [capacity, num_topk]
  float* recv_topk_weights = nullptr;    // [capacity, num_topk], null iff topk_weights is
  int32_t* num_recv_tokens = nullptr;    // scalar
  int32_t* num_recv_tokens_per_expert = nullptr;  // [num_experts / num_ranks]
  int32_t* num_dropped = nullptr;        // scalar
  int32_t* invalid_ids = nullptr;        // scalar
  int32_t* recv_src_index = nullptr;     // [capacity]: source rank * num_tokens + source token; padding R*T
  bool* is_token_in_rank = nullptr;      // [num_tokens, num_ranks]
};

// The combines' element types: y, the bias and the result are each float32, bfloat16 or float16.
enum class FloatType : int32_t { kF32, kBF16, kF16 };

// Normal combine: the rows every mode's combine sums. Each mode's args add the handle's arrays, then the bias and
// the result (y's type or float32).
struct NormalCombineArgs {
  const void* y = nullptr;  // [capacity, row_elements]
  FloatType y_type = FloatType::kF32;
  int64_t row_elements = 0, capacity = 0, num_tokens = 0;
};

// ---- Intranode groups: the device memory every NVLink op of a Buffer shares ------------------------------
// Each rank of a group owns one device allocation: its IntranodeState (call numbers, barrier flags, the
// view it publishes) followed by a workspace of `workspace_bytes` that peers read and write through
// NVLink. The ranks of a group live either in one process (peer access and raw peer pointers) or in
// several (CUDA IPC handles, exchanged by the caller, e.g. through jax.distributed's key-value store).
//
// Normal mode "pull" model: every op publishes the addresses of its own inputs in its rank's state, waits
// until every rank of the group has published (arrival barrier), reads peers' inputs through NVLink, and
// before its kernel exits waits until every peer has finished reading its inputs (release barrier). The call
// sequence number lives on the device, so the ops replay correctly as CUDA graphs. When the group spans
// processes ("staged"), a peer cannot map XLA's buffers, so each op first copies the inputs its peers read
// into the start of its own workspace and publishes offsets in it instead of pointers. The push combine
// (CombineArgs::push_warps) instead publishes where peers store rows for it (a scratch result, or in a staged group
// its workspace) and the release barrier then means that no peer still writes there.

struct IntranodeState;  // device memory of one rank (intranode_state.h)
struct TimeoutRecord;  // host-mapped timeout record of one rank (intranode_state.h)

// One rank of an intranode group, as a kernel launch needs it (copied into the kernel's parameters).
struct IntranodeRank {
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int32_t device_sms = 0;                              // multiprocessors of this rank's device
  int32_t staged = 0;                                  // 1: some rank lives in another process (see above)
  IntranodeState* states[kMaxIntranodeRanks] = {};     // every rank's state by rank, mapped here
  char* workspaces[kMaxIntranodeRanks] = {};           // every rank's workspace by rank, mapped here
  int64_t workspace_bytes = 0;
  int64_t staging_bytes = 0;                           // the workspace's first bytes, where staged ops copy inputs
  TimeoutRecord* error = nullptr;                      // this rank's record (pinned host memory, mapped)
};

// Runtime (intranode_runtime.cu). Failures throw std::runtime_error / std::invalid_argument naming the CUDA call and
// device. A device holds at most one rank per buffer_id; several groups (one per EP axis row of a larger
// mesh) may share a buffer_id.
//
// One process driving the whole group: device_ordinals[r] is the CUDA ordinal of EP rank r.
// The first `staging_bytes` of each workspace are the staging room of groups spanning processes.
void intranode_create(int64_t buffer_id, const std::vector<int>& device_ordinals, int64_t workspace_bytes,
                      int64_t staging_bytes);
// Groups spanning processes, in two collective steps. Step 1 allocates rank `rank` of the group on local
// device `device_ordinal` and returns the CUDA IPC handle of its allocation (bytes to pass to every rank).
std::string intranode_export(int64_t buffer_id, int device_ordinal, int rank, int num_ranks,
                             int64_t workspace_bytes, int64_t staging_bytes);
// Step 2, once every rank exported: ipc_handles[p] is rank p's handle; local_ordinals[p] is the CUDA ordinal
// of rank p when this process exported it (its memory is then reached by peer access), else -1.
void intranode_connect(int64_t buffer_id, int device_ordinal, const std::vector<std::string>& ipc_handles,
                       const std::vector<int>& local_ordinals);
// Waits for every device of `buffer_id` in this process and unmaps the peers' memory; the ranks stop being
// found by intranode_lookup. A group spanning processes calls this on every process, then meets at a
// barrier, then destroys: nobody frees memory that another process still maps. Returns "" or the errors.
std::string intranode_unmap(int64_t buffer_id);
// intranode_unmap, then frees every rank's memory of `buffer_id` in this process; returns "" or the CUDA
// errors met on the way (a device whose context a timed-out kernel killed cannot free anything).
std::string intranode_destroy(int64_t buffer_id);
// The launch view of (buffer_id, device_ordinal); false when no connected rank exists there.
bool intranode_lookup(int64_t buffer_id, int device_ordinal, IntranodeRank* out);
// One line per rank of `buffer_id` in this process whose kernel timed out (read from host memory: works
// after the CUDA context died), naming the op, the rank and the peer it waited for.
std::vector<std::string> intranode_errors(int64_t buffer_id);
// (calls, summed kernel nanoseconds) per device of buffer_id in this process, by CUDA ordinal, since the
// last reset; `reset` zeroes the sums. Call only while no kernel of the buffer runs.
#if defined(JAX_EP_INSTRUMENT)
std::vector<std::pair<uint64_t, uint64_t>> intranode_kernel_times(int64_t buffer_id, bool reset);
#endif

using IntranodeCall = NormalCall<IntranodeRank>;

// Normal dispatch, intranode: the handle adds send_row.
struct DispatchArgs : NormalDispatchArgs {
  int32_t* send_offset = nullptr;        // [num_tokens, num_ranks] scratch: rank of token t among this
                                         // rank's tokens sent to r, -1 if not sent (peers read it)
  int32_t* send_row = nullptr;           // [num_tokens, num_ranks]: row of token t on rank r, -1 if none
};
cudaError_t intranode_dispatch(const IntranodeCall& call, const DispatchArgs& args);

// Dispatch of new data [num_tokens, row_bytes] along an earlier dispatch's recv_src_index.
struct CachedDispatchArgs {
  const void* x = nullptr;
  int64_t row_bytes = 0, num_tokens = 0, capacity = 0;
  const int32_t* recv_src_index = nullptr;  // [capacity]
  void* recv_x = nullptr;                   // [capacity, row_bytes]
};
cudaError_t intranode_cached_dispatch(const IntranodeCall& call, const CachedDispatchArgs& args);

// Normal combine: out[t] = (sum over r in rank order of y_r[send_row[t, r]] in float32) + bias[t], cast
// to out_type. bias is null or [num_tokens, row_elements] of bias_type (y's type or f32).
// Two ways to move the rows, with bit-identical results: pull (each rank reads its tokens' rows from the peers'
// y; a staged group first copies its valid rows of y into its workspace) or push (each rank stores its rows of
// y into the token's home rank, which reduces them locally; no copy in a staged group).
enum class CombineMethod : uint8_t { kPull = 0, kPush = 1 };  // one byte: it sits in CombineArgs' padding
struct CombineArgs : NormalCombineArgs {
  const int32_t* send_row = nullptr;  // [num_tokens, num_ranks] from this rank's dispatch handle
  const int32_t* recv_src_index = nullptr;  // [capacity] from the handle: which rows are valid, and whose
  const void* bias = nullptr;
  FloatType bias_type = FloatType::kF32;
  CombineMethod method = CombineMethod::kPull;
  void* out = nullptr;  // [num_tokens, row_elements]
  FloatType out_type = FloatType::kF32;  // y's type or f32
  // Push: 1 to kCombineMaxPushWarps warps of each block push at the start (the others reduce from the start; the
  // pushing warps join them once their rows are out). Pull: 0 (no warp pushes).
  int32_t push_warps = 0;
  // Push with one process driving the group: scratch of (num_ranks - 1) * num_tokens rows where the peers
  // store their rows (peers write into it during the call). Staged groups use their workspace (null here).
  void* slots = nullptr;
};
cudaError_t intranode_combine(const IntranodeCall& call, const CombineArgs& args);

// ---- Intranode expert-major ops (expert_major.cu; docs/design.md, "Expert-major layout") ------------------------
// Rows are (token, local expert) pairs grouped by local expert, each group in (source rank, source token) order.
// Items: the R*T tokens a rank may receive, item i = source rank * T + source token. A pair's row is the row of
// its group's pair; `pair_row` lists an item's pairs in ascending local expert (so ascending rows): the row of each
// kept pair, `capacity` for each dropped one (dropped pairs come last), -1 past the item's pairs (an item with no
// pair on this rank has -1 first).

// Dispatch: a token crosses to each rank once and is written into all of its pair rows there. Every pointer is
// this rank's; the FP8 pair's two payloads move as bytes.
struct ExpertMajorDispatchArgs {
  int32_t num_payloads = 0;  // 1, or 2 for the FP8 pair (values, scales)
  const void* x[2] = {};     // [num_tokens, row_bytes] each
  int64_t x_row_bytes[2] = {};
  const int32_t* topk_idx = nullptr;    // [num_tokens, num_topk]
  const float* topk_weights = nullptr;  // [num_tokens, num_topk], or null
  int64_t num_tokens = 0, num_topk = 0, num_experts = 0, capacity = 0, expert_alignment = 1;
  void* recv_x[2] = {};                 // [capacity, row_bytes] each: rows past the last group are not written
  float* recv_weights = nullptr;        // [capacity]: each kept pair's weight, 0 elsewhere; null iff topk_weights is
  int32_t* group_sizes = nullptr;       // [L]: pairs per local expert rounded up to expert_alignment
  int32_t* group_offsets = nullptr;     // [L]: first row of each group
  int32_t* num_kept = nullptr;          // scalar: pairs below capacity
  int32_t* num_dropped = nullptr;       // scalar: pairs past capacity
  int32_t* invalid_ids = nullptr;       // scalar: this rank's entries outside [-1, E)
  int32_t* rows_needed = nullptr;       // scalar: the capacity that keeps every pair (the last pair's row + 1)
  int32_t* recv_src_index = nullptr;    // [capacity]: the item of each kept pair's row, R*T elsewhere
  bool* is_token_in_rank = nullptr;     // [num_tokens, num_ranks]
  int32_t* pair_row = nullptr;          // [R*T, min(num_topk, L)] (see above)
  int32_t* topk_row = nullptr;          // [R*T, num_topk]: the row of the kept pair of each entry, else capacity
  int32_t* rows_end = nullptr;          // [1]: min(capacity, the end of the last group)
  int32_t* block_counts = nullptr;      // scratch [block_count_rows, num_experts]: one row per block of the launch
  int64_t block_count_rows = 0;
};
// cudaErrorInvalidValue: outside the limits (kernel_limits.h, kExpertMajorMaxExperts; scratch rows below the grid).
cudaError_t intranode_expert_major_dispatch(const IntranodeCall& call, const ExpertMajorDispatchArgs& args);

// Cached dispatch: new data [num_tokens, row_bytes] on an earlier expert-major dispatch's rows; rows of the groups
// that hold no pair are zeroed, rows past the last group are not written.
struct ExpertMajorCachedDispatchArgs {
  const void* x = nullptr;
  int64_t row_bytes = 0, num_tokens = 0, capacity = 0, num_pair_columns = 0;
  const int32_t* pair_row = nullptr;        // [R*T, num_pair_columns]
  const int32_t* recv_src_index = nullptr;  // [capacity]
  const int32_t* rows_end = nullptr;        // [1] (device)
  void* recv_x = nullptr;                   // [capacity, row_bytes]
};
cudaError_t intranode_expert_major_cached_dispatch(const IntranodeCall& call, const ExpertMajorCachedDispatchArgs& args);

// Combine's backward along an expert-major handle, a cached dispatch of the cotangent d_out [num_tokens, row] (y's
// type, rows of whole 16-byte vectors): on every row with a pair, d_y[row] = weights[row] * d_out[token] (the
// float32 product rounded to y's type; d_out[token] itself without weights) and d_weights[row] = the float32 dot of
// d_out[token] and y[row] (with weights); every other row of d_weights is zero, and of d_y those up to
// kExpertMajorGradZeroRows past the last group (the rows after them are left as they are). Each item's d_out row
// is read once from its home rank.
struct ExpertMajorCombineBackwardArgs {
  ExpertMajorCachedDispatchArgs rows;  // x: d_out; recv_x: d_y
  FloatType type = FloatType::kF32;    // of d_out, y and d_y
  const void* y = nullptr;             // [capacity, row]
  const float* weights = nullptr;      // [capacity] or null
  float* d_weights = nullptr;          // [capacity] (with weights)
};
cudaError_t intranode_expert_major_combine_backward(const IntranodeCall& call,
                                                    const ExpertMajorCombineBackwardArgs& args);

// Combine: on each rank the partial of every item it received, p = sum over the item's kept pairs in order of
// weights[row] * y[row] (float32 from 0, each product rounded on its own; weight 1 without weights), rounded to
// y's type; each partial goes to the item's home rank (a store into its slots), which sums its tokens' partials
// over the ranks in rank order in float32, adds the bias, casts. Rows of y that no pair_row names are never read.
struct ExpertMajorCombineArgs : NormalCombineArgs {
  const float* weights = nullptr;           // [capacity] or null
  const int32_t* pair_row = nullptr;        // [R*T, num_pair_columns]
  int64_t num_pair_columns = 0;
  const bool* is_token_in_rank = nullptr;   // [num_tokens, num_ranks]: the ranks that hold a partial of a token
  const void* bias = nullptr;
  FloatType bias_type = FloatType::kF32;
  void* out = nullptr;                      // [num_tokens, row_elements]
  FloatType out_type = FloatType::kF32;     // y's type or f32
  void* slots = nullptr;  // one process: scratch of (R - 1) * T rows of y's row bytes (staged: the workspace)
};
cudaError_t intranode_expert_major_combine(const IntranodeCall& call, const ExpertMajorCombineArgs& args);

#if defined(JAX_EP_INSTRUMENT)
// The benchmark's all-to-all store ceiling: every rank stores `bytes_per_peer` bytes into each peer's `out`
// ([num_ranks, bytes_per_peer] bytes, region `rank` of each peer), all peers at once, with plain 16-byte
// stores from the call's SMs. One process driving the group only (peers write into XLA's buffers).
struct StoreProbeArgs {
  void* out = nullptr;
  int64_t bytes_per_peer = 0;  // a multiple of 16
};
cudaError_t intranode_store_probe(const IntranodeCall& call, const StoreProbeArgs& args);
#endif

}  // namespace jax_ep
#endif

#if defined(JAX_EP_WITH_NVSHMEM)
namespace jax_ep {

// ---- NVSHMEM (nvshmem_runtime.cu): one PE per process, owned by jax_ep ------------------------------------
// Bootstrap from a unique id: one process creates it, every process receives its bytes (jax_ep passes them
// through the jax.distributed key-value store) and initialises with its rank. Failures throw
// std::runtime_error naming the call.
std::string nvshmem_unique_id();
void nvshmem_initialize(int device_ordinal, int rank, int num_ranks, const std::string& unique_id);
bool nvshmem_is_initialized();
// Collective (every PE, same size): zeroed symmetric memory, valid at the same offset on every PE.
void* nvshmem_allocate(int64_t bytes);
void nvshmem_release(void* pointer);
// Each PE puts its rank into the next PE's word of a symmetric array and reads the word its previous PE
// wrote: the device-side transport check of the test suite. Returns the value read.
int nvshmem_ring_check();

// A Buffer's symmetric region on one device (the low-latency region under the NVSHMEM transport): the rank of this
// device in its EP group, the NVSHMEM PE of each rank, and where plain stores reach the regions of this rank's node.
struct SymmetricRegion {
  char* base = nullptr;  // symmetric address: the same offset names the same word on every PE
  int64_t bytes = 0;
  int32_t rank = 0, num_ranks = 0;
  int32_t device_sms = 0;
  int32_t pes[kMaxLowLatencyRanks] = {};
  // Rank r's region mapped here (nvshmem_ptr) when r is on this rank's node, else null (reached by puts).
  char* node_regions[kMaxLowLatencyRanks] = {};
  TimeoutRecord* error = nullptr;   // the Buffer's timeout record on this device (registry.h)
};
// Collective over every PE (each calls it once per Buffer, in the same order, with the same size):
// allocates and zeroes `bytes` of symmetric memory for (buffer_id, device_ordinal); pes[r] is the PE of EP
// rank r of this device's group, which holds this process's PE. The ranks of this rank's node (r / ranks_per_node
// equal; 1: itself alone) must reach each other's memory by loads and stores (checked).
void nvshmem_region_create(int64_t buffer_id, int device_ordinal, int64_t bytes, const std::vector<int>& pes,
                           int ranks_per_node);
bool nvshmem_region_lookup(int64_t buffer_id, int device_ordinal, SymmetricRegion* out);
// Forgets every region of buffer_id in this process (lookups fail from here on) and, with `release`, frees
// them: collective like create, so release only once every PE agreed to (a PE whose CUDA context a timed-out
// kernel killed cannot take part; the others then forget without freeing). Returns "" or the errors met.
std::string nvshmem_region_destroy(int64_t buffer_id, bool release);

}  // namespace jax_ep
#endif

#if defined(JAX_EP_WITH_NVSHMEM)
namespace jax_ep {

// ---- Internode normal mode (internode.cu, internode_runtime.cu; layouts: internode_state.h, kernel_limits.h) ----
// The normal-mode contract over N nodes of P ranks, one process per GPU. Every rank owns one NVSHMEM symmetric
// region (allocated collectively by every PE of the job): the header, then `region_bytes` that each op lays
// out for its shapes. Network traffic goes through NVSHMEM puts and signals, between the ranks of one local
// index ("rails"); NVLink traffic inside a node reads the node peers' regions through nvshmem_ptr mappings.

struct TimeoutRecord;  // the timeout record, shared with the intranode mode (intranode_state.h)

// One rank as a kernel launch needs it (copied into the kernel's parameters).
struct InternodeRank {
  int32_t rank = 0, num_ranks = 0;
  int32_t ranks_per_node = 0, num_nodes = 0;
  int32_t node = 0, local = 0;                   // rank = node * ranks_per_node + local
  int32_t device_sms = 0;
  int32_t pe_of_rank[kMaxInternodeRanks] = {};   // NVSHMEM PE of every EP rank
  char* region = nullptr;                        // this rank's symmetric region (header first)
  char* node_regions[kMaxRanksPerNode] = {};     // the regions of this node's ranks by local index, mapped here
  int64_t region_bytes = 0;                      // bytes after the header
  TimeoutRecord* error = nullptr;                // this rank's record (pinned host memory, mapped)
};

// Runtime (internode_runtime.cu). Collective over every NVSHMEM PE (nvshmem_malloc/free), in the same order on
// every process; failures throw std::runtime_error / std::invalid_argument. pe_of_rank[g] is the PE of EP rank
// g; ranks of one node must reach each other's symmetric memory by loads and stores (checked).
void internode_create(int64_t buffer_id, int device_ordinal, int rank, int ranks_per_node,
                      const std::vector<int>& pe_of_rank, int64_t region_bytes);
// Forgets buffer_id's internode rank in this process and, with `release`, waits for the device, then frees its
// region (collective: release only once every PE agreed to, as nvshmem_region_destroy); returns "" or the errors met.
std::string internode_destroy(int64_t buffer_id, bool release);
bool internode_lookup(int64_t buffer_id, int device_ordinal, InternodeRank* out);
// One line per rank of buffer_id in this process whose kernel timed out (op, rank, the rank it waited for, what).
std::vector<std::string> internode_errors(int64_t buffer_id);
// (calls, summed kernel nanoseconds) per device of buffer_id in this process since the last reset.
#if defined(JAX_EP_INSTRUMENT)
std::vector<std::pair<uint64_t, uint64_t>> internode_kernel_times(int64_t buffer_id, bool reset);
#endif

using InternodeCall = NormalCall<InternodeRank>;

// Normal dispatch over nodes. The handle's relay part describes this rank as a relay: relay_row [N*T, P]: row on
// node peer j of token t of rank (s, local) (index s*T + t), -1 where that peer has none (not routed there, or
// dropped); relay_token [N*T]: whether that token came into this node at all.
struct InternodeDispatchArgs : NormalDispatchArgs {
  int32_t* relay_row = nullptr;         // [N*T, P]
  bool* relay_token = nullptr;          // [N*T]
};
// cudaErrorMemoryAllocation: the shapes need more than region_bytes; cudaErrorInvalidValue: bad sizes.
cudaError_t internode_dispatch(const InternodeCall& call, const InternodeDispatchArgs& args);

// New data [T, row_bytes] along an earlier dispatch's routing (recv_src_index and is_token_in_rank).
struct InternodeCachedDispatchArgs {
  const void* x = nullptr;
  int64_t row_bytes = 0, num_tokens = 0, capacity = 0;
  const int32_t* recv_src_index = nullptr;
  const bool* is_token_in_rank = nullptr;
  void* recv_x = nullptr;
};
cudaError_t internode_cached_dispatch(const InternodeCall& call, const InternodeCachedDispatchArgs& args);

// out[t] = (sum over nodes m in order of partial_m[t]) + bias[t], cast to out_type, where partial_m[t] = the sum
// over node m's ranks j in order of y_(m,j)[row of t] (float32 both, each starting from 0).
struct InternodeCombineArgs : NormalCombineArgs {
  const int32_t* recv_src_index = nullptr;   // [capacity]: which rows of y are valid
  const bool* is_token_in_rank = nullptr;    // [T, R]: which nodes hold partials of this rank's tokens
  const int32_t* relay_row = nullptr;        // [N*T, P]
  const bool* relay_token = nullptr;         // [N*T]
  const void* bias = nullptr;
  FloatType bias_type = FloatType::kF32;
  void* out = nullptr;
  FloatType out_type = FloatType::kF32;
};
cudaError_t internode_combine(const InternodeCall& call, const InternodeCombineArgs& args);

// Expert-major ops over nodes (internode_expert_major.cu): the intranode expert-major contract (above), each token
// put once per destination node and relayed inside it as in the rank-major dispatch, then written into all of its
// kept pair rows on each rank. The dispatch's handle adds the relay part: relay_row [N*T, P] holds, for token t
// of rank (s, local) (index s*T + t), its item s*T + t on each node peer j that received it (where that peer stages
// the token's partial in the combine), -1 on the others; relay_token [N*T] whether any did.
struct InternodeExpertMajorDispatchArgs {
  ExpertMajorDispatchArgs rows;
  int32_t* relay_row = nullptr;   // [N*T, P]
  bool* relay_token = nullptr;    // [N*T]
};
cudaError_t internode_expert_major_dispatch(const InternodeCall& call, const InternodeExpertMajorDispatchArgs& args);

// Cached dispatch, and combine's backward (a cached dispatch of d_out): the tokens go to the nodes of
// is_token_in_rank [T, R] (the dispatch's), then as the intranode ops.
struct InternodeExpertMajorCachedDispatchArgs {
  ExpertMajorCachedDispatchArgs rows;
  const bool* is_token_in_rank = nullptr;
};
cudaError_t internode_expert_major_cached_dispatch(const InternodeCall& call,
                                                   const InternodeExpertMajorCachedDispatchArgs& args);
struct InternodeExpertMajorCombineBackwardArgs {
  ExpertMajorCombineBackwardArgs gradients;
  const bool* is_token_in_rank = nullptr;
};
cudaError_t internode_expert_major_combine_backward(const InternodeCall& call,
                                                    const InternodeExpertMajorCombineBackwardArgs& args);

// Combine: each rank's partial of every item it received (ExpertMajorCombineArgs' sum, rounded to y's type) is
// staged at the item's row; then the rank-major internode combine of those rows along the relay part (sums:
// capacity R*T, its y unused).
struct InternodeExpertMajorCombineArgs {
  ExpertMajorCombineArgs partials;  // y, weights, pair_row, num_pair_columns (its bias, out and slots unused)
  InternodeCombineArgs sums;
};
cudaError_t internode_expert_major_combine(const InternodeCall& call, const InternodeExpertMajorCombineArgs& args);

}  // namespace jax_ep
#endif

#if defined(JAX_EP_WITH_CUDA)
namespace jax_ep {

// ---- Low-latency mode (low_latency_*.cu; region layout in low_latency_state.h) ---------------------------------
// Dispatch and combine, each a send and a receive launch joined by a token (the device-side call number).
// Senders write rows into the receivers' LL regions (peer stores or NVSHMEM puts) and raise per-(expert,
// source) flags tagged with the call number; two buffer sets alternate per call and credits bound the skew
// between ranks. See low_latency_protocol.cuh for the protocol.

// Error-record values of the LL kernels (TimeoutRecord.op / .wait); the intranode normal mode uses 1..7 and 1..5.
enum class LowLatencyOp : int32_t { kDispatchSend = 10, kDispatchRecv = 11, kCombineSend = 12, kCombineRecv = 13 };
enum class LowLatencyWait : int32_t {
  kCredit = 10,  // a send waited for a peer to finish receiving call - 2 of the same buffer set
  kFlag = 11,    // a receive waited for a peer's rows of this call
};

// What the dispatch rows carry: BF16, or e4m3 with float32 scales per 128 channels, or with UE8M0 scales
// (the exponent bytes of power-of-two scales, four per int32).
enum class LowLatencyPayload : int32_t { kBF16 = 0, kFP8 = 1, kFP8UE8M0 = 2 };

// The row format of a low-latency combine's send: BF16 as given, or LogFMT-10 blocks (logfmt.cuh).
enum class LowLatencyCompression : uint8_t { kNone = 0, kLogFmt = 1 };  // one byte: the args keep their layout
// Its members' names as Python spells them (`compression=`), by value: _C.enums() exports these and the handlers
// accept exactly these values, so a new member is added here and in the kernels only.
inline constexpr const char* kLowLatencyCompressionNames[] = {"none", "logfmt"};

// How the LL kernels reach other ranks' LL regions. kPeerStores: plain stores through peer pointers (NVLink
// peer access in one process, CUDA IPC mappings across processes). kNvshmem: the regions are NVSHMEM
// symmetric memory and rows travel as NVSHMEM puts, flags and credits as signals (one process per GPU).
enum class LowLatencyTransport : int32_t { kPeerStores = 0, kNvshmem = 1 };

// The rank a low-latency launch runs as.
struct LowLatencyRank {
  int32_t rank = 0, num_ranks = 0;
  int32_t device_sms = 0;             // multiprocessors of this rank's device
  TimeoutRecord* error = nullptr;     // this rank's timeout record (pinned host memory, mapped)
};

// Per launch. The LL region sizes follow (num_max_tokens, hidden, num_experts).
struct LowLatencyCall {
  LowLatencyRank group;
  LowLatencyTransport transport = LowLatencyTransport::kPeerStores;
  char* region = nullptr;                         // this rank's LL region, here
  // Rank r's LL region mapped here where plain stores reach it: every rank under kPeerStores; under kNvshmem the
  // ranks of this rank's node (an internode Buffer's NVLink domain; an intranode Buffer: this rank alone). Null:
  // reached by NVSHMEM puts to PE pes[r].
  char* peer_regions[kMaxLowLatencyRanks] = {};
  int32_t pes[kMaxLowLatencyRanks] = {};          // kNvshmem: the NVSHMEM PE of every rank
  int64_t num_max_tokens = 0;  // M
  int64_t hidden = 0;          // H, a multiple of 128
  int64_t num_experts = 0;     // E, a multiple of the ranks
  int64_t timeout_ns = 0;
  // Config(on_timeout="mask"): a wait past timeout_ns masks its peer (LowLatencyHeader::masked) and gives up on it
  // instead of trapping, and no wait, row or flag involves a masked peer. Else every wait past the bound traps.
  bool mask_on_timeout = false;
  cudaStream_t stream = nullptr;
};

// Fills the rank and region fields of `call` for (buffer_id, device_ordinal): the LL region at `ll_offset` of
// the intranode workspace (kPeerStores) or of the Buffer's symmetric region (kNvshmem; intranode or internode
// Buffers). Returns "" or why there is none; *available_bytes: the bytes from the region's start to the end of its
// allocation.
std::string low_latency_lookup(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport,
                               int64_t ll_offset, LowLatencyCall* call, int64_t* available_bytes);

struct LowLatencyDispatchSendArgs {
  const void* x = nullptr;            // bf16 [num_tokens, H]
  const int32_t* topk_idx = nullptr;  // [num_tokens, num_topk]; ids outside [0, E) are sent nowhere
  int64_t num_tokens = 0, num_topk = 0;  // 1 <= num_tokens <= M, num_topk <= kLowLatencyMaxTopk, and
                                         // num_tokens * num_topk <= kLowLatencyMaxEntries
  LowLatencyPayload payload = LowLatencyPayload::kBF16;
  bool round_scale = false;           // FP8: scales rounded up to powers of two (implied by kFP8UE8M0)
  int32_t* invalid_ids = nullptr;     // scalar: entries outside [-1, E)
  uint32_t* token = nullptr;          // scalar: this call's number, for the receive
};
cudaError_t low_latency_dispatch_send(const LowLatencyCall& call, const LowLatencyDispatchSendArgs& args);

// Outputs of L = E / R local experts, R*M rows each, packed by (source rank, source token).
struct LowLatencyDispatchRecvArgs {
  const uint32_t* token = nullptr;    // from the send
  LowLatencyPayload payload = LowLatencyPayload::kBF16;  // as the send's
  void* recv_x = nullptr;             // [L, R*M, H] bf16, or e4m3 bytes
  void* recv_scales = nullptr;        // FP8: f32 [L, R*M, H/128] or UE8M0 int32 [L, R*M, H/512]; else null
  int32_t* recv_count = nullptr;      // [L]
  int32_t* src_token_index = nullptr; // [L, R*M]: source token of each row, -1 past recv_count
  int32_t* src_topk_index = nullptr;  // [L, R*M]: top-k slot of the row's expert in its source token, -1 past
  int32_t* layout_range = nullptr;    // [L, R, 2]: (first row, rows) per (local expert, source rank)
};
cudaError_t low_latency_dispatch_recv(const LowLatencyCall& call, const LowLatencyDispatchRecvArgs& args);

struct LowLatencyCombineSendArgs {
  const void* y = nullptr;                // bf16 [L, R*M, H]: rows past each expert's count are ignored
  const int32_t* src_token_index = nullptr;  // the dispatch handle's [L, R*M]
  const int32_t* src_topk_index = nullptr;   // [L, R*M]
  const int32_t* layout_range = nullptr;     // [L, R, 2]
  uint32_t* token = nullptr;
  LowLatencyCompression compression = LowLatencyCompression::kNone;  // the rows' format on the way
};
cudaError_t low_latency_combine_send(const LowLatencyCall& call, const LowLatencyCombineSendArgs& args);

// out[t] = sum over k in order of topk_weights[t, k] * (row of expert topk_idx[t, k] for t), float32, bf16 out.
struct LowLatencyCombineRecvArgs {
  const uint32_t* token = nullptr;
  const int32_t* topk_idx = nullptr;      // [num_tokens, num_topk]; ids outside [0, E) add nothing
  const float* topk_weights = nullptr;    // [num_tokens, num_topk]
  int64_t num_tokens = 0, num_topk = 0;
  void* out = nullptr;                    // bf16 [num_tokens, H]
  LowLatencyCompression compression = LowLatencyCompression::kNone;  // the send's
};
cudaError_t low_latency_combine_recv(const LowLatencyCall& call, const LowLatencyCombineRecvArgs& args);

// masked [R] int32: 1 for each peer this rank masks (LowLatencyHeader::masked), else 0; stream-ordered.
cudaError_t low_latency_read_masks(const LowLatencyCall& call, int32_t* masked);
// Per device of `device_ordinals` (this process's) holding a rank of buffer_id: its LL header's masked words [R]
// (LowLatencyHeader::masked), then the dispatches it has started. Call only while no kernel of the buffer runs.
std::vector<std::vector<uint64_t>> low_latency_masks(int64_t buffer_id, const std::vector<int>& device_ordinals,
                                                     LowLatencyTransport transport, int64_t ll_offset);
// Writes the masked words [R] of the rank of buffer_id on `device_ordinal`; same rule.
void low_latency_set_masks(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport, int64_t ll_offset,
                           const std::vector<uint64_t>& masked);
// Zeroes the LL state of the rank of buffer_id on `device_ordinal` (call counters, credits, flags, counters, masks:
// as when made), for a rank let back in after the job re-synchronised: every rank of the group resets, while no
// kernel of the buffer runs on any of them.
void low_latency_reset(int64_t buffer_id, int device_ordinal, LowLatencyTransport transport, int64_t ll_offset,
                       int64_t num_max_tokens, int64_t hidden, int64_t num_experts);

// One line per device of `device_ordinals` whose LL kernel of `buffer_id` timed out (readable after the trap).
std::vector<std::string> low_latency_errors(int64_t buffer_id, const std::vector<int>& device_ordinals);
#if defined(JAX_EP_INSTRUMENT)
// Per device of buffer_id in this process: the raw LowLatencyTrace ring of every LL kernel (low_latency_state.h;
// LowLatencyKernel order, kLowLatencyTraceCalls slots each, 64-bit words named by low_latency_trace_fields);
// `reset` then prepares every slot for the next calls. Call only while no kernel of the buffer runs.
std::vector<std::vector<uint64_t>> low_latency_trace(int64_t buffer_id, const std::vector<int>& device_ordinals,
                                                     LowLatencyTransport transport, int64_t ll_offset, bool reset);
// The names of a trace slot's words: the fields every kernel has, then per kernel its phases ("-": unused).
std::pair<std::vector<std::string>, std::vector<std::vector<std::string>>> low_latency_trace_fields();
#endif

}  // namespace jax_ep
#endif
