#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README command 2: install what is missing, build, and run every test (GoogleTest suites and
# the fuzz replay, through CTest). Extra arguments go to ctest (e.g. -R Disk).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
exec ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
