#!/usr/bin/env bash
# Configures, builds and runs accel's whole test suite (build/ by default).
# Usage: tools/test.sh [BUILD_DIR] [extra ctest args...]
# ACCEL_TEST_CMAKE_ARGS: more CMake options (CI's LibTorch 2.6 leg: "-DACCEL_BUILD_BENCH=OFF -DACCEL_BUILD_EXAMPLES=OFF").
# ACCEL_TEST_BUILD_ONLY=1: configure and build, run nothing (CI builds ahead).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
shift || true
# shellcheck disable=SC2086  # word splitting of the extra options is intended
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${ACCEL_TEST_CMAKE_ARGS:-}
cmake --build "$build" -j"$(nproc)"
[[ ${ACCEL_TEST_BUILD_ONLY:-} == 1 ]] && exit 0
cd "$build"
ctest --output-on-failure -j"$(nproc)" "$@"
