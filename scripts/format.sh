#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Formats every tracked C and C++ file with clang-format (.clang-format: Google style, 100
# columns). `--check`: change nothing, list the files that differ and exit 1 if any does (CTest
# runs this as `format_check`). The style is pinned to clang-format 14 (Debian 12's); with another
# major version the check is skipped (exit 77), since versions format differently.
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=${CLANG_FORMAT:-clang-format}
if ! command -v "$clang_format" >/dev/null; then
  echo "SKIPPED: $clang_format not found (Debian package clang-format)"
  exit 77
fi
version=$("$clang_format" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [[ "$version" != 14 ]]; then
  echo "SKIPPED: $clang_format is version $version; the style is pinned to clang-format 14"
  exit 77
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "SKIPPED: not a git checkout (the files to format are the tracked ones)"
  exit 77
fi
mapfile -t files < <(git ls-files '*.c' '*.cc' '*.h' '*.hpp')
if [[ "${1:-}" == "--check" ]]; then
  bad=()
  for f in "${files[@]}"; do
    "$clang_format" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    printf 'not formatted (run scripts/format.sh): %s\n' "${bad[@]}"
    exit 1
  fi
  echo "format_check: ${#files[@]} files formatted"
else
  "$clang_format" -i "${files[@]}"
fi
