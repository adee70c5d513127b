#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every GPU test, on a machine with an NVIDIA GPU: configures and builds weightbus with CUDA
# (build-gpu/, kernels for this GPU's architecture), runs every CTest test labelled `gpu` (each
# skips cleanly where no GPU is visible) and the GPU benchmarks, and prints a summary table last.
# Budget: 8 minutes in all (each step gets what is left).
#
# On one GPU it covers: device checksums against the host's (device_gpu_test
# DeviceChecksumGpuTest), the packing kernels (DevicePackingGpuTest), CUDA tensors through the
# core over mem:// with and without device memory, disk:// and ucx:// into CUDA destinations
# (DeviceMemoryGpuTest), and Python CUDA tensors published from and bound to CUDA parameters,
# including ones that require grad (python_cuda); for nccl:// (nccl_gpu_test) a one-rank NCCL
# communicator through the bucket pipeline with host and device tensors, and a replica on the
# publisher's GPU refused, then weightbus-nccl-bench (packing and a one-rank loop). NCCL refuses
# two ranks on one GPU: multi-rank broadcasts (versions through nccl:// to replicas on other GPUs,
# a late joiner, a replica killed mid-broadcast, the bench's comparison with ncclBroadcast) are
# verified only where two or more GPUs exist, and skip saying so otherwise.
#
# Usage: tests/gpu/run.sh   (environment: GPU_BUILD_DIR (build-gpu), CUDA_ARCHS (native),
#                            GPU_CMAKE_ARGS, GPU_JOBS (nproc), GPU_BUDGET_S (480))
# Exit status: 0 when every step passed (skips are listed, and fail the run when a GPU is there).
set -uo pipefail
cd "$(dirname "$0")/../.."

build=${GPU_BUILD_DIR:-build-gpu}
budget=${GPU_BUDGET_S:-480}
jobs=${GPU_JOBS:-$(nproc)}
start=$(date +%s)
mkdir -p "$build"
log=$build/gpu-run.log
: >"$log"

rows=()    # "step|result|seconds|note"
failed=0
left() { echo $((budget - ($(date +%s) - start))); }
row() { rows+=("$1|$2|$3|$4"); [[ $2 == ok || $2 == skipped* || $2 == passed ]] || failed=1; }

# step NAME COMMAND...: runs COMMAND within what is left of the budget, logging to $log.
step() {
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  if (($(left) <= 5)); then
    row "$name" "not run" 0 "out of time (budget ${budget} s)"
    return 1
  fi
  echo "=== $name: $*" >>"$log"
  timeout "$(left)" "$@" >>"$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0))
  if ((rc == 0)); then
    row "$name" ok "$dt" ""
  elif ((rc == 124)); then
    row "$name" "timed out" "$dt" "budget ${budget} s spent (see $log)"
  else
    row "$name" "failed ($rc)" "$dt" "see $log"
  fi
  return $rc
}

# -- The GPU --
gpu=""
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
  gpus=$(nvidia-smi -L | wc -l)
  row "gpu" ok 0 "$gpus x $gpu"
else
  gpus=0
  row "gpu" "skipped" 0 "no NVIDIA GPU (nvidia-smi): every gpu test skips"
fi

# -- Configure and build --
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache
                                         -DCMAKE_C_COMPILER_LAUNCHER=ccache
                                         -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cuda_archs=${CUDA_ARCHS:-native}
((gpus == 0)) && cuda_archs=${CUDA_ARCHS:-90}  # "native" needs a GPU to ask
# The build needs the packages scripts/setup.sh installs (Abseil, xxHash, libsodium, liburing,
# UCX, GoogleTest, ... from Debian); a machine without them fails here (see the log).
# shellcheck disable=SC2086
step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DWEIGHTBUS_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$cuda_archs" -DWEIGHTBUS_BUILD_BENCH=ON \
  "${launcher[@]}" ${GPU_CMAKE_ARGS:-}
# What the gpu-labelled tests need: their executables, the library and CLI for Python.
targets=(weightbus weightbus_cli device_gpu_test)
# nccl:// (issue 15): its GPU tests and its benchmark, where the build has the transport.
nccl=0
grep -q 'transports = .*nccl' "$log" && nccl=1
((nccl)) && targets+=(nccl_gpu_test weightbus_nccl_bench)
targets+=(${GPU_TARGETS:-})
[[ -f $build/build.ninja ]] && step build cmake --build "$build" -j "$jobs" --target "${targets[@]}"

# -- Every test labelled gpu --
if [[ -f $build/CTestTestfile.cmake ]] && (($(left) > 5)); then
  t0=$(date +%s)
  timeout "$(left)" ctest --test-dir "$build" -L '^gpu$' --output-on-failure --timeout 300 \
    >"$build/gpu-ctest.log" 2>&1
  rc=$?
  cat "$build/gpu-ctest.log" >>"$log"
  # "  3/12 Test  #7: device_gpu_test.X ....   Passed    1.20 sec" (or ***Skipped / ***Failed)
  while IFS='|' read -r name result secs; do
    case $result in
      Passed) row "$name" passed "$secs" "" ;;
      Skipped)
        if ((gpus > 0)); then row "$name" "SKIPPED" "$secs" "skipped on a GPU machine: see log"
        else row "$name" "skipped (no GPU)" "$secs" ""; fi ;;
      *) row "$name" "$result" "$secs" "see $build/gpu-ctest.log" ;;
    esac
  done < <(sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*[ *]*([A-Za-z]+[A-Za-z ():0-9-]*[A-Za-z)]) +([0-9.]+) sec.*/\1|\2|\3/p' \
             "$build/gpu-ctest.log")
  if ((rc == 124)); then row "ctest -L gpu" "timed out" $(($(date +%s) - t0)) "budget spent"; fi
  grep -q "No tests were found" "$build/gpu-ctest.log" && row "ctest -L gpu" "failed" 0 "no gpu tests"
fi

# -- Benchmarks on the GPU --
# nccl:// against a plain ncclBroadcast loop of the same bytes on the same GPUs (bucket size
# sweep, packing overhead): weightbus-nccl-bench, its table printed before the summary.
bench_table=()
if ((nccl)) && [[ -x $build/bench/weightbus-nccl-bench ]]; then
  if ((gpus > 0)); then
    step "bench nccl (weightbus-nccl-bench)" "$build/bench/weightbus-nccl-bench" \
      --json "$build/bench-nccl.json"
    mapfile -t bench_table < <(sed -n '/=== bench nccl/,$p' "$log" | grep -E '^(#|  )' |
                               grep -vE '^#   bucket .* done$')
  else
    row "bench nccl (weightbus-nccl-bench)" "skipped (no GPU)" 0 ""
  fi
else
  row "bench nccl" "skipped" 0 "no nccl:// transport in this build (WEIGHTBUS_WITH_NCCL)"
fi

# -- Summary (last) --
total=$(($(date +%s) - start))
if ((${#bench_table[@]})); then
  echo
  printf '%s\n' "${bench_table[@]}"
fi
echo
echo "# weightbus GPU run: $(date -u +%Y-%m-%dT%H:%M:%SZ), ${gpu:-no GPU}, ${total} s of ${budget} s"
echo "# log: $log"
printf '# %-64s %-18s %8s  %s\n' step result seconds note
for r in "${rows[@]}"; do
  IFS='|' read -r name result secs note <<<"$r"
  printf '  %-64s %-18s %8s  %s\n' "$name" "$result" "$secs" "$note"
done
if ((failed)); then
  echo "FAILED"
  exit 1
fi
echo "OK"
