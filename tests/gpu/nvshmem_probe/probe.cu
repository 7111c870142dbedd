// Diagnostic, outside JAX: NVSHMEM bootstrapped from a unique id passed through a file, one PE per process,
// then a ring put. Tells a broken NVSHMEM install apart from an interaction with the JAX process.
//   probe RANK NUM_RANKS UID_FILE     (rank 0 writes the id; the others poll for the file)
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t e = (call);                                                                   \
    if (e != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e));                  \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__global__ void ring_put(int* word) {
  const int me = nvshmem_my_pe(), pes = nvshmem_n_pes();
  nvshmem_int_p(word, me, (me + 1) % pes);
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const int rank = std::atoi(argv[1]), num_ranks = std::atoi(argv[2]);
  const std::string path = argv[3];
  CHECK_CUDA(cudaSetDevice(rank));
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (rank == 0) {
    if (nvshmemx_get_uniqueid(&id) != 0) return 3;
    std::ofstream(path + ".tmp", std::ios::binary).write(reinterpret_cast<char*>(&id), sizeof(id));
    std::rename((path + ".tmp").c_str(), path.c_str());
  } else {
    for (int i = 0; i < 600; ++i) {
      std::ifstream f(path, std::ios::binary);
      if (f && f.read(reinterpret_cast<char*>(&id), sizeof(id))) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) != 0) return 4;
  std::printf("rank %d: init\n", rank);
  std::fflush(stdout);
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) return 5;
  int* word = static_cast<int*>(nvshmem_malloc(sizeof(int)));
  ring_put<<<1, 1>>>(word);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  int value = -1;
  CHECK_CUDA(cudaMemcpy(&value, word, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("PROBE RING %d %d (expect %d)\n", rank, value, (rank + num_ranks - 1) % num_ranks);
  nvshmem_free(word);
  nvshmem_finalize();
  return value == (rank + num_ranks - 1) % num_ranks ? 0 : 6;
}
