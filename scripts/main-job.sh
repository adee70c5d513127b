#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README command 1: install what is missing, build, and run the main job: a trainer process
# converts the real llama2.c checkpoint ../shared/fixtures/stories260K.bin, checks the conversion
# with two forward passes, and publishes 20 Adam-updated bf16 versions over disk://; two replica
# processes receive each one and check it bit-exact. Extra arguments go to weightbus-demo
# (see build/tools/weightbus-demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/tools/weightbus-demo "$@"
