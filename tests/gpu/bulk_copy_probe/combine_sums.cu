// Probe: how fast can S SMs do the expert-major combine's local fan-in at DeepEP's shape? Each of `tokens` tokens
// has kPairs pair rows of `hidden` bf16 scattered over y (a bijection of its rows, as a token's pairs lie in
// different experts' groups); a warp sums a token's pairs weighted, in pair order, in float32, a 2 KB column chunk
// at a time, and stores the chunk of its partial row rounded to bf16. Three ways to read the pair rows:
//   bulk:  lane 0 of each warp streams the chunks (cp.async.bulk, 2 KB each, completion on an mbarrier) through
//          kStages stages of shared memory, kAhead ahead; every lane reads back its 16-byte vectors;
//   plain: each lane loads its vectors of the job's kPairs chunks straight from global memory, all in flight;
//   rows:  a CTA's thread 0 loads whole pair rows (or halves) by cp.async.bulk, kSlots tokens ahead, and the CTA's
//          threads sum them from shared memory (sums_rows): a few large copies instead of many 2 KB ones.
// Defaults: 8192 tokens x 4 pairs x 7168 = 470 MB of pair rows (what one rank of two reads at T=4096, K=8, E=256)
// and 117 MB of partials. Checks every job's output against a float32 sum on the host. One GPU.
//   combine_sums [TOKENS [HIDDEN]]
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bulk_copy.cuh"

constexpr int kPairs = 4;                       // pair rows a token sums (K = 8 over two ranks)
constexpr int kChunkBytes = 2048;               // a job: one token's 2 KB column chunk (the combine kernel's)
constexpr int kChunkVecs = kChunkBytes / 16;    // 16-byte vectors of a chunk
constexpr int kLaneVecs = kChunkVecs / 32;      // a lane's vectors of a chunk (4: 32 bf16, 32 float sums)

// A token's pair k lies in row pair_row(t * kPairs + k) of y.
__host__ __device__ __forceinline__ int pair_row(int i, int rows) { return shuffled_row(i, rows, 0x2545u); }
// Values small multiples of 1/8 (exact in bf16) and weights multiples of 1/16: the float32 sums are exact until the
// final rounding, so the host's sum gives the same bits.
__host__ __device__ __forceinline__ float y_value(int row, int column) {
  return (float)((row * 131 + column * 7) % 64 - 32) / 8.f;
}
__host__ __device__ __forceinline__ float pair_weight(int row) { return (float)(row % 16 + 1) / 16.f; }

__global__ void fill_y(__nv_bfloat16* y, int rows, int hidden) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)rows * hidden;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] = __float2bfloat16(y_value((int)(i / hidden), (int)(i % hidden)));
}

// acc8 (8 floats) += w * the 8 bf16 of v, in float32.
__device__ __forceinline__ void add_weighted(float* acc8, uint4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    acc8[2 * e] = fmaf(w, f.x, acc8[2 * e]);
    acc8[2 * e + 1] = fmaf(w, f.y, acc8[2 * e + 1]);
  }
}

// acc8 rounded to 8 bf16.
__device__ __forceinline__ uint4 rounded(const float* acc8) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(acc8[2 * e], acc8[2 * e + 1]);
  return v;
}

__device__ __forceinline__ void store_partial(const float (&acc)[kLaneVecs * 8], __nv_bfloat16* out, int token,
                                              int chunk, int hidden, int lane) {
  uint4* row = reinterpret_cast<uint4*>(out + (size_t)token * hidden + (size_t)chunk * (kChunkBytes / 2));
#pragma unroll
  for (int u = 0; u < kLaneVecs; ++u) row[u * 32 + lane] = rounded(acc + u * 8);
}

// Jobs (token, chunk) in order, warp w of the grid taking jobs w, w + warps, ...
__device__ __forceinline__ int num_jobs(int tokens, int hidden) { return tokens * (hidden * 2 / kChunkBytes); }

template <int kWarps, int kStages, int kAhead>
__global__ void __launch_bounds__(32 * kWarps) sums_bulk(const __nv_bfloat16* y, __nv_bfloat16* out, int tokens,
                                                         int rows, int hidden) {
  extern __shared__ __align__(128) uint4 stages_mem[];
  __shared__ __align__(8) uint64_t all_bars[kWarps * kStages];
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  uint4* stages = stages_mem + (size_t)warp * kStages * kChunkVecs;
  uint64_t* bars = all_bars + warp * kStages;
  if (lane == 0) init_barriers(bars, kStages);
  __syncwarp();
  const int chunks = hidden * 2 / kChunkBytes, jobs = num_jobs(tokens, hidden);
  const int grid_warp = (int)blockIdx.x * kWarps + warp, grid_warps = (int)gridDim.x * kWarps;
  const int mine = (jobs - grid_warp + grid_warps - 1) / grid_warps;
  const int loads = mine * kPairs;  // load n: pair n % kPairs of the warp's job n / kPairs
  auto issue = [&](int n) {
    if (lane != 0 || n >= loads) return;
    const int job = grid_warp + (n / kPairs) * grid_warps, token = job / chunks, chunk = job % chunks;
    const int row = pair_row(token * kPairs + n % kPairs, rows);
    const int s = n % kStages;
    bulk_load(stages + (size_t)s * kChunkVecs, y + (size_t)row * hidden + (size_t)chunk * (kChunkBytes / 2),
              kChunkBytes, &bars[s]);
  };
  for (int n = 0; n < kAhead; ++n) issue(n);
  float acc[kLaneVecs * 8];
  for (int n = 0; n < loads; ++n) {
    const int s = n % kStages, k = n % kPairs;
    const int job = grid_warp + (n / kPairs) * grid_warps, token = job / chunks;
    if (k == 0)
      for (float& a : acc) a = 0.f;
    wait_loaded(&bars[s], (n / kStages) & 1);
    const float w = pair_weight(pair_row(token * kPairs + k, rows));
#pragma unroll
    for (int u = 0; u < kLaneVecs; ++u) add_weighted(acc + u * 8, stages[(size_t)s * kChunkVecs + u * 32 + lane], w);
    __syncwarp();  // every lane has read stage s before lane 0 loads into it again
    issue(n + kAhead);
    if (k == kPairs - 1) store_partial(acc, out, token, job % chunks, hidden, lane);
  }
}

__global__ void __launch_bounds__(512) sums_plain(const __nv_bfloat16* y, __nv_bfloat16* out, int tokens, int rows,
                                                  int hidden) {
  const int lane = (int)threadIdx.x % 32, chunks = hidden * 2 / kChunkBytes, jobs = num_jobs(tokens, hidden);
  const int grid_warps = (int)(gridDim.x * blockDim.x / 32);
  for (int job = (int)(blockIdx.x * blockDim.x + threadIdx.x) / 32; job < jobs; job += grid_warps) {
    const int token = job / chunks, chunk = job % chunks;
    uint4 v[kPairs][kLaneVecs];
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const uint4* row = reinterpret_cast<const uint4*>(y + (size_t)pair_row(token * kPairs + k, rows) * hidden +
                                                        (size_t)chunk * (kChunkBytes / 2));
#pragma unroll
      for (int u = 0; u < kLaneVecs; ++u) v[k][u] = __ldg(row + u * 32 + lane);
    }
    float acc[kLaneVecs * 8] = {};
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const float w = pair_weight(pair_row(token * kPairs + k, rows));
#pragma unroll
      for (int u = 0; u < kLaneVecs; ++u) add_weighted(acc + u * 8, v[k][u], w);
    }
    store_partial(acc, out, token, chunk, hidden, lane);
  }
}

// Whole pair rows (or 1/kSplit of each) by bulk copies, a CTA at a time: thread 0 loads the kPairs rows of the
// CTA's job n (a token's part) into slot n % kSlots, all kPairs completing on that slot's mbarrier, kSlots jobs ahead;
// every thread sums 16-byte vectors of the slot and stores them, then the CTA syncs and the slot is loaded again.
template <int kSlots, int kSplit>
__global__ void __launch_bounds__(512) sums_rows(const __nv_bfloat16* y, __nv_bfloat16* out, int tokens, int rows,
                                                 int hidden) {
  extern __shared__ __align__(128) uint4 slots_mem[];
  __shared__ __align__(8) uint64_t bars[kSlots];
  const int part_vecs = hidden * 2 / 16 / kSplit, part_elems = hidden / kSplit;
  if (threadIdx.x == 0) init_barriers(bars, kSlots);
  __syncthreads();
  const int jobs = tokens * kSplit, mine = (jobs - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  auto issue = [&](int n) {
    if (threadIdx.x != 0 || n >= mine) return;
    const int job = (int)blockIdx.x + n * (int)gridDim.x, token = job / kSplit, part = job % kSplit;
    uint4* slot = slots_mem + (size_t)(n % kSlots) * kPairs * part_vecs;
    expect_bytes(&bars[n % kSlots], kPairs * part_vecs * 16);
    for (int k = 0; k < kPairs; ++k)
      bulk_copy(slot + (size_t)k * part_vecs,
                y + (size_t)pair_row(token * kPairs + k, rows) * hidden + (size_t)part * part_elems, part_vecs * 16,
                &bars[n % kSlots]);
  };
  for (int n = 0; n < kSlots; ++n) issue(n);
  for (int n = 0; n < mine; ++n) {
    const int job = (int)blockIdx.x + n * (int)gridDim.x, token = job / kSplit, part = job % kSplit;
    const uint4* slot = slots_mem + (size_t)(n % kSlots) * kPairs * part_vecs;
    float w[kPairs];
#pragma unroll
    for (int k = 0; k < kPairs; ++k) w[k] = pair_weight(pair_row(token * kPairs + k, rows));
    wait_loaded(&bars[n % kSlots], (n / kSlots) & 1);
    uint4* row = reinterpret_cast<uint4*>(out + (size_t)token * hidden + (size_t)part * part_elems);
    for (int v = (int)threadIdx.x; v < part_vecs; v += (int)blockDim.x) {
      float acc[8] = {};
#pragma unroll
      for (int k = 0; k < kPairs; ++k) add_weighted(acc, slot[(size_t)k * part_vecs + v], w[k]);
      row[v] = rounded(acc);
    }
    __syncthreads();  // every thread has read slot n % kSlots before thread 0 loads job n + kSlots into it
    issue(n + kSlots);
  }
}

using Sums = void (*)(const __nv_bfloat16*, __nv_bfloat16*, int, int, int);
// smem: bytes of shared memory; or, for sums_rows, its slots and split (kPairs rows / split each, at run time).
struct Way {
  const char* name;
  Sums kernel;
  int threads, smem, row_slots = 0, split = 1;
};
const Way kWays[] = {
    {"plain loads, 16 warps a block, 4 pairs x 4 vectors a lane in flight", sums_plain, 512, 0},
    {"bulk, 4 warps x 24 stages, 16 ahead", sums_bulk<4, 24, 16>, 128, 4 * 24 * kChunkBytes},
    {"bulk, 8 warps x 12 stages, 8 ahead", sums_bulk<8, 12, 8>, 256, 8 * 12 * kChunkBytes},
    {"bulk, 16 warps x 6 stages, 4 ahead", sums_bulk<16, 6, 4>, 512, 16 * 6 * kChunkBytes},
    {"bulk, 16 warps x 5 stages, 4 ahead (about the combine kernel's depth)", sums_bulk<16, 5, 4>, 512,
     16 * 5 * kChunkBytes},
    {"bulk whole rows, 3 tokens in flight a CTA, 16 warps", sums_rows<3, 1>, 512, 0, 3, 1},
    {"bulk whole rows, 2 tokens in flight a CTA, 16 warps", sums_rows<2, 1>, 512, 0, 2, 1},
    {"bulk whole rows, 3 tokens in flight a CTA, 8 warps", sums_rows<3, 1>, 256, 0, 3, 1},
    {"bulk half rows, 7 halves in flight a CTA, 16 warps", sums_rows<7, 2>, 512, 0, 7, 2},
    {"bulk half rows, 4 halves in flight a CTA, 16 warps", sums_rows<4, 2>, 512, 0, 4, 2},
};

// Dynamic shared memory of `way` at this hidden size.
int smem_bytes(const Way& way, int hidden) {
  return way.row_slots ? way.row_slots * kPairs * hidden * 2 / way.split : way.smem;
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 8192, hidden = argc > 2 ? atoi(argv[2]) : 7168;
  const int rows = tokens * kPairs;
  if ((rows & (rows - 1)) || (hidden * 2) % kChunkBytes) {
    printf("tokens * %d must be a power of two and hidden * 2 a multiple of %d\n", kPairs, kChunkBytes);
    return 1;
  }
  const double read_bytes = (double)rows * hidden * 2, write_bytes = (double)tokens * hidden * 2;
  __nv_bfloat16 *y, *out;
  CK(cudaMalloc(&y, read_bytes));
  CK(cudaMalloc(&out, write_bytes));
  fill_y<<<528, 256>>>(y, rows, hidden);
  CK(cudaGetLastError());
  for (const Way& way : kWays)
    if (smem_bytes(way, hidden))
      CK(cudaFuncSetAttribute(way.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(way, hidden)));
  // The host's sums: pair order, float32 fma, rounded to bf16 once.
  std::vector<uint16_t> expected((size_t)tokens * hidden), got((size_t)tokens * hidden);
  for (int t = 0; t < tokens; ++t)
    for (int c = 0; c < hidden; ++c) {
      float acc = 0.f;
      for (int k = 0; k < kPairs; ++k) {
        const int row = pair_row(t * kPairs + k, rows);
        acc = std::fma(pair_weight(row), y_value(row, c), acc);
      }
      const __nv_bfloat16 b = __float2bfloat16(acc);
      std::memcpy(&expected[(size_t)t * hidden + c], &b, 2);
    }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("%d tokens x %d pairs x %d bf16: %.0f MB of pair rows read, %.0f MB of partials written\n", tokens, kPairs,
         hidden, read_bytes / 1e6, write_bytes / 1e6);
  for (const Way& way : kWays) {
    CK(cudaMemset(out, 0xff, write_bytes));
    way.kernel<<<24, way.threads, smem_bytes(way, hidden)>>>(y, out, tokens, rows, hidden);
    CK(cudaGetLastError());
    CK(cudaMemcpy(got.data(), out, write_bytes, cudaMemcpyDeviceToHost));
    long wrong = 0;
    for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != expected[i];
    printf("\n%s: %ld wrong of %zu\n", way.name, wrong, got.size());
    for (int sms : {8, 16, 24, 32, 48, 64, 100, 132}) {
      float best = 1e9;
      for (int it = 0; it < 5; ++it) {
        CK(cudaEventRecord(e0));
        way.kernel<<<sms, way.threads, smem_bytes(way, hidden)>>>(y, out, tokens, rows, hidden);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::min(best, ms);
      }
      printf("  %3d SMs: %7.1f us, pair rows read at %5.0f GB/s (%3.0f per SM), %5.0f GB/s read + written\n", sms,
             best * 1e3, read_bytes / best / 1e6, read_bytes / best / 1e6 / sms,
             (read_bytes + write_bytes) / best / 1e6);
    }
  }
  return 0;
}
