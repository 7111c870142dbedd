#!/usr/bin/env bash
# Bulk-copy (TMA) row movers on a few SMs, alone and beside cuBLAS GEMMs: two GPUs with peer access.
#   OUT=dir bash tests/gpu/overlap_probe/run.sh [ROW_BYTES ROWS]...   (default: 14336 4096 and 4096 4096)
# Builds with nvcc against the cuBLAS of the nvidia-cublas wheel that jax's CUDA plugin installs.
set -eu
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-/tmp/overlap_probe}"; mkdir -p "$OUT"
CUBLAS=$(python3 -c "import nvidia, os; print(next(p for p in (os.path.join(q, 'cu13') for q in nvidia.__path__) if os.path.isdir(p)))")
nvcc -O2 -std=c++17 -arch=sm_90a -I"$CUBLAS/include" probe.cu -o "$OUT/probe" -L"$CUBLAS/lib" -l:libcublas.so.13 \
  -Xlinker -rpath="$CUBLAS/lib"
(( $# )) || set -- 14336 4096 4096 4096
while (( $# >= 2 )); do "$OUT/probe" "$1" "$2"; shift 2; done
