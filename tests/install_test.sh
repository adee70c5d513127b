#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the build into a temporary prefix and uses it as an application would: the exported
# symbols are only wb_* and namespace weightbus; a CMake project finds it with
# find_package(weightbus); C and C++ programs build with pkg-config (weightbus, weightbus-cpp);
# the installed Python package finds the installed library on its own.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR [PYTHON]
set -euo pipefail
build=$1 src=$2 python=${3:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/wb_install_test.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

cmake --install "$build" --prefix "$prefix" > "$work/install.log"
lib=$(find "$prefix" -name 'libweightbus.so' | head -n 1)
libdir=$(dirname "$lib")
echo "installed: $lib"

# Exports: the C API, the C++ API, and the version node; nothing else. (Read once: `nm | grep -q`
# under pipefail fails whenever grep exits before nm has written everything.)
exports=$(nm -D --defined-only "$lib")
unexpected=$(echo "$exports" | awk '{ $1 = ""; $2 = ""; sub(/^  /, ""); print }' |
  c++filt | grep -v -E '^(wb_[a-z_0-9]+|weightbus::.*|(typeinfo|typeinfo name|vtable) for weightbus::.*|WEIGHTBUS_0)(@@WEIGHTBUS_0)?$' || true)
if [ -n "$unexpected" ]; then
  echo "unexpected exported symbols:"; echo "$unexpected" | head -n 20; exit 1
fi
grep -q ' T wb_subscriber_wait@@WEIGHTBUS_0$' <<< "$exports"
grep -q 'SONAME.*libweightbus\.so\.0\]' <<< "$(readelf -d "$lib")"

# find_package(weightbus); the consumer project sets no C++ standard (the target carries C++20).
cmake -S "$src/tests/install" -B "$work/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_RPATH="$libdir" > "$work/cmake.log" || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/cmake" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/cmake/consumer_c" "$work/ch_cmake_c"
"$work/cmake/consumer_cxx" "$work/ch_cmake_cxx"

# pkg-config
export PKG_CONFIG_PATH=$libdir/pkgconfig
[ "$(pkg-config --modversion weightbus)" = "$(pkg-config --modversion weightbus-cpp)" ]
cc -std=c11 -Wall -Werror "$src/tests/install/consumer.c" -o "$work/pc_c" \
  $(pkg-config --cflags --libs weightbus) -Wl,-rpath,"$libdir"
"$work/pc_c" "$work/ch_pc_c"
# No -std here: weightbus-cpp's Cflags carry -std=c++20 (the headers need it).
c++ "$src/tests/install/consumer.cc" -o "$work/pc_cxx" \
  $(pkg-config --cflags --libs weightbus-cpp) -Wl,-rpath,"$libdir"
"$work/pc_cxx" "$work/ch_pc_cxx"

# The installed Python package locates the installed library by itself.
if [ -n "$python" ]; then
  site=$(find "$prefix" -type d -name weightbus -path '*dist-packages*' | head -n 1)
  env -u LIBWEIGHTBUS_PATH PYTHONPATH="$(dirname "$site")" PYTHONDONTWRITEBYTECODE=1 \
    "$python" -c "
import os, weightbus
assert os.path.realpath(weightbus.library_path) == os.path.realpath('$libdir/libweightbus.so.0'), weightbus.library_path
print('python: weightbus', weightbus.__version__, 'from', weightbus.library_path)"
fi
echo "install_test: OK"
