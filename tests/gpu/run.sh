#!/usr/bin/env bash
# Everything accel checks on a CUDA machine, in one call (issue 20): builds
# accel against the CUDA LibTorch inside that machine's PyTorch (and NCCL from
# the same installation), runs the GPU checks (tests/gpu/gpu_checks.cpp), the
# benchmark against Hugging Face Accelerate (bench/gpu/), and, when CMake is
# there and time remains, the ctest suite with CUDA and NCCL enabled.
#
# The GPU machine reaches no package registry: what accel needs besides
# LibTorch travels as a folder made here first by tests/gpu/bundle.sh
# (build-gpu-deps, passed to the device tool as a carried path).
#
# Usage:  tests/gpu/run.sh                 on the GPU machine (results in $OUT)
#         tests/gpu/run.sh --compile-only  on a CPU machine: compile the GPU
#                 programs against Debian's LibTorch and the CUDA toolkit's
#                 headers (ACCEL_WITH_NCCL=1), run nothing
# Environment: OUT (results folder, default build-gpu/out), PYTHON (python3),
#   ACCEL_GPU_DEPS (build-gpu-deps), ACCEL_GPU_BUDGET_S (seconds for the whole
#   run, default 540: later phases are skipped, and say so, when time is short).
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }
say() { echo "gpu run [$(elapsed) s]: $*"; }
budget=${ACCEL_GPU_BUDGET_S:-540}
left() { echo $(( budget - $(elapsed) )); }

compile_only=0
[[ "${1:-}" == "--compile-only" ]] && compile_only=1
out=${OUT:-$here/build-gpu/out}
mkdir -p "$out"
work=$here/build-gpu
mkdir -p "$work"
summary=$out/summary.txt
: >"$summary"
record() { echo "$*" | tee -a "$summary"; }
cxx=${CXX:-g++}
jobs=$(nproc)

# --- compile-only: the GPU programs as a CUDA build of LibTorch sees them -----
if ((compile_only)); then
  cuda_home=${CUDA_HOME:-/usr/local/cuda}
  [[ -f $cuda_home/include/nccl.h ]] || { say "no NCCL headers under $cuda_home/include"; exit 1; }
  stub=$work/stub
  mkdir -p "$stub/c10/cuda/impl"
  # Debian's CPU LibTorch lacks this generated CUDA header.
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
  catch_v3=0; [[ -f /usr/include/catch2/catch_all.hpp ]] && catch_v3=1
  flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Werror -DACCEL_WITH_NCCL=1 -DACCEL_WITH_CUDA=1
         -DUSE_C10D_NCCL -DUSE_C10D_GLOO -DACCEL_TEST_CATCH2_V3=$catch_v3 -I"$here/include"
         -I"$here/tests/support" -isystem /usr/include/torch/csrc/api/include
         -isystem "$cuda_home/include" -isystem "$stub")
  rc=0
  for src in tests/gpu/gpu_checks.cpp bench/gpu/gpu_bench.cpp; do
    if "$cxx" "${flags[@]}" "$src"; then say "compiled $src"; else say "FAILED to compile $src"; rc=1; fi
  done
  python3 -m py_compile bench/gpu/accelerate_bench.py && say "compiled bench/gpu/accelerate_bench.py" || rc=1
  exit $rc
fi

# --- 1. What this machine has ------------------------------------------------
py=${PYTHON:-python3}
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  (. /etc/os-release 2>/dev/null && echo "os: $PRETTY_NAME")
  echo "glibc: $(ldd --version 2>/dev/null | head -n 1)"
  echo "cores: $jobs"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  for t in "$cxx" cmake ninja nvcc "$py"; do echo "$t: $(command -v "$t" || echo missing) $("$t" --version 2>/dev/null | head -n 1)"; done
  "$py" - <<'EOF' 2>&1
import torch
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "cxx11 abi:", torch._C._GLIBCXX_USE_CXX11_ABI)
print("nccl:", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a")
try:
    import accelerate
    print("accelerate:", accelerate.__version__)
except Exception as e:
    print("accelerate: missing", e)
EOF
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"

read -r torch_dir torch_prefix abi < <("$py" -c '
import os, torch
print(os.path.dirname(torch.__file__), torch.utils.cmake_prefix_path, int(torch._C._GLIBCXX_USE_CXX11_ABI))') || {
  say "python3 cannot import torch; set PYTHON to the interpreter of the CUDA PyTorch"; exit 1; }
site=$(dirname "$torch_dir")
deps=${ACCEL_GPU_DEPS:-$here/build-gpu-deps}
[[ -d $deps/include/boost/hana ]] || { say "no dependency bundle at $deps: run tests/gpu/bundle.sh first, and carry build-gpu-deps"; exit 1; }

# CUDA and NCCL headers: a toolkit, or the nvidia-* wheels beside torch.
find_header() {
  local name=$1 d
  for d in "${CUDA_HOME:-}/include" /usr/local/cuda/include /usr/include; do
    [[ -n $d && -f $d/$name ]] && { echo "$d"; return; }
  done
  find "$site/nvidia" -name "$name" -path '*/include/*' 2>/dev/null | head -n 1 | xargs -r dirname
}
cuda_inc=$(find_header cuda_runtime_api.h)
nccl_inc=$(find_header nccl.h)
say "torch: $torch_dir (cxx11 abi $abi); CUDA headers: ${cuda_inc:-none}; NCCL headers: ${nccl_inc:-none}"
[[ -n $cuda_inc ]] || { say "no cuda_runtime_api.h found (CUDA_HOME, /usr/local/cuda, $site/nvidia)"; exit 1; }

common=(-std=c++20 -O2 -D_GLIBCXX_USE_CXX11_ABI="$abi")
# --- 2. yaml-cpp from the bundle's source, with this compiler and ABI ---------
if [[ ! -f $deps/lib/libyaml-cpp.a || ! -f $deps/lib/.abi$abi ]]; then
  say "building yaml-cpp"
  mkdir -p "$work/yaml-cpp" "$deps/lib"
  i=0
  while IFS= read -r -d '' f; do
    "$cxx" "${common[@]}" -fPIC -I"$deps/src/yaml-cpp/include" -I"$deps/src/yaml-cpp/src" -c "$f" \
      -o "$work/yaml-cpp/$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" 2>>"$out/yaml-cpp.log" &
    (( ++i % jobs == 0 )) && wait
  done < <(find "$deps/src/yaml-cpp/src" -name '*.cpp' -print0)
  wait
  rm -f "$deps/lib/libyaml-cpp.a" && ar rcs "$deps/lib/libyaml-cpp.a" "$work"/yaml-cpp/*.o && touch "$deps/lib/.abi$abi"
fi

# --- 3. The GPU checks and the benchmark, built directly (no CMake needed) ----
# fmt header-only (spdlog's, in the bundle), and the bundle's headers before
# LibTorch's: pip's LibTorch carries an fmt of another version in include/.
defs=(-DACCEL_WITH_CUDA=1 -DUSE_C10D_GLOO -DACCEL_WITH_MPI=0 -DFMT_HEADER_ONLY=1)
[[ -n $nccl_inc ]] && defs+=(-DACCEL_WITH_NCCL=1 -DUSE_C10D_NCCL)
incs=(-I"$here/include" -I"$here/tests/support" -isystem "$deps/include" -isystem "$torch_dir/include"
      -isystem "$torch_dir/include/torch/csrc/api/include" -isystem "$cuda_inc")
[[ -n $nccl_inc ]] && incs+=(-isystem "$nccl_inc")
libs=(-L"$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -Wl,--no-as-needed -ltorch -ltorch_cuda -ltorch_cpu
      -lc10_cuda -lc10 -Wl,--as-needed -lpthread)
build_one() {  # name source
  "$cxx" "${common[@]}" "${defs[@]}" "${incs[@]}" "$2" -o "$work/$1" "${libs[@]}" >"$out/build_$1.log" 2>&1
}
say "building gpu_checks and gpu_bench"
build_one gpu_checks tests/gpu/gpu_checks.cpp & p1=$!
build_one gpu_bench bench/gpu/gpu_bench.cpp & p2=$!
wait $p1; rc_checks=$?
wait $p2; rc_bench=$?
record "build gpu_checks: $([[ $rc_checks == 0 ]] && echo ok || echo "FAILED (build_gpu_checks.log)")"
record "build gpu_bench: $([[ $rc_bench == 0 ]] && echo ok || echo "FAILED (build_gpu_bench.log)")"
((rc_checks)) && tail -n 30 "$out/build_gpu_checks.log"

status=0
if ((rc_checks == 0)); then
  say "running the GPU checks"
  (cd "$out" && OUT=$out timeout 240 "$work/gpu_checks" --reporter console --durations yes '~[.shared]') \
    >"$out/gpu_checks.txt" 2>&1
  rc=$?; tail -n 40 "$out/gpu_checks.txt"
  record "gpu_checks: $([[ $rc == 0 ]] && echo passed || echo "FAILED (rc $rc, gpu_checks.txt)")"
  ((rc)) && status=1
  # Two NCCL ranks on one GPU: reported, not required (NCCL may refuse it).
  (cd "$out" && OUT=$out timeout 120 "$work/gpu_checks" '[.shared]') >"$out/nccl_two_ranks.txt" 2>&1
  rc=$?
  record "nccl, 2 processes sharing one GPU: $([[ $rc == 0 ]] && echo works || echo "does not work (nccl_two_ranks.txt, nccl_world2_rank*.log)")"
  ((rc)) && grep -h -m 3 -i "error\|duplicate" "$out"/nccl_world2_rank*.log 2>/dev/null | head -n 5
fi

# --- 4. The benchmark: accel<Nccl, Bf16> vs Accelerate (bf16), alternated -----
bench_json=$out/bench.jsonl
: >"$bench_json"
if ((rc_bench == 0)) && (( $(left) > 150 )); then
  say "benchmark (W and the transformer; accel and Accelerate alternated)"
  port=29650
  for round in 1 2; do
    for w in w transformer; do
      port=$((port + 1))
      RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        timeout 120 "$work/gpu_bench" "$w" 20 2>>"$out/bench_stderr.txt" | sed "s/}$/, \"round\": $round}/" >>"$bench_json"
      timeout 120 "$py" bench/gpu/accelerate_bench.py "$w" 20 2>>"$out/bench_stderr.txt" |
        sed "s/}$/, \"round\": $round}/" >>"$bench_json"
    done
    (( $(left) > 150 )) || break
  done
  "$py" - "$bench_json" <<'EOF' | tee "$out/bench.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("| workload | impl | median ms/step | min ms/step | peak GPU MB | final loss |")
print("|---|---|---|---|---|---|")
best = {}
for r in rows:
    k = (r["workload"], r["impl"])
    if k not in best or r["median_ms"] < best[k]["median_ms"]:
        best[k] = r
for (w, impl), r in sorted(best.items()):
    print(f"| {w} | {impl} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['peak_mb']:.0f} | {r['final_loss']:.4f} |")
for w in sorted({w for w, _ in best}):
    a, b = best.get((w, "accel")), best.get((w, "accelerate"))
    if a and b:
        print(f"\n{w}: accel / Accelerate median ratio {a['median_ms'] / b['median_ms']:.3f}, "
              f"peak memory ratio {a['peak_mb'] / b['peak_mb']:.3f}")
EOF
else
  record "benchmark: skipped ($( ((rc_bench)) && echo "gpu_bench did not build" || echo "$(left) s left of the budget"))"
fi

# --- 5. The ctest suite against the CUDA LibTorch (CMake needed) --------------
if command -v cmake >/dev/null && (( $(left) > 200 )); then
  say "ctest suite with CUDA (configure + build + ctest, $(left) s left)"
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  timeout $(( $(left) - 30 )) bash -c '
    cmake -S . -B "$0" "${@:4}" -DCMAKE_BUILD_TYPE=Release -DACCEL_WITH_MPI=OFF -DACCEL_BUILD_BENCH=OFF \
      -DCMAKE_PREFIX_PATH="$1;$2/cmake" -DBoost_DIR="$2/cmake/Boost" \
      -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$3" &&
    cmake --build "$0" -j"$(nproc)" &&
    cd "$0" && ctest --output-on-failure -j4 -E "amalgamate|cmake\.|clang\.|fuzz"' \
    "$work/cmake" "$torch_prefix" "$deps" "$abi" "${gen[@]}" >"$out/ctest.txt" 2>&1
  rc=$?; tail -n 30 "$out/ctest.txt"
  record "ctest suite: $([[ $rc == 0 ]] && echo passed || echo "FAILED or timed out (rc $rc, ctest.txt)") $(grep -E 'tests passed|tests failed' "$out/ctest.txt" | tail -n 1)"
  ((rc)) && status=1
else
  record "ctest suite: not run ($(command -v cmake >/dev/null && echo "$(left) s left of the budget" || echo "no cmake on this machine"))"
fi

say "done; summary:"
cat "$summary"
exit $status
