// NVSHMEM bootstrap and symmetric memory for jax_ep (ARCHITECTURE.md §2, §4): one PE per process, started
// from a unique id that the Python side passes through the jax.distributed key-value store.
#if defined(JAX_EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "api.h"

namespace jax_ep {
namespace {

std::mutex g_mutex;
bool g_initialized = false;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep nvshmem: ") + what + " failed: " + cudaGetErrorString(err));
}

void check_status(int status, const char* what) {
  if (status != 0) throw std::runtime_error(std::string("jax_ep nvshmem: ") + what + " returned " + std::to_string(status));
}

__global__ void ring_put_kernel(int* words) {
  const int me = nvshmem_my_pe(), pes = nvshmem_n_pes();
  nvshmem_int_p(words, me, (me + 1) % pes);
}

}  // namespace

std::string nvshmem_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  check_status(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void nvshmem_initialize(int device_ordinal, int rank, int num_ranks, const std::string& unique_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_initialized) throw std::runtime_error("jax_ep nvshmem: already initialised in this process");
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::invalid_argument("jax_ep nvshmem: the unique id has " + std::to_string(unique_id.size()) +
                                " bytes, expected " + std::to_string(sizeof(nvshmemx_uniqueid_t)));
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  check_cuda(cudaSetDevice(device_ordinal), "cudaSetDevice");
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  check_status(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
  check_status(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr), "nvshmemx_init_attr");
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks)
    throw std::runtime_error("jax_ep nvshmem: initialised as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                             std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) + " of " +
                             std::to_string(num_ranks));
  g_initialized = true;
}

bool nvshmem_is_initialized() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_initialized;
}

void* nvshmem_allocate(int64_t bytes) {
  void* pointer = nvshmem_malloc(static_cast<size_t>(bytes));
  if (pointer == nullptr && bytes > 0)
    throw std::runtime_error("jax_ep nvshmem: nvshmem_malloc of " + std::to_string(bytes) +
                             " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE)");
  check_cuda(cudaMemset(pointer, 0, static_cast<size_t>(bytes)), "cudaMemset (symmetric memory)");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_barrier_all();  // every PE zeroed its part before anyone writes into it
  return pointer;
}

void nvshmem_release(void* pointer) {
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_free(pointer);
}

int nvshmem_ring_check() {
  int* words = static_cast<int*>(nvshmem_allocate(sizeof(int)));
  // Every PE releases the word even when a check below throws: nvshmem_free is collective.
  struct Release {
    int* words;
    ~Release() {
      cudaDeviceSynchronize();
      nvshmem_free(words);
    }
  } release{words};
  ring_put_kernel<<<1, 1>>>(words);
  check_cuda(cudaGetLastError(), "ring_put_kernel launch");
  check_cuda(cudaDeviceSynchronize(), "ring_put_kernel");
  nvshmem_barrier_all();  // also completes every PE's puts
  int value = -1;
  check_cuda(cudaMemcpy(&value, words, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return value;
}

}  // namespace jax_ep
#endif
