// Probe: how fast do a few SMs move rows with bulk copies (TMA), and what does that cost a matmul running beside
// them? Two GPUs; each gathers `rows` rows of `row_bytes` from random rows of its source and scatters them to
// random rows of a destination, the peer's (over NVLink) or its own (HBM). A persistent mover on S SMs, one
// thread of one CTA each, loads a row into shared memory (cp.async.bulk, completion on an mbarrier) and stores it
// from there (cp.async.bulk bulk groups), kAhead loads and kStages - kAhead stores of each CTA in flight.
// Prints each rate alone, then beside a chain of cuBLAS bf16 GEMMs on another stream of the same GPU: how much
// longer the GEMMs took against the mover's time alone ("hidden"). Built and run by run.sh here.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t err_ = (x);                                                                    \
    if (err_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); exit(1); } \
  } while (0)
#define CB(x)                                                                  \
  do {                                                                         \
    cublasStatus_t s = (x);                                                    \
    if (s != CUBLAS_STATUS_SUCCESS) { printf("cublas %d line %d\n", s, __LINE__); exit(1); } \
  } while (0)

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <int kStages, int kAhead>
__global__ void __launch_bounds__(32) mover(const char* src, char* dst, const int* src_row, const int* dest_row, int rows,
                                            int row_bytes, int reps) {
  extern __shared__ __align__(128) char stage_mem[];
  __shared__ __align__(8) uint64_t bars[kStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  int mine = (rows - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  int total = mine * reps;
  auto row_of = [&](int j) { return (int)blockIdx.x + (j % mine) * (int)gridDim.x; };
  auto load = [&](int j) {
    int s = j % kStages;
    uint32_t bar = smem_addr(&bars[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(stage_mem + (size_t)s * row_bytes)),
                 "l"(src + (size_t)src_row[row_of(j)] * row_bytes), "r"(row_bytes), "r"(bar)
                 : "memory");
  };
  for (int j = 0; j < kAhead && j < total; ++j) load(j);
  for (int j = 0; j < total; ++j) {
    int s = j % kStages;
    uint32_t phase = (j / kStages) & 1, done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done)
                   : "r"(smem_addr(&bars[s])), "r"(phase)
                   : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                     dst + (size_t)dest_row[row_of(j)] * row_bytes),
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

using Mover = void (*)(const char*, char*, const int*, const int*, int, int, int);
struct Depth { const char* name; Mover kernel; int stages; };
const Depth kDepths[] = {{"8 stages, 4 loads ahead", mover<8, 4>, 8}, {"14 stages, 7 loads ahead", mover<14, 7>, 14}};

__global__ void fill_rows(int* rows_data, int rows, int ints_per_row, int tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)rows * ints_per_row;
       i += (size_t)gridDim.x * blockDim.x)
    rows_data[i] = (int)(i / ints_per_row) * 2 + tag;
}

struct Gpu {
  char *src, *dst;
  int *src_row, *dest_row;
  std::vector<int> src_row_host, dest_row_host;
  __nv_bfloat16 *a, *b, *c;
  cudaStream_t mover_stream, gemm_stream;
  cublasHandle_t blas;
  cudaEvent_t e0, e1, g0, g1;
};

int main(int argc, char** argv) {
  const int row_bytes = argc > 1 ? atoi(argv[1]) : 14336, rows = argc > 2 ? atoi(argv[2]) : 4096;
  const int n = 8192, gemms = 12;
  const size_t bytes = (size_t)rows * row_bytes;
  Gpu g[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    for (const Depth& depth : kDepths)
      CK(cudaFuncSetAttribute(depth.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, depth.stages * row_bytes));
    CK(cudaMalloc(&g[d].src, bytes));
    CK(cudaMalloc(&g[d].dst, bytes));
    fill_rows<<<264, 256>>>((int*)g[d].src, rows, row_bytes / 4, d);
    CK(cudaGetLastError());
    for (auto* perm : {&g[d].src_row_host, &g[d].dest_row_host}) {
      perm->resize(rows);
      std::iota(perm->begin(), perm->end(), 0);
      std::shuffle(perm->begin(), perm->end(), std::mt19937(perm == &g[d].src_row_host ? 2 * d : 2 * d + 1));
    }
    CK(cudaMalloc(&g[d].src_row, rows * sizeof(int)));
    CK(cudaMalloc(&g[d].dest_row, rows * sizeof(int)));
    CK(cudaMemcpy(g[d].src_row, g[d].src_row_host.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(g[d].dest_row, g[d].dest_row_host.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
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
  auto move = [&](const Depth& depth, bool to_peer, int d, int sms, int reps) {
    CK(cudaEventRecord(g[d].e0, g[d].mover_stream));
    depth.kernel<<<sms, 32, depth.stages * row_bytes, g[d].mover_stream>>>(
        g[d].src, to_peer ? g[1 - d].dst : g[d].dst, g[d].src_row, g[d].dest_row, rows, row_bytes, reps);
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
  for (bool to_peer : {true, false}) {
    for (const Depth& depth : kDepths) {
      // Check one pass: dst[dest_row[i]] holds src[src_row[i]] of the sender.
      for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaMemset(g[d].dst, 0xff, bytes)); }
      sync_all();
      for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); move(depth, to_peer, d, 16, 1); }
      sync_all();
      long wrong = 0;
      for (int d = 0; d < 2; ++d) {
        const int sender = to_peer ? 1 - d : d, ints = row_bytes / 4;
        std::vector<int> got(bytes / 4);
        CK(cudaSetDevice(d));
        CK(cudaMemcpy(got.data(), g[d].dst, bytes, cudaMemcpyDeviceToHost));
        for (int i = 0; i < rows; ++i)
          for (int k = 0; k < ints; ++k)
            wrong += got[(size_t)g[sender].dest_row_host[i] * ints + k] != g[sender].src_row_host[i] * 2 + sender;
      }
      printf("\n%s, %s: %ld wrong ints after one pass\n", to_peer ? "to the peer (NVLink)" : "to its own HBM",
             depth.name, wrong);
      for (int sms : {1, 2, 4, 8, 16, 24, 32, 132}) {
        float alone = 1e9;
        for (int it = 0; it < 3; ++it) {
          for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); move(depth, to_peer, d, sms, 1); }
          sync_all();
          alone = std::min(alone, std::max(ms(g[0].e0, g[0].e1), ms(g[1].e0, g[1].e1)));
        }
        printf("  %3d SMs alone: %7.1f us, %4.0f GB/s (%3.0f per SM)", sms, alone * 1e3, bytes / alone / 1e6,
               bytes / alone / 1e6 / sms);
        if (sms > 32) { printf("\n"); continue; }
        // Beside the GEMMs: as many passes as fit in about half the chain, the mover launched first.
        const int reps = std::max(1, (int)(0.5f * gemm_alone / alone));
        for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); move(depth, to_peer, d, sms, reps); gemm_chain(d); }
        sync_all();
        const float moved = ms(g[0].e0, g[0].e1), gemm = ms(g[0].g0, g[0].g1);
        printf(" | beside the GEMMs: %3d passes in %.3f ms (%4.0f GB/s), GEMMs +%.3f ms, hidden %3.0f %%\n", reps,
               moved, bytes * reps / moved / 1e6, gemm - gemm_alone, 100.0 * (1.0 - (gemm - gemm_alone) / (alone * reps)));
      }
    }
  }
  return 0;
}
