#!/usr/bin/env bash
# Diagnostic for the NVSHMEM bootstrap: a standalone C++ probe, then jax_ep._C without and with JAX.
#   OUT=dir bash tests/gpu/nvshmem_probe/run.sh      (jax_ep already installed in this python3)
set -u
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/nvshmem_probe}"; mkdir -p "$OUT"
N=$(python3 -c "import nvidia.nvshmem as m; print(m.__path__[0])")
CU=$(dirname "$(dirname "$(command -v nvcc)")")
nvcc -std=c++17 -arch=sm_90 -rdc=true -I"$N/include" -I"$CU/include/cccl" probe.cu -o "$OUT/probe" \
  "$N/lib/libnvshmem_device.a" -Xlinker "$N/lib/libnvshmem_host.so.3" -Xlinker -rpath="$N/lib" || exit 1
run_group() {  # run_group NAME NUM_RANKS COMMAND...: start NUM_RANKS ranks, wait (bounded), print their output
  local name=$1 n=$2; shift 2
  local uid; uid=$(mktemp -u "/tmp/uid_${name}_XXXX")
  local pids=()
  for ((r = 0; r < n; r++)); do
    timeout 60 "$@" "$r" "$n" "$uid" > "$OUT/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < n; r++)); do wait "${pids[$r]}"; echo "$name rank $r rc=$?"; done
  grep -h -E "RING|rror|egmentation|abort" "$OUT/$name".*.log | head -8
}
run_group c_1 1 "$OUT/probe"
run_group c_2 2 "$OUT/probe"
run_group py_bare_1 1 python3 probe.py bare
run_group py_bare_2 2 python3 probe.py bare
run_group py_jax_1 1 python3 probe.py jax
run_group py_jax_2 2 python3 probe.py jax
# Where a Python run crashed: host backtrace of rank 0 alone (one PE needs no peer).
for mode in bare jax; do
  if ! grep -q "PY RING" "$OUT/py_${mode}_1.0.log"; then
    NVSHMEM_DEBUG=INFO timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" \
      --args python3 probe.py "$mode" 0 1 "$(mktemp -u /tmp/uid_gdb_XXXX)" > "$OUT/gdb_$mode.log" 2>&1
    grep -E "^#|SIG|NVSHMEM.*(WARN|ERROR)" "$OUT/gdb_$mode.log" | head -40
  fi
done
