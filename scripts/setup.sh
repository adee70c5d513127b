#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian packages weightbus needs (only those missing), then configures and builds
# it in ./build. Extra packages can be named in SETUP_EXTRA_PACKAGES and extra CMake arguments
# in SETUP_CMAKE_ARGS (CMake options such as -DWEIGHTBUS_WITH_DELTA=OFF; WEIGHTBUS_* environment
# variables are library settings, see README).
set -euo pipefail
cd "$(dirname "$0")/.."

# python3-*: the Python bindings' tests and examples/rl_loop.py run with Debian's
# /usr/bin/python3 (a pyenv or venv python3 first on PATH does not see these packages);
# python3-venv, -pip, -setuptools and -wheel: `pip install --no-build-isolation .` and its test
# (pip_install), offline.
packages=(cmake ninja-build g++ pkg-config
          libabsl-dev libzstd-dev libxxhash-dev liburing-dev nlohmann-json3-dev
          libgtest-dev libbenchmark-dev libcli11-dev libdlpack-dev libucx-dev ucx-utils zstd
          clang-format
          python3 python3-numpy python3-torch python3-pytest
          python3-venv python3-pip python3-setuptools python3-wheel ${SETUP_EXTRA_PACKAGES:-})
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

mkdir -p build
echo "setup: building in ./build (log: build/build.log)"
if ! { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${SETUP_CMAKE_ARGS:-} &&
       cmake --build build; } > build/build.log 2>&1; then
  tail -n 60 build/build.log
  echo "setup: build failed; the whole log is build/build.log" >&2
  exit 1
fi
