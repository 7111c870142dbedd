#!/usr/bin/env bash
# One device call: build jax_ep, then every GPU test (accept) or the benchmarks (bench); each step's log under
# $OUT, then the FAILED lines and a summary table.
#   bash tests/gpu/run.sh accept [STEP...]           STEPs (default all, in this order): kernels (the one-process
#       communication tests), grouped_matmul and flax_moe (slow Pallas compiles), processes (the multi-process
#       suites, in parallel), bounded_waits (one after another), many_ranks (32 to 64 processes), demo
#   bash tests/gpu/run.sh bench [MODE...] [-- ARGS]  MODEs (default all): intranode low_latency internode moe
#       grouped_matmul, each in one process and with --processes $PROCESSES (default 4) where the mode takes it
#       (internode: that only, --ranks-per-node PROCESSES/2); ARGS go to every `python3 -m jax_ep.bench MODE`.
# A step starts only if its time limit fits what is left of BUDGET_S (default 560 s: a 10-minute call, with room to
# start and to copy the logs back); the summary names the steps left over, to run by name in the next call.
# Any number of GPUs: the multi-process suites put process p on GPU p mod n (ranks share GPUs where there are
# fewer GPUs than ranks; tests in one process that need more GPUs skip, saying so), and the benchmarks' --processes
# runs take --allow-shared-gpu, which labels their figures when ranks do share a GPU. CUDA MPS is not started: the
# bounded waits end in a trap, and under MPS a fatal fault in one client takes down every client of that GPU;
# without MPS the GPU time-slices between the processes' contexts, which spinning kernels survive.
# MP_WORKERS (default 4): multi-process tests run at once (pytest-xdist, where installed).
# By hand: the Ampere path (sm_80 + PTX only, which the driver compiles for a Hopper GPU at load time):
#   JAX_EP_CUDA_ARCHS=80 bash tests/gpu/run.sh accept kernels
# with an extension built elsewhere (its _C*.so in DIR, built for the same Python, jax and NVSHMEM wheel; for
# bench, built with -DJAX_EP_INSTRUMENT=ON):
#   JAX_EP_PREBUILT=DIR bash tests/gpu/run.sh accept
# the NVSHMEM bootstrap probes (an unstripped build, for their backtraces):
#   python3 -m pip install --no-build-isolation --no-deps --config-settings=install.strip=false -e . &&
#   OUT=$OUT/nvshmem_probe bash tests/gpu/nvshmem_probe/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast
# Tests start subprocesses on the same GPUs: allocate on demand instead of grabbing 75% per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_EP_CUDA_ARCHS="${JAX_EP_CUDA_ARCHS:-90}"
OUT="${OUT:-/tmp/jax_ep_out}"; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-560}
mode=${1:-}; shift $(( $# > 0 ))
summary=(); left=(); status=0

step() {  # step NAME LIMIT_S COMMAND...: run it (if LIMIT_S fits the budget) into $OUT/NAME.log, note the result
  local name=$1 limit=$2; shift 2
  if (( SECONDS + limit > BUDGET_S )); then left+=("$name"); status=1; return 1; fi
  local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  (( rc == 0 )) || status=1
  local last; last=$(grep -E "passed|failed|error|GB/s| us|PASS|FAIL" "$OUT/$name.log" | tail -1)
  summary+=("$(printf '%-26s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "${last:0:90}")")
  return $rc
}

# The benchmarks read the kernels' timers and traces and run the store probe: the instrumented build. The tests
# (and users) run the default build, which has none of them.
case "$mode" in accept) build=() ;; bench) build=(--config-settings=cmake.define.JAX_EP_INSTRUMENT=ON) ;;
  *) sed -n '2,22p' "$0"; exit 2 ;; esac
nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if [ -n "${JAX_EP_PREBUILT:-}" ]; then
  # An extension built on another machine against this one's Python, jax and NVSHMEM wheel (the build takes
  # minutes of device time): put it in the package and run from the checkout.
  cp "$JAX_EP_PREBUILT"/_C*.so jax_ep/ || exit 1
  nvshmem_lib=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])" 2>/dev/null)/lib
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="$nvshmem_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  step build 240 python3 -m pip install --no-build-isolation --no-deps -v "${build[@]}" -e . ||
    { tail -40 "$OUT/build.log"; exit 1; }
fi
python3 -c "import jax_ep._native as n; print('cuda:', n.with_cuda(), 'nvshmem:', n.with_nvshmem())"

if [ "$mode" = accept ]; then
  steps=" ${*:-kernels grouped_matmul flax_moe processes bounded_waits many_ranks demo} "
  want() { [[ "$steps" == *" $1 "* ]]; }
  xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n "${MP_WORKERS:-4}")
  # -v: a step that its time limit cuts still says which tests passed (pytest prints its summary last).
  tests=(python3 -m pytest -v -rsfE tests/gpu)
  rm -rf "$OUT/suites.txt" "$OUT/mp_tmp"; mkdir "$OUT/mp_tmp"; export JAX_EP_TEST_SUITE_LOG="$OUT/suites.txt"
  one_process="not processes and not bounded_wait"
  # 2026-11-28 on four H200s this step took 145-151 s (the four-GPU cases run there).
  want kernels && step kernels 240 "${tests[@]}" -m "$one_process" -k "not grouped_matmul and not flax_moe"
  # Slow Pallas compiles (each tile configuration of the table compiles its own kernels): 2026-11-29 on H200s the
  # grouped matmul file took 280-340 s and the Flax MoE file 140-210 s, together past one step's 420 s; 2026-11-30
  # the grouped matmul file's 61 tests took ~400 s (one H200 of two). --durations says which tests to trim.
  want grouped_matmul && step grouped_matmul 430 "${tests[@]}" --durations=8 -m "$one_process" -k grouped_matmul
  want flax_moe && step flax_moe 240 "${tests[@]}" --durations=8 -m "$one_process" -k flax_moe
  want processes && step processes 300 "${tests[@]}" "${xdist[@]}" --basetemp="$OUT/mp_tmp/processes" \
    -m "processes and not bounded_wait and not many_ranks"
  # One after another: each ends in traps, which should not land beside other tests' kernels, or (masked ranks)
  # times its steps against the bound.
  want bounded_waits && step bounded_waits 450 "${tests[@]}" --basetemp="$OUT/mp_tmp/bounded_waits" -m bounded_wait
  want many_ranks && step many_ranks 300 "${tests[@]}" --basetemp="$OUT/mp_tmp/many_ranks" -m many_ranks
  want demo && step demo 60 python3 -m jax_ep.demo
  tar czf "$OUT/mp_logs.tgz" -C "$OUT" --exclude=gather mp_tmp && rm -rf "$OUT/mp_tmp"
  printf '\n== skipped in one process\n'; cat "$OUT"/kernels.log "$OUT"/grouped_matmul.log "$OUT"/flax_moe.log 2>/dev/null |
    grep -hE "^SKIPPED" | sed -E 's/^SKIPPED \[([0-9]+)\] /\1x /'
  [ -s "$OUT/suites.txt" ] && { printf '\n== multi-process suites (process 0)\n'; cat "$OUT/suites.txt"; }
else
  modes=(); extra=()
  while (( $# )); do [ "$1" = -- ] && { shift; extra=("$@"); break; }; modes+=("$1"); shift; done
  (( ${#modes[@]} )) || modes=(intranode low_latency internode moe grouped_matmul)
  P=${PROCESSES:-4}
  for m in "${modes[@]}"; do
    bench=(python3 -m jax_ep.bench "$m")
    processes=(--processes "$P" --allow-shared-gpu --json "$OUT/bench_${m}_processes.json")
    case $m in
      internode) step "bench_$m" 200 "${bench[@]}" "${processes[@]}" --ranks-per-node $((P / 2)) "${extra[@]}" ;;
      grouped_matmul) step "bench_$m" 200 "${bench[@]}" --json "$OUT/bench_$m.json" "${extra[@]}" ;;
      *) step "bench_$m" 200 "${bench[@]}" --json "$OUT/bench_$m.json" "${extra[@]}"
         step "bench_${m}_processes" 200 "${bench[@]}" "${processes[@]}" "${extra[@]}" ;;
    esac
  done
  for log in "$OUT"/bench_*.log; do
    printf '\n== %s\n' "$(basename "$log" .log)"; grep -E "GB/s| us| ms" "$log" | grep -v "timing loop" | tail -12
  done
fi
printf '\n== failed\n'; grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
[ "$mode" = bench ] && left=($(printf '%s\n' "${left[@]}" | sed -E 's/^bench_//; s/_processes$//' | sort -u))
(( ${#left[@]} )) && echo "not run, no time left in BUDGET_S=$BUDGET_S s: bash tests/gpu/run.sh $mode ${left[*]}"
exit $status
