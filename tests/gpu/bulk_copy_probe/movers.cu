// Probe: how fast do a few SMs move rows with bulk copies (TMA), and what does that cost a matmul running beside
// them? Two GPUs; each gathers `rows` rows of `row_bytes` from random rows of its source and scatters them to
// random rows (shuffled_row) of a destination, the peer's (over NVLink) or its own (HBM). A persistent mover on S
// SMs, one CTA each, runs pipelines on one thread of each of its warps: each loads a row into shared memory
// (cp.async.bulk, completion on an mbarrier) and stores it from there (cp.async.bulk bulk groups), kAhead loads and
// kStages - kAhead stores in flight (each configuration whose rows fit in shared memory). Prints each rate alone,
// then beside a chain of cuBLAS bf16 GEMMs on another stream of the same GPU: how much longer the GEMMs took
// against the mover's time alone ("hidden"). Built and run by run.sh here.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "bulk_copy.cuh"

#define CB(x)                                                                                   \
  do {                                                                                          \
    cublasStatus_t s = (x);                                                                     \
    if (s != CUBLAS_STATUS_SUCCESS) { printf("cublas %d line %d\n", s, __LINE__); exit(1); }   \
  } while (0)

// kWarps pipelines a CTA, each run by lane 0 of its warp with kStages rows of shared memory of its own.
template <int kWarps, int kStages, int kAhead>
__global__ void __launch_bounds__(32 * kWarps) mover(const char* src, char* dst, uint32_t src_salt,
                                                     uint32_t dest_salt, int rows, int row_bytes, int copies,
                                                     int reps) {
  extern __shared__ __align__(128) char shared_rows[];
  __shared__ __align__(8) uint64_t all_bars[kWarps * kStages];
  const int warp = (int)threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  uint64_t* bars = all_bars + warp * kStages;
  char* stage_mem = shared_rows + (size_t)warp * kStages * row_bytes;
  init_barriers(bars, kStages);
  const int pipeline = (int)blockIdx.x * kWarps + warp, pipelines = (int)gridDim.x * kWarps;
  const int mine = (rows - pipeline + pipelines - 1) / pipelines;
  const int total = mine * reps;
  auto row_of = [&](int j) { return pipeline + (j % mine) * pipelines; };
  auto load = [&](int j) {
    const int s = j % kStages;
    bulk_load(stage_mem + (size_t)s * row_bytes, src + (size_t)shuffled_row(row_of(j), rows, src_salt) * row_bytes,
              row_bytes, &bars[s]);
  };
  for (int j = 0; j < kAhead && j < total; ++j) load(j);
  for (int j = 0; j < total; ++j) {
    int s = j % kStages;
    wait_loaded(&bars[s], (j / kStages) & 1);
    if (dst == nullptr) {  // reads only: the stage is free again once its load has landed
      if (j + kAhead < total) load(j + kAhead);
      continue;
    }
    for (int c = 0; c < copies; ++c)  // the row's `copies` stores, one bulk group
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                       dst + (size_t)shuffled_row(row_of(j) * copies + c, rows * copies, dest_salt) * row_bytes),
                   "r"(smem_addr(stage_mem + (size_t)s * row_bytes)), "r"(row_bytes)
                   : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j + kAhead < total) {
      // The stage of row j + kAhead last held row j + kAhead - kStages: its store must have read it.
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStages - kAhead) : "memory");
      load(j + kAhead);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

using Mover = void (*)(const char*, char*, uint32_t, uint32_t, int, int, int, int);
struct Depth { const char* name; Mover kernel; int warps, stages; };  // stages: each warp's
const Depth kDepths[] = {{"1 warp: 14 stages, 7 loads ahead", mover<1, 14, 7>, 1, 14},
                         {"2 warps: 7 stages, 4 loads ahead", mover<2, 7, 4>, 2, 7},
                         {"4 warps: 3 stages, 2 loads ahead", mover<4, 3, 2>, 4, 3},
                         {"4 warps: 12 stages, 6 loads ahead", mover<4, 12, 6>, 4, 12},
                         {"8 warps: 6 stages, 3 loads ahead", mover<8, 6, 3>, 8, 6}};
constexpr int kMostSharedBytes = 227 * 1024;
constexpr int kFanOutCopies = 4;  // stores of each row loaded, in the fan-out case (a dispatch's local experts)

__global__ void fill_rows(int* rows_data, int rows, int ints_per_row, int tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)rows * ints_per_row;
       i += (size_t)gridDim.x * blockDim.x)
    rows_data[i] = (int)(i / ints_per_row) * 2 + tag;
}

struct Gpu {
  char *src, *dst;
  uint32_t src_salt, dest_salt;
  __nv_bfloat16 *a, *b, *c;
  cudaStream_t mover_stream, gemm_stream;
  cublasHandle_t blas;
  cudaEvent_t e0, e1, g0, g1;
};

int main(int argc, char** argv) {
  const int row_bytes = argc > 1 ? atoi(argv[1]) : 14336, rows = argc > 2 ? atoi(argv[2]) : 4096;
  const int n = 8192, gemms = 12;
  const size_t bytes = (size_t)rows * row_bytes;
  if (rows & (rows - 1)) { printf("rows must be a power of two\n"); return 1; }
  Gpu g[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    for (const Depth& depth : kDepths)
      if (depth.warps * depth.stages * row_bytes <= kMostSharedBytes)
        CK(cudaFuncSetAttribute(depth.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                depth.warps * depth.stages * row_bytes));
    CK(cudaMalloc(&g[d].src, bytes));
    CK(cudaMalloc(&g[d].dst, bytes * kFanOutCopies));
    fill_rows<<<264, 256>>>((int*)g[d].src, rows, row_bytes / 4, d);
    CK(cudaGetLastError());
    g[d].src_salt = 0x1234u + 2 * d;
    g[d].dest_salt = 0x5678u + 2 * d;
    int least, greatest;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CK(cudaStreamCreateWithPriority(&g[d].mover_stream, cudaStreamNonBlocking, greatest));
    CK(cudaStreamCreateWithFlags(&g[d].gemm_stream, cudaStreamNonBlocking));
    for (auto** m : {&g[d].a, &g[d].b, &g[d].c}) CK(cudaMalloc(m, (size_t)n * n * 2));
    CK(cudaMemset(g[d].a, 0x3c, (size_t)n * n * 2));
    CK(cudaMemset(g[d].b, 0x3c, (size_t)n * n * 2));
    CB(cublasCreate(&g[d].blas));
    CB(cublasSetStream(g[d].blas, g[d].gemm_stream));
    for (auto* e : {&g[d].e0, &g[d].e1, &g[d].g0, &g[d].g1}) CK(cudaEventCreate(e));
  }
  auto sync_all = [&]() {
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
  };
  auto ms = [](cudaEvent_t a, cudaEvent_t b) { float t; CK(cudaEventElapsedTime(&t, a, b)); return t; };
  const float alpha = 1.f, beta = 0.f;
  auto gemm_chain = [&](int d) {
    CK(cudaEventRecord(g[d].g0, g[d].gemm_stream));
    for (int i = 0; i < gemms; ++i)
      CB(cublasGemmEx(g[d].blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, g[d].a, CUDA_R_16BF, n, g[d].b,
                      CUDA_R_16BF, n, &beta, g[d].c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaEventRecord(g[d].g1, g[d].gemm_stream));
  };
  enum Destination { kPeer, kOwn, kFanOut, kPeerFanOut, kNone };
  const char* kDestinationNames[] = {"to the peer (NVLink)", "to its own HBM",
                                     "fan-out: each row stored to 4 rows of its own HBM (GB/s of stores)",
                                     "fan-out of the peer's rows (read over NVLink) to 4 rows each of its own HBM "
                                     "(GB/s of stores)",
                                     "reads only (no stores)"};
  auto copies_of = [](Destination where) { return where == kFanOut || where == kPeerFanOut ? kFanOutCopies : 1; };
  auto move = [&](const Depth& depth, Destination where, int d, int sms, int reps) {
    CK(cudaEventRecord(g[d].e0, g[d].mover_stream));
    depth.kernel<<<sms, 32 * depth.warps, depth.warps * depth.stages * row_bytes, g[d].mover_stream>>>(
        where == kPeerFanOut ? g[1 - d].src : g[d].src,
        where == kPeer ? g[1 - d].dst : where == kNone ? nullptr : g[d].dst, g[d].src_salt,
        g[d].dest_salt, rows, row_bytes, copies_of(where), reps);
    CK(cudaGetLastError());
    CK(cudaEventRecord(g[d].e1, g[d].mover_stream));
  };
  sync_all();
  printf("rows %d x %d B = %.1f MB per GPU, gathered from random rows and scattered to random rows; %d x %d^3 bf16 "
         "GEMMs beside\n", rows, row_bytes, bytes / 1e6, gemms, n);
  float gemm_alone = 1e9;
  for (int it = 0; it < 3; ++it) {
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); gemm_chain(d); }
    sync_all();
    gemm_alone = std::min(gemm_alone, ms(g[0].g0, g[0].g1));
  }
  printf("GEMMs alone: %.3f ms (%.0f TFLOP/s)\n", gemm_alone, 2.0 * n * n * n * gemms / gemm_alone / 1e9);
  // One pass, then each destination row dst[shuffled_row(i * copies + c, dest_salt)] holds the source row
  // src[shuffled_row(i, src_salt)] (its index * 2 + the source's GPU): the count of ints that do not.
  auto wrong_after_one_pass = [&](const Depth& depth, Destination where) {
    const int copies = copies_of(where);
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaMemset(g[d].dst, 0xff, bytes * copies)); }
    sync_all();
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); move(depth, where, d, 16, 1); }
    sync_all();
    long wrong = 0;
    for (int d = 0; d < 2; ++d) {
      // The GPU whose kernel wrote d's rows (its salts), and the GPU whose source rows it read.
      const int writer = where == kPeer ? 1 - d : d, source = where == kPeer || where == kPeerFanOut ? 1 - d : d;
      const int ints = row_bytes / 4;
      std::vector<int> got(bytes * copies / 4);
      CK(cudaSetDevice(d));
      CK(cudaMemcpy(got.data(), g[d].dst, bytes * copies, cudaMemcpyDeviceToHost));
      for (int i = 0; i < rows; ++i)
        for (int c = 0; c < copies; ++c)
          for (int k = 0; k < ints; ++k)
            wrong += got[(size_t)shuffled_row(i * copies + c, rows * copies, g[writer].dest_salt) * ints + k] !=
                     shuffled_row(i, rows, g[writer].src_salt) * 2 + source;
    }
    return wrong;
  };
  for (Destination where : {kPeer, kOwn, kFanOut, kPeerFanOut, kNone}) {
    const double counted = bytes * copies_of(where);  // the bytes a rate counts: stored, or loaded without stores
    for (const Depth& depth : kDepths) {
      if (depth.warps * depth.stages * row_bytes > kMostSharedBytes) continue;
      if (where == kNone)
        printf("\n%s, %s\n", kDestinationNames[where], depth.name);
      else
        printf("\n%s, %s: %ld wrong ints after one pass\n", kDestinationNames[where], depth.name,
               wrong_after_one_pass(depth, where));
      for (int sms : {1, 2, 4, 8, 16, 24, 32, 132}) {
        float alone = 1e9;
        for (int it = 0; it < 3; ++it) {
          for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); move(depth, where, d, sms, 1); }
          sync_all();
          alone = std::min(alone, std::max(ms(g[0].e0, g[0].e1), ms(g[1].e0, g[1].e1)));
        }
        printf("  %3d SMs alone: %7.1f us, %4.0f GB/s (%3.0f per SM)", sms, alone * 1e3, counted / alone / 1e6,
               counted / alone / 1e6 / sms);
        if (sms > 32) { printf("\n"); continue; }
        // Beside the GEMMs: as many passes as fit in about half the chain, the mover launched first.
        const int reps = std::max(1, (int)(0.5f * gemm_alone / alone));
        for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); move(depth, where, d, sms, reps); gemm_chain(d); }
        sync_all();
        const float moved = ms(g[0].e0, g[0].e1), gemm = ms(g[0].g0, g[0].g1);
        printf(" | beside the GEMMs: %3d passes in %.3f ms (%4.0f GB/s), GEMMs +%.3f ms, hidden %3.0f %%\n", reps,
               moved, counted * reps / moved / 1e6, gemm - gemm_alone,
               100.0 * (1.0 - (gemm - gemm_alone) / (alone * reps)));
      }
    }
  }
  return 0;
}
