#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The build options mean what they say (issue 11), checked by configuring only (about a second
# each, nothing compiled): WEIGHTBUS_WITH_DELTA=OFF leaves lib/delta, the delta layer and zstd out
# of every target and the installed package files; WEIGHTBUS_WITH_DISK=OFF leaves lib/io, the
# disk transport and liburing out; WEIGHTBUS_WITH_NCCL=OFF leaves the nccl transport, its tests
# and libnccl out, and =ON fails the configure step where the CUDA toolkit or NCCL is missing;
# WEIGHTBUS_WITH_CUDA=OFF leaves the CUDA kernels and runtime out.
# Usage: build_options_test.sh SOURCE_DIR
set -euo pipefail
src=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/wb_build_options.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "build_options_test: FAILED: $*" >&2; exit 1; }

# configure NAME ARGS...: configures the whole project (tests, bench, tools) into $work/NAME.
# WEIGHTBUS_PYTHON is given so that no interpreter is probed (the Python tests are never run).
configure() {
  local name=$1
  shift
  # CUDA is detected (nvcc probed, tens of seconds) only where the check is about it: the
  # default configure and nocuda; elsewhere it is off.
  local cuda=(-DWEIGHTBUS_WITH_CUDA=OFF)
  [[ $name == default ]] && cuda=()
  cmake -S "$src" -B "$work/$name" -G Ninja -DWEIGHTBUS_PYTHON=/usr/bin/true "${cuda[@]}" "$@" \
    > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "configure $name ($*)"; }
}
# absent NAME PATTERN WHAT: no rule of the build and no line of the pkg-config file (what the
# installed package says it links) names PATTERN.
absent() {
  local d=$work/$1 hits
  hits=$(grep -nE "$2" "$d/build.ninja"; grep -v '^#' "$d/weightbus.pc" | grep -nE "$2") || true
  [ -z "$hits" ] || { echo "$hits" | head -n 5; fail "$1: $3 is still in the build"; }
}
present() {
  grep -qE "$2" "$work/$1/build.ninja" || fail "$1: $3 is missing from the build"
}

# off NAME OPTION CODE DEPENDENCY KEPT: configured with OPTION=OFF, no rule builds what CODE
# matches and nothing links DEPENDENCY; KEPT (the other option's code) is still built, and the
# installed package files do not list NAME among the transports.
off() {
  local name=$1 option=$2 code=$3 dependency=$4 kept=$5
  configure "no$name" "-D$option=OFF"
  absent "no$name" "$code" "the $name code"
  absent "no$name" "$dependency" "its dependency ($dependency)"
  present "no$name" "$kept" "$kept (still on)"
  ! grep -qE "^transports=.*\b$name\b" "$work/no$name/weightbus.pc" ||
    fail "no$name: weightbus.pc lists $name"
  ! grep -qE "weightbus_TRANSPORTS \".*\b$name\b" "$work/no$name/weightbusConfig.cmake" ||
    fail "no$name: weightbusConfig.cmake lists $name"
}
off delta WEIGHTBUS_WITH_DELTA \
  'lib/delta/|transports/delta/|delta_[a-z_]*test|delta_fuzz|delta[-_]bench' \
  'libzstd|-lzstd' 'lib/io/file_io\.cc'
off disk WEIGHTBUS_WITH_DISK \
  'lib/io/|transports/disk/|disk_[a-z_]*test|disk[-_](small[-_])?bench' \
  'liburing|-luring' 'lib/delta/codec\.cc'

# Both on (the default): everything is there, which is what makes the checks above mean something.
configure default
present default 'lib/delta/codec\.cc' "lib/delta"
present default 'lib/io/file_io\.cc' "lib/io"
grep -q -- '-lzstd' "$work/default/weightbus.pc" || fail "default: weightbus.pc lacks -lzstd"
grep -q -- '-luring' "$work/default/weightbus.pc" || fail "default: weightbus.pc lacks -luring"

# WEIGHTBUS_WITH_CUDA=OFF: no kernels, no nvcc, no CUDA runtime; core/cuda/device.cc is still
# built (its calls answer Unimplemented naming the capability). AUTO builds them where nvcc is.
configure nocuda -DWEIGHTBUS_WITH_CUDA=OFF
absent nocuda 'core/cuda/kernels\.cu|nvcc' "the CUDA kernels"
absent nocuda 'libcudart' "the CUDA runtime"
absent nocuda 'transports/nccl/|libnccl' "nccl:// (it needs CUDA)"
present nocuda 'core/cuda/device\.cc' "core/cuda/device.cc"
present nocuda 'device_gating_test' "device_gating_test"
if grep -q 'weightbus: CUDA .*, kernels for' "$work/default.log"; then  # AUTO found CUDA
  present default 'core/cuda/kernels\.cu' "the CUDA kernels"
fi

# nccl:// is built where the CUDA toolkit and NCCL are found (AUTO).
if grep -qE '^transports=.*\bnccl\b' "$work/default/weightbus.pc"; then
  present default 'transports/nccl/root\.cc' "the nccl transport"
  grep -q -- '-lnccl' "$work/default/weightbus.pc" || fail "default: weightbus.pc lacks -lnccl"
  off nccl WEIGHTBUS_WITH_NCCL 'transports/nccl/|nccl_[a-z_]*test|nccl_control_fuzz|nccl[-_]bench' \
    'libnccl|-lnccl' 'lib/delta/codec\.cc'
fi
# ON without them (the CUDA toolkit hidden from find_package) is a configure error naming them.
if cmake -S "$src" -B "$work/nccl" -G Ninja -DWEIGHTBUS_PYTHON=/usr/bin/true \
     -DWEIGHTBUS_WITH_NCCL=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON > "$work/nccl.log" 2>&1; then
  fail "WEIGHTBUS_WITH_NCCL=ON configured without the CUDA toolkit"
fi
grep -q 'WEIGHTBUS_WITH_NCCL=ON but NCCL with a CUDA build' "$work/nccl.log" ||
  { cat "$work/nccl.log"; fail "WEIGHTBUS_WITH_NCCL=ON failed for another reason"; }
echo "build_options_test: OK"
