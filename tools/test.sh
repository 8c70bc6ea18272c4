#!/usr/bin/env bash
# Configures, builds and runs accel's whole test suite (build/ by default).
# Usage: tools/test.sh [BUILD_DIR] [extra ctest args...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
shift || true
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j"$(nproc)"
cd "$build"
ctest --output-on-failure -j"$(nproc)" "$@"
