#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The long run of the fault-injection suite (tests/fault/, docs/RELIABILITY.md):
#
#   scripts/fault.sh [--iterations N] [--memory-versions M] [--seed S] [--build DIR] [GTEST_FILTER]
#
# Builds fault_test and wb_test_peer in DIR (default build/) and runs the random faults N times
# per transport stack (default 200: disk, ucx over shm and tcp, delta over disk and ucx), the
# memory case with 8 subscribers x M versions (default 500) and the named user cases, printing
# the seed (replay a failure with --seed S) and one "[ figures ]" / "[ memory ]" line per stack,
# then their sums. Exits 1 on any failure. CTest runs the same binary with small defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
iterations=200
memory_versions=500
seed=0
build=build
filter='*'
while (($#)); do
  case "$1" in
    --iterations) iterations=$2; shift 2 ;;
    --memory-versions) memory_versions=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '3,11p' "$0"; exit 0 ;;
    -*) echo "fault.sh: unknown flag $1" >&2; exit 2 ;;
    *) filter=$1; shift ;;
  esac
done
[[ -f $build/CMakeCache.txt ]] || { echo "fault.sh: no build in $build (run scripts/test.sh first)" >&2; exit 2; }
cmake --build "$build" --target fault_test wb_test_peer >/dev/null
log=$(mktemp -t fault.XXXXXX.log)
status=0
start=$(date +%s)
"$build/tests/fault/fault_test" --gtest_filter="$filter" --iterations "$iterations" \
  --memory-versions "$memory_versions" --seed "$seed" 2>&1 | tee "$log" || status=$?
echo "# $(( $(date +%s) - start )) s; log: $log"
# Sums over the stacks of the "[ figures ]" lines (key=value pairs).
grep '^\[ figures \]' "$log" | awk '{
    for (i = 1; i <= NF; i++) if (split($i, kv, "=") == 2 && kv[2] ~ /^[0-9]+$/ && kv[1] != "seed") sum[kv[1]] += kv[2]
  } END {
    printf "# all stacks:"
    n = split("iterations faults kills stops restarts published versions_checked wait_errors torn hangs crashes", keys, " ")
    for (i = 1; i <= n; i++) printf " %s=%d", keys[i], sum[keys[i]]
    printf "\n"
  }'
exit $status
