#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the libFuzzer targets (tests/fuzz/, docs/TESTING.md "Fuzzing"):
#
#   scripts/fuzz.sh [--seconds N] [--build DIR] [TARGET...]
#
# Builds, with Clang in build-fuzz/ (WEIGHTBUS_FUZZ=ON), only the fuzzers and the library sources
# they parse with (-fsanitize=fuzzer,address,undefined), writes the seed corpora with the normal
# build's fuzz_seeds (--build, default build/, which scripts/test.sh makes), and runs each TARGET
# (default: every one) for N seconds (default 30) from build-fuzz/corpus/<target> (kept between
# runs), the seeds and tests/fuzz/regressions/<target>. Prints one line per target: executions,
# seconds, corpus size, and findings. A crash, leak, timeout, out-of-memory or sanitizer report
# leaves its input in build-fuzz/artifacts/<target>/ and makes the script exit 1; reproduce it
# with build-fuzz/tests/fuzz/<target> FILE, fix the code, and add the file to
# tests/fuzz/regressions/<target>/ (the replay in CTest then runs it forever after).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=30
build=build
targets=()
while (($#)); do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '3,16p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown flag $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (Debian package clang)" >&2; exit 2; }
[[ -f $build/CMakeCache.txt ]] || { echo "fuzz.sh: no build in $build (run scripts/test.sh first)" >&2; exit 2; }

fixtures=$(sed -n 's/^WEIGHTBUS_FIXTURES_DIR:PATH=//p' "$build/CMakeCache.txt")
seeds=$build/tests/fuzz/seeds
cmake --build "$build" --target fuzz_seeds delta_fuzz_replay >/dev/null
"$build/tests/fuzz/fuzz_seeds" "$seeds" "$fixtures/stories260K.bin" >/dev/null
"$build/tests/fuzz/delta_fuzz_replay" --mutations=0 --write-seeds="$seeds/delta_fuzz" >/dev/null

if [[ ! -f build-fuzz/CMakeCache.txt ]]; then
  mkdir -p build-fuzz
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DWEIGHTBUS_FUZZ=ON \
    -DWEIGHTBUS_BUILD_BENCH=OFF -DWEIGHTBUS_FIXTURES_DIR="$fixtures" >build-fuzz/configure.log 2>&1 ||
    { cat build-fuzz/configure.log >&2; exit 1; }
fi
cmake --build build-fuzz --target fuzzers
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(find build-fuzz/tests/fuzz -maxdepth 1 -type f -name '*_fuzz' -perm -u+x \
                           -printf '%f\n' | sort)
fi

failed=0
printf '# %-20s %12s %8s %8s %s\n' target executions seconds corpus findings
for t in "${targets[@]}"; do
  bin=build-fuzz/tests/fuzz/$t
  [[ -x $bin ]] || { echo "fuzz.sh: no fuzzer $t in build-fuzz" >&2; exit 2; }
  corpus=build-fuzz/corpus/$t
  artifacts=build-fuzz/artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  dirs=("$corpus")
  [[ -d $seeds/$t ]] && dirs+=("$seeds/$t")
  [[ -d tests/fuzz/regressions/$t ]] && dirs+=("tests/fuzz/regressions/$t")
  [[ $t == safetensors_fuzz ]] && dirs+=("$fixtures/safetensors-samples")
  log=build-fuzz/$t.log
  rc=0
  "$bin" -max_total_time="$seconds" -max_len=1048576 -rss_limit_mb=4096 -timeout=25 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" "${dirs[@]}" >"$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  took=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  findings=none
  if ((rc != 0)); then
    findings="FAILED (exit $rc; see $log and $artifacts/)"
    failed=1
  fi
  printf '  %-20s %12s %8s %8s %s\n' "$t" "${runs:-?}" "${took:-?}" \
    "$(find "$corpus" -type f | wc -l)" "$findings"
done
exit $failed
