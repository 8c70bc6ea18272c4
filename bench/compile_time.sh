#!/usr/bin/env bash
# The price of being header-only: compile time of a translation unit that
# includes <accel/accel.hpp> and instantiates Accelerator<> with prepare() of
# a model, an optimizer and a data loader (bench/compile_time/accel_prepare.cpp)
# vs one that includes <torch/torch.h> alone and does the plain equivalent
# (bench/compile_time/torch_plain.cpp).
#
#   bench/compile_time.sh [BUILD_DIR=build-bench] [RUNS=5]
#
# The compile commands are the project's own (Release, no precompiled header),
# read from BUILD_DIR with `ninja -t commands` for the targets
# compile_time_accel / compile_time_torch, minus ccache and dependency-file
# flags. The two compiles alternate RUNS times (a, b, a, b, ...) so both see
# the same machine load; prints wall and CPU (user+sys) seconds, min and
# median, and the ratio accel/torch. Needs a configured Ninja build dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-bench}" && pwd)
runs=${2:-5}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The compile command of one probe, ready to run from $build.
compile_cmd() {  # target source-basename object
  ninja -C "$build" -t commands "$1" | grep -F -- "$2" | grep -F -- ' -c ' | head -n 1 |
    sed -e 's|^[^ ]*ccache ||' -e 's| -MD||' -e 's| -MT [^ ]*||' -e 's| -MF [^ ]*||' \
        -e "s| -o [^ ]*| -o $3|"
}
cmd_a=$(compile_cmd compile_time_accel accel_prepare.cpp "$out/a.o")
cmd_b=$(compile_cmd compile_time_torch torch_plain.cpp "$out/b.o")
[[ -n "$cmd_a" && -n "$cmd_b" ]] || { echo "compile_time.sh: no compile command found in $build" >&2; exit 1; }
echo "compiler: $(${cmd_a%% *} --version | head -n 1)"
echo "(a) $cmd_a"
echo "(b) $cmd_b"
echo "nproc $(getconf _NPROCESSORS_ONLN), load before: $(cut -d' ' -f1-3 /proc/loadavg)"

measure() {  # cmd file -> appends "wall cpu"
  if ! (cd "$build" && /usr/bin/time -f "%e %U %S" -o "$out/t" bash -c "$1" >"$out/log" 2>&1); then
    cat "$out/log" >&2
    echo "compile_time.sh: the compile failed" >&2
    exit 1
  fi
  awk '{printf "%.2f %.2f\n", $1, $2 + $3}' "$out/t" >>"$2"
}
(cd "$build" && bash -c "$cmd_b" >/dev/null 2>&1) || true  # warm the file cache once (not timed)
for ((i = 1; i <= runs; i++)); do
  measure "$cmd_a" "$out/a"
  measure "$cmd_b" "$out/b"
  echo "run $i: accel $(tail -n 1 "$out/a")  torch $(tail -n 1 "$out/b")  (wall cpu, s)"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

stats() {  # file column -> "min median"
  cut -d' ' -f"$2" "$1" | sort -g | awk '{v[NR]=$1} END {m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2; printf "%.2f %.2f", v[1], m}'
}
read -r aw_min aw_med <<<"$(stats "$out/a" 1)"
read -r ac_min ac_med <<<"$(stats "$out/a" 2)"
read -r bw_min bw_med <<<"$(stats "$out/b" 1)"
read -r bc_min bc_med <<<"$(stats "$out/b" 2)"
echo
echo "| translation unit | wall min (s) | wall median (s) | CPU min (s) | CPU median (s) |"
echo "|---|---|---|---|---|"
echo "| (a) accel.hpp + Accelerator<>::prepare(model, optimizer, loader) | $aw_min | $aw_med | $ac_min | $ac_med |"
echo "| (b) torch/torch.h + the plain equivalent | $bw_min | $bw_med | $bc_min | $bc_med |"
awk -v a="$aw_min" -v b="$bw_min" -v c="$aw_med" -v d="$bw_med" -v e="$ac_min" -v f="$bc_min" -v g="$ac_med" -v h="$bc_med" \
  'BEGIN {printf "| ratio (a)/(b) | %.3f | %.3f | %.3f | %.3f |\n", a/b, c/d, e/f, g/h}'
