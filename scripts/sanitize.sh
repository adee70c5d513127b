#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Sanitizer builds and runs (docs/TESTING.md, "Sanitizers"; .ci/run step 3 runs --tsan, step 4
# --asan):
#
#   scripts/sanitize.sh --asan [--build DIR] [CTEST_ARGS...]
#   scripts/sanitize.sh --tsan [--build DIR] [CTEST_ARGS...]
#
# --asan: AddressSanitizer + UndefinedBehaviorSanitizer (WEIGHTBUS_SANITIZE=address,undefined) in
#   build-asan/: builds the suites ASAN_SUITES names (below: the parsers, the codec, the core,
#   disk://, ucx:// and the C API) and runs them. --asan-all: builds everything and runs the
#   whole CTest suite except what cannot run under it (ASAN_EXCLUDE below: the Python suites,
#   which load the library into an uninstrumented interpreter, and the tests that configure,
#   install or format instead of running our code); hours on two cores, so not CI's.
# --tsan: ThreadSanitizer (WEIGHTBUS_SANITIZE=thread) in build-tsan/, against Abseil built from
#   the source of the installed Debian package with -fsanitize=thread (apt-get source, with this
#   system's apt sources turned into deb-src ones in a private apt directory: nothing of the
#   system's apt configuration changes); builds the concurrent suites (TSAN_SUITES) and runs them.
# The environment variable ASAN_SUITES or TSAN_SUITES (space-separated CTest labels, i.e. test
# executables) replaces the script's selection, e.g. to iterate on one suite.
#
# Any sanitizer report fails its test (UBSan and TSan halt_on_error=1, ASan's default), so the
# script exits non-zero on a finding; the report is in the test's output (build-*/Testing/
# Temporary/LastTest.log). CTEST_ARGS go to ctest after the script's selection (e.g. -R Disk).
# SANITIZE_CMAKE_ARGS: extra configure arguments (e.g. -DCMAKE_CXX_COMPILER_LAUNCHER=ccache).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=
all=
build=
while (($#)); do
  case "$1" in
    --asan|--tsan) mode=${1#--}; shift ;;
    --asan-all) mode=asan; all=1; shift ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '3,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) break ;;
  esac
done
[[ -n $mode ]] || { echo "sanitize.sh: say --asan or --tsan (--help)" >&2; exit 2; }
build=${build:-build-$mode}
fixtures=${WEIGHTBUS_FIXTURES_DIR:-$PWD/../shared/fixtures}
[[ -f build/CMakeCache.txt ]] &&
  fixtures=$(sed -n 's/^WEIGHTBUS_FIXTURES_DIR:PATH=//p' build/CMakeCache.txt)

# Not run under ASan: the Python suites (an uninstrumented python3 loading an ASan library needs
# the runtime preloaded, and torch's own allocations then drown the reports) and the checks that
# configure, install, package or format rather than run the library's code.
ASAN_EXCLUDE='^(python_.*|pip_install|install_consumer|build_options|format_check'
ASAN_EXCLUDE+='|api_parity|ctypes_layout|api_parity_selftest)$'
# Under ASan (CI step 4): the suites of the parsers (safetensors, llama2c, URIs, settings), the
# delta codec, the core (types, checksums, logging, fail points, buffers, registry, packing,
# resharding, streamed publishes, strided views, the conformance suite over every transport),
# disk:// (io_uring, the transport, its processes and groups, shared secrets), ucx:// (the
# transport, its control plane, its processes) and the C API; by CTest label. Left to
# --asan-all: the delta layer's and delta-over-transport suites (under TSan in step 3), the
# tensor-parallel subscribe, process and CLI suites, and the fault-injection harness (its kill
# rounds are many processes, each an ASan start-up); the parsers also run under ASan in step 2's
# fuzzers.
ASAN_SUITES_DEFAULT=(safetensors_test llama2c_test uri_test settings_test delta_codec_test
                     types_test checksum_test logging_test failpoint_test buffer_pool_test worker_pool_test
                     registry_test tensor_pack_test reshard_test update_stream_test
                     strided_memory_test conformance_test file_io_test disk_transport_test
                     disk_internal_test disk_process_test disk_group_test secret_test
                     ucx_transport_test ucx_control_plane_test ucx_process_test capi_test)
# Under TSan: the suites with threads of their own or of the library (worker pool, publisher and
# subscriber threads, the ucx progress and control threads, the delta layer's, fail points and
# rate-limited logging across threads), by their CTest label (the executable's name).
TSAN_SUITES_DEFAULT=(conformance_test disk_transport_test disk_internal_test ucx_transport_test
                     ucx_control_plane_test delta_codec_test delta_layer_test
                     delta_transport_test buffer_pool_test worker_pool_test failpoint_test logging_test)
if [[ -n ${ASAN_SUITES:-} ]]; then read -r -a ASAN_SUITES <<<"$ASAN_SUITES"
else ASAN_SUITES=("${ASAN_SUITES_DEFAULT[@]}"); fi
if [[ -n ${TSAN_SUITES:-} ]]; then read -r -a TSAN_SUITES <<<"$TSAN_SUITES"
else TSAN_SUITES=("${TSAN_SUITES_DEFAULT[@]}"); fi

sources_as_deb_src() {  # this system's apt sources, each also as deb-src, into directory $1
  local out=$1 f
  mkdir -p "$out"
  : >"$out/sources.list"
  if [[ -f /etc/apt/sources.list ]]; then
    sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p' /etc/apt/sources.list >>"$out/sources.list"
  fi
  for f in /etc/apt/sources.list.d/*.sources; do
    if [[ -f $f ]]; then sed 's/^Types:.*/Types: deb-src/' "$f" >"$out/$(basename "$f")"; fi
  done
  for f in /etc/apt/sources.list.d/*.list; do
    if [[ -f $f ]]; then
      sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p' "$f" >"$out/$(basename "$f")"
    fi
  done
}

abseil_source() {  # unpacks the installed libabsl-dev's source into $1, prints its directory
  local dir=$1 version apt_dir
  version=$(dpkg-query -W -f='${Version}' libabsl-dev)
  if [[ ! -f $dir/.version || $(cat "$dir/.version") != "$version" ]]; then
    rm -rf "$dir"
    apt_dir=$dir/apt
    mkdir -p "$apt_dir/lists/partial" "$dir/src"
    sources_as_deb_src "$apt_dir/sources"
    local apt_opts=(-q -o "Dir::Etc::SourceList=$apt_dir/sources/sources.list"
                    -o "Dir::Etc::SourceParts=$apt_dir/sources"
                    -o "Dir::State::Lists=$apt_dir/lists"
                    -o "Debug::NoLocking=1")
    apt-get "${apt_opts[@]}" update >"$dir/apt.log" 2>&1 &&
      (cd "$dir/src" && apt-get "${apt_opts[@]}" source "abseil=$version") >>"$dir/apt.log" 2>&1 ||
      { cat "$dir/apt.log" >&2
        echo "sanitize.sh: cannot fetch the source of abseil=$version with apt-get source" >&2
        exit 1; }
    rm -rf "$apt_dir"
    echo "$version" >"$dir/.version"
  fi
  find "$dir/src" -mindepth 1 -maxdepth 1 -type d -name 'abseil-*' | head -1
}

cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTBUS_FIXTURES_DIR="$fixtures"
            -DWEIGHTBUS_BUILD_BENCH=ON ${SANITIZE_CMAKE_ARGS:-})
if [[ $mode == asan ]]; then
  cmake_args+=(-DWEIGHTBUS_SANITIZE=address,undefined)
else
  command -v dpkg-source >/dev/null || {
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    echo "sanitize.sh: installing dpkg-dev (dpkg-source, for apt-get source)"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends dpkg-dev \
      >/dev/null; }
  mkdir -p "$build"
  absl=$(abseil_source "$PWD/$build/absl-source")
  echo "sanitize.sh: Abseil $(cat "$build/absl-source/.version") from $absl (built with TSan)"
  cmake_args+=(-DWEIGHTBUS_SANITIZE=thread -DWEIGHTBUS_ABSL_SOURCE_DIR="$absl")
fi

mkdir -p "$build"
echo "sanitize.sh: configuring and building $build (log: $build/build.log)"
targets=()
if [[ $mode == tsan ]]; then
  targets=(--target "${TSAN_SUITES[@]}" wb_test_peer weightbus_cli)
elif [[ -z $all ]]; then
  targets=(--target "${ASAN_SUITES[@]}" wb_test_peer weightbus_cli)
fi
if ! { cmake -S . -B "$build" "${cmake_args[@]}" &&
       cmake --build "$build" "${targets[@]}"; } >"$build/build.log" 2>&1; then
  tail -n 60 "$build/build.log"
  echo "sanitize.sh: build failed; the whole log is $build/build.log" >&2
  exit 1
fi

# halt_on_error: the first report ends the process (the test fails). ASan's leak checker runs at
# exit (detect_leaks=1). TSan: second_deadlock_stack for lock-order reports; the suppressions file
# names third-party code only (scripts/tsan.supp says what and why).
asan=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1
asan+=:check_initialization_order=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-$asan}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
tsan=halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp
export TSAN_OPTIONS=${TSAN_OPTIONS:-$tsan}
# UCX's memory hooks (libucm patches mmap/munmap/madvise) run inside glibc's thread teardown,
# where TSan's interceptors crash (SIGSEGV in __tsan::MutexPreReadLock from ucm_madvise), and
# lock inside libucm what libucs unlocks. Off under TSan: the registration cache then registers
# per version (lib/transports/ucx/registration_cache.h) and its own test is skipped, naming why.
if [[ $mode == tsan ]]; then
  export UCX_MEM_MMAP_HOOK_MODE=${UCX_MEM_MMAP_HOOK_MODE:-none}
  export UCX_MEM_MALLOC_HOOKS=${UCX_MEM_MALLOC_HOOKS:-no}
fi
cd "$build"
if [[ $mode == asan && -n $all ]]; then
  exec ctest --output-on-failure --timeout 900 -j "$(nproc)" -E "$ASAN_EXCLUDE" "$@"
fi
if [[ $mode == asan ]]; then suites=("${ASAN_SUITES[@]}"); else suites=("${TSAN_SUITES[@]}"); fi
labels=$(IFS='|'; echo "${suites[*]}")
exec ctest --output-on-failure --timeout 900 -j "$(nproc)" -L "^($labels)\$" "$@"
