#!/usr/bin/env bash
# One device call: build jax_ep, run the GPU tests, the CPU/xla suite on the GPUs, the demo and (when
# present) the benchmark; logs under $OUT, a short summary table last.
#   bash tests/gpu/run.sh [quick|rest|full|final|mp|ll|accept|benches|nvshmem|internode|validate]
#     quick: build, GPU tests, demo; rest: build, xla suite on the GPUs, benchmarks, the Flax example;
#     full: all of it, then the GPU tests again on the Ampere (sm_80) code path: built for sm_80 + PTX only,
#     which the driver compiles for the Hopper GPU at load time; final: full without the xla suite (fits
#     one 10-minute call); mp: build, the intranode tests in one process, then with one process per GPU;
#     ll: the low-latency tests (NVSHMEM transport too) and benchmark; llq: the low-latency tests in one
#     process and the benchmark; llx: the low-latency tests in one process, then the LL benchmark without
#     baselines once per LL_SWEEP entry (none, or an environment setting NAME=VALUE; BENCH_LL_FLAGS e.g.
#     "--ops combine"), and with LL_PROCESSES=1 once as 4 processes (each bench up to 100-150 s: keep the sweep
#     short enough for one 10-minute call); mpq: the intranode tests as 4 processes and the benchmark as 4 processes
#     (PUSH_SWEEP="4 12": also the combine with those pushing warps per block, 24 SMs); accept: every GPU test
#     and the demo (the 32- and 48-process tests: llmax);
#     moe: the MoE block's and grouped matmul's GPU tests, then `bench moe` (MOE_SHAPES, default moe-a; MOE_EXTRA: a
#     script to run between them);
#     benches: every benchmark (both process models, internode 2 x 2), then the sm_80 path's tests;
#     nvshmem: an unstripped build, then the NVSHMEM bootstrap probes (tests/gpu/nvshmem_probe);
#     internode: the internode tests as 4 processes (2 nodes x 2 GPUs, and 4 x 1) and 2 (2 x 1), the bounded wait,
#     and the internode benchmark as 2 x 2;
#     llnodes: the low-latency suite on internode Buffers as 4 processes (2 x 2, 4 x 1) and 8 (4 x 2), and its
#     bounded wait; llmax: the low-latency ops with 32 and 64 processes (nodes of 8; 64: the rank limit) on the GPUs;
#     validate: the first run of new kernels in one 10-minute call, most informative first: intranode and
#     low-latency tests in one process, the benchmarks (combine pull and push), the 2 x 2 internode suite, the
#     one-process-per-GPU intranode suite and benchmark.
# Any number of GPUs: the multi-process suites put process p on GPU p mod n (ranks share GPUs on a machine with
# fewer GPUs than ranks; tests in one process that need more GPUs skip, saying so), and the benchmarks run with
# --processes take --allow-shared-gpu, which labels their figures when ranks do share a GPU. CUDA MPS is not
# started: the bounded waits end in a trap, and under MPS a fatal fault in one client takes down every client of
# that GPU; without MPS the GPU time-slices between the processes' contexts, which spinning kernels survive.
# MP_WORKERS (default 4): multi-process tests run at once (pytest-xdist, where installed).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast
export PYTHONUNBUFFERED=1 JAX_EP_CUDA_ARCHS="${JAX_EP_CUDA_ARCHS:-90}"
# Tests start subprocesses on the same GPUs: allocate on demand instead of grabbing 75% per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/jax_ep_out}"; mkdir -p "$OUT"
mode="${1:-full}"
declare -a summary

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record the result
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local last; last=$(grep -E "passed|failed|error|PASS|FAIL" "$OUT/$name.log" | tail -1)
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "${last:0:90}")")
  return $rc
}

nvidia-smi -L; python3 --version; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
strip=true; [ "$mode" = nvshmem ] && strip=false  # symbols for the probe's backtraces
# The benchmarks read the kernels' timers and traces and run the store probe: the instrumented build. The tests
# (and users) run the default build, which has none of them.
case "$mode" in quick|accept|mp|internode|nvshmem) instrument=OFF ;; *) instrument=ON ;; esac
step build 240 python3 -m pip install --no-build-isolation --no-deps -v --config-settings=install.strip=$strip \
  --config-settings=cmake.define.JAX_EP_INSTRUMENT=$instrument -e . || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import jax_ep._native as n; print('cuda:', n.with_cuda(), 'nvshmem:', n.with_nvshmem())" | tee -a "$OUT/build.log"
if [ "$mode" = nvshmem ]; then
  OUT="$OUT/nvshmem_probe" bash tests/gpu/nvshmem_probe/run.sh
  exit 0
fi
if [ "$mode" = accept ]; then  # every GPU test (both process models, internode 2 x 2) and the demo
  step gpu_tests 240 python3 -m pytest -q -rs tests/gpu --ignore=tests/gpu/test_multiprocess_gpu.py
  parallel=(); python3 -c "import xdist" 2>/dev/null && parallel=(-n "${MP_WORKERS:-4}")
  rm -f "$OUT/suites.txt"
  JAX_EP_TEST_SUITE_LOG="$OUT/suites.txt" step mp_suites 300 python3 -m pytest -q -rs "${parallel[@]}" \
    --basetemp="$OUT/mp_tmp" tests/gpu/test_multiprocess_gpu.py -k "not times_out and not many_ranks"  # llmax: those
  # The bounded waits one after the other: each ends in traps, which should not land beside other tests' kernels.
  step mp_timeouts 200 python3 -m pytest -q -rs --basetemp="$OUT/mp_tmp_timeouts" tests/gpu/test_multiprocess_gpu.py \
    -k times_out
  step demo 60 python3 -m jax_ep.demo
  tar czf "$OUT/mp_logs.tgz" -C "$OUT" --exclude=gather mp_tmp mp_tmp_timeouts 2>/dev/null
  rm -rf "$OUT/mp_tmp" "$OUT/mp_tmp_timeouts"
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  printf '\n== one process: skip reasons\n'; grep -hE "^SKIPPED" "$OUT/gpu_tests.log" | sed -E 's/^SKIPPED \[([0-9]+)\] /\1x /'
  printf '\n== multi-process suites (process 0)\n'; cat "$OUT/suites.txt" 2>/dev/null
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = benches ]; then  # the benchmarks in both process models, internode 2 x 2, then the sm_80 path
  step bench 120 python3 -m jax_ep.bench intranode --sms 24 64 132 --json "$OUT/bench.json" --plot "$OUT/bench.png"
  step bench_mp 90 python3 -m jax_ep.bench intranode --processes 4 --allow-shared-gpu --sms 24 64 --no-baselines --json "$OUT/bench_mp.json"
  step bench_ll 90 python3 -m jax_ep.bench low_latency ${BENCH_LL_FLAGS:-} --json "$OUT/ll.json"
  step bench_internode 90 python3 -m jax_ep.bench internode --processes 4 --allow-shared-gpu --ranks-per-node 2 --sms 24 64 --json "$OUT/internode.json"
  JAX_EP_CUDA_ARCHS=80 step build_sm80 150 python3 -m pip install --no-build-isolation --no-deps -v -e . &&
    step gpu_tests_sm80 150 python3 -m pytest -q -rs tests/gpu/test_intranode.py tests/gpu/test_layout_cuda.py
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  grep -hE "^(\[shared GPU: not a performance figure\] )?\[(intranode|low_latency|internode)\]" "$OUT"/bench*.log | grep -E "GB/s|on the GPU" | grep -vE "timing loop" | tail -60
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = llq ]; then  # low-latency kernels in one process, LL benchmark
  step ll_tests 150 python3 -m pytest -q -x -rs tests/gpu/test_low_latency.py
  step bench_ll 100 python3 -m jax_ep.bench low_latency ${BENCH_LL_FLAGS:-} --json "$OUT/ll.json"
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  grep -hE "^(\[shared GPU: not a performance figure\] )?\[" "$OUT/bench_ll.log" | tail -60
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = llx ]; then  # LL tests in one process, then the LL benchmark (no baselines) per LL_SWEEP setting
  step ll_tests 150 python3 -m pytest -q -x -rs tests/gpu/test_low_latency.py
  for setting in ${LL_SWEEP:-none}; do  # e.g. JAX_EP_LL_TRANSPORT=nvshmem
    env $([ "$setting" = none ] || echo "$setting") timeout 100 python3 -m jax_ep.bench low_latency --no-baselines ${BENCH_LL_FLAGS:-} \
      > "$OUT/bench_ll_${setting//[^A-Za-z0-9]/_}.log" 2>&1
    summary+=("bench_ll $setting rc=$?")
  done
  if [ "${LL_PROCESSES:-0}" != 0 ]; then
    timeout 150 python3 -m jax_ep.bench low_latency --processes 4 --allow-shared-gpu --no-baselines ${BENCH_LL_FLAGS:-} \
      > "$OUT/bench_ll_mp.log" 2>&1
    summary+=("bench_ll_mp rc=$?")
  fi
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  for f in "$OUT"/bench_ll*.log; do echo "== $f"; grep -hE "jax_ep cuda|on the GPU|send:|recv:" "$f" | grep -v "hidden by"; done
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = mpq ]; then  # intranode with one process per GPU: tests, benchmark
  step mp_intranode 300 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "suite and intranode and 4"
  step bench_mp 90 python3 -m jax_ep.bench intranode --processes 4 --allow-shared-gpu --sms 24 64 --no-baselines --json "$OUT/bench_mp.json"
  for warps in ${PUSH_SWEEP:-}; do
    JAX_EP_COMBINE_PUSH_WARPS=$warps step "bench_mp_push$warps" 60 python3 -m jax_ep.bench intranode --processes 4 \
      --allow-shared-gpu --sms 24 --no-baselines
  done
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  grep -hE "^(\[shared GPU: not a performance figure\] )?\[intranode\]" "$OUT"/bench_mp*.log | grep -E "GB/s|combine:" | tail -30
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = ll ]; then  # low-latency kernels in both process models, NVSHMEM bootstrap, LL benchmark
  step ll_tests 300 python3 -m pytest -q -rs tests/gpu/test_low_latency.py
  PYTHONFAULTHANDLER=1 NVSHMEM_DEBUG=INFO step mp_nvshmem 90 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "nvshmem and 2"
  step mp_ll 240 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "suite and low_latency and peer_stores and 4"
  step mp_ll_nvshmem 480 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "low_latency and nvshmem"
  step bench_ll 150 python3 -m jax_ep.bench low_latency --no-baselines --json "$OUT/ll.json"
  JAX_EP_LL_TRANSPORT=nvshmem step bench_ll_nvshmem 200 python3 -m jax_ep.bench low_latency --processes 4 --allow-shared-gpu \
    --no-baselines --json "$OUT/ll_nvshmem.json"
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  grep -hE "^(\[shared GPU: not a performance figure\] )?\[" "$OUT/bench_ll.log" "$OUT/bench_ll_nvshmem.log" | tail -40
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = llnodes ]; then  # low-latency ops on internode Buffers (4 x 1, 2 x 2, 4 x 2 processes), bounded wait
  rm -f "$OUT/suites.txt"
  JAX_EP_TEST_SUITE_LOG="$OUT/suites.txt" step ll_nodes 420 python3 -m pytest -q -rs -n 3 --basetemp="$OUT/mp_tmp" \
    tests/gpu/test_multiprocess_gpu.py -k "low_latency_internode_suite"
  step ll_nodes_timeout 120 python3 -m pytest -q -rs --basetemp="$OUT/mp_tmp_timeouts" \
    tests/gpu/test_multiprocess_gpu.py -k "third_send and internode"
  tar czf "$OUT/mp_logs.tgz" -C "$OUT" --exclude=gather mp_tmp mp_tmp_timeouts 2>/dev/null
  rm -rf "$OUT/mp_tmp" "$OUT/mp_tmp_timeouts"
  grep -hE "^(FAILED|ERROR)|AssertionError|Error:" "$OUT"/ll_nodes*.log | head -20
  printf '\n== multi-process suites (process 0)\n'; cat "$OUT/suites.txt" 2>/dev/null
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = llmax ]; then  # low-latency ops at the rank limit: 64 processes on the GPUs as 8 nodes x 8
  step ll_max 560 python3 -m pytest -q -rs --basetemp="$OUT/mp_tmp" tests/gpu/test_multiprocess_gpu.py -k "many_ranks"
  tar czf "$OUT/mp_logs.tgz" -C "$OUT" --exclude=gather mp_tmp 2>/dev/null; rm -rf "$OUT/mp_tmp"
  grep -hE "^(FAILED|ERROR)|AssertionError|Error:" "$OUT"/ll_max.log | head -20
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = validate ]; then
  step intranode 150 python3 -m pytest -q -rs -x tests/gpu/test_intranode.py
  step low_latency 90 python3 -m pytest -q -rs -x tests/gpu/test_low_latency.py
  step bench_pull 60 python3 -m jax_ep.bench intranode --sms 24 64 --no-baselines --json "$OUT/bench_pull.json"
  JAX_EP_COMBINE=push step bench_push 60 python3 -m jax_ep.bench intranode --sms 24 64 --no-baselines --json "$OUT/bench_push.json"
  step bench_ll 60 python3 -m jax_ep.bench low_latency --no-baselines --json "$OUT/ll.json"
  step internode 120 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "internode_suite and 4"
  step mp_intranode 150 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "suite and intranode and 4"
  step bench_mp 60 python3 -m jax_ep.bench intranode --processes 4 --allow-shared-gpu --sms 24 --no-baselines --json "$OUT/bench_mp.json"
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  grep -hE "^(\[shared GPU: not a performance figure\] )?\[(intranode|low_latency)\]" "$OUT"/bench*.log | grep -E "combine|dispatch|ceiling|on the GPU|send:|recv:" | tail -40
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = moe ]; then  # the MoE block: its GPU tests, the grouped matmul's, the block's benchmark
  step moe_tests 200 python3 -m pytest -q -rs tests/gpu/test_flax_moe_gpu.py tests/gpu/test_grouped_matmul_gpu.py
  [ -n "${MOE_EXTRA:-}" ] && step moe_extra 200 python3 $MOE_EXTRA
  step moe_block 300 python3 -m jax_ep.bench moe --shapes ${MOE_SHAPES:-moe-a} --json "$OUT/moe.json" --plot "$OUT/moe.png"
  grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  [ -f "$OUT/moe_extra.log" ] && tail -20 "$OUT/moe_extra.log"
  grep -h "^\[moe\]" "$OUT/moe_block.log" | tail -12
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = internode ]; then
  step internode4 450 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "internode_suite and 4"
  step internode_timeout 300 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "internode and never_joins"
  step internode2 450 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k "internode_suite and 2"
  step bench_internode 400 python3 -m jax_ep.bench internode --processes 4 --allow-shared-gpu --ranks-per-node 2 --sms 24 64 --json "$OUT/internode.json"
  grep -hE "^(FAILED|ERROR)|AssertionError|timed out" "$OUT"/internode*.log | head -20
  grep -hE "^(\[shared GPU: not a performance figure\] )?\[internode\]" "$OUT/bench_internode.log" | tail -20
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" = mp ]; then
  step intranode 200 python3 -m pytest -q -rs -x tests/gpu/test_intranode.py
  step mp_timeout 150 python3 -m pytest -q -rs tests/gpu/test_multiprocess_gpu.py -k times_out
  step mp_suite 430 python3 -m pytest -q -rs -x tests/gpu/test_multiprocess_gpu.py -k "suite and intranode and 4"
  grep -hE "^(FAILED|ERROR)|Error|error" "$OUT"/mp_*.log | head -20
  printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
  exit 0
fi
if [ "$mode" != rest ]; then
  step gpu_tests 540 python3 -m pytest -q -rs tests/gpu
  step demo 90 python3 -m jax_ep.demo
fi
if [ "$mode" = rest ] || [ "$mode" = full ]; then
  step xla_on_gpus 240 python3 -m pytest -q -rs -x tests --ignore=tests/gpu
fi
if [ "$mode" != quick ]; then
  step bench 240 python3 -m jax_ep.bench intranode --sms ${BENCH_SMS:-24 64 132} --json "$OUT/bench.json" --plot "$OUT/bench.png"
  step moe_block 300 python3 -m jax_ep.bench moe --json "$OUT/moe.json" --plot "$OUT/moe.png"
  if [ -d jax_ep/examples ]; then
    step train_moe 240 python3 -m jax_ep.examples.train_moe --steps 100 --dispatchers normal,xla --plot "$OUT/loss.png"
  fi
fi
if [ "$mode" = full ] || [ "$mode" = final ]; then
  JAX_EP_CUDA_ARCHS=80 step build_sm80 240 python3 -m pip install --no-build-isolation --no-deps -v -e . &&
    step gpu_tests_sm80 270 python3 -m pytest -q -rs tests/gpu/test_intranode.py tests/gpu/test_layout_cuda.py
fi
grep -hE "^(FAILED|ERROR)" "$OUT"/*.log | head -20
[ -f "$OUT/bench.log" ] && tail -25 "$OUT/bench.log"
[ -f "$OUT/demo.log" ] && tail -8 "$OUT/demo.log"
[ -f "$OUT/train_moe.log" ] && tail -6 "$OUT/train_moe.log"
[ -f "$OUT/moe_block.log" ] && grep -h "^\[moe\]" "$OUT/moe_block.log" | tail -12
printf '\n== summary\n'; printf '%s\n' "${summary[@]}"
