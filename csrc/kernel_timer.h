// The benchmark's "bare kernel" time of a rank's normal-mode calls, kept in the rank's device state in instrumented
// builds only (kInstrumented, kernel_limits.h): the kernel's first block stamps the call's start, its last block adds
// the time since to the sum (call_frame.cuh); the runtime reads and resets the sums (registry.h).
#pragma once
#include <cstdint>

namespace jax_ep {

struct KernelTimer {
  uint64_t call_start_ns;  // %globaltimer at block 0's start of the running call
  uint64_t calls;          // calls timed since the last reset
  uint64_t ns;             // their summed time, from block 0's start to the last block's end
};

}  // namespace jax_ep
