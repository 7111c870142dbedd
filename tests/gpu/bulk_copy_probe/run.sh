#!/usr/bin/env bash
# Bulk-copy (TMA) probes on the device (docs/perf-log.md says what they found):
#   movers.cu        row movers on a few SMs, alone and beside cuBLAS GEMMs (two GPUs with peer access)
#   combine_sums.cu  the expert-major combine's local fan-in on S SMs, bulk copies against plain loads (one GPU)
#   OUT=dir bash tests/gpu/bulk_copy_probe/run.sh [movers|combine_sums]...   (default: both)
# Built with nvcc against the cuBLAS of the nvidia-cublas wheel that jax's CUDA plugin installs.
set -eu
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-/tmp/bulk_copy_probe}"; mkdir -p "$OUT"
CUBLAS=$(python3 -c "import nvidia, os; print(next(p for p in (os.path.join(q, 'cu13') for q in nvidia.__path__) if os.path.isdir(p)))")
build=(nvcc -O2 -std=c++17 -arch=sm_90a)
(( $# )) || set -- movers combine_sums
for name in "$@"; do
  case $name in
    movers) "${build[@]}" -I"$CUBLAS/include" movers.cu -o "$OUT/movers" -L"$CUBLAS/lib" -l:libcublas.so.13 \
              -Xlinker -rpath="$CUBLAS/lib"
            "$OUT/movers" 14336 4096; "$OUT/movers" 4096 4096 ;;
    combine_sums) "${build[@]}" combine_sums.cu -o "$OUT/combine_sums"; "$OUT/combine_sums" ;;
    *) sed -n '2,6p' "$0"; exit 2 ;;
  esac
done
