#!/usr/bin/env bash
# The price of being header-only: compile time of a translation unit that
# includes <accel/accel.hpp> and instantiates Accelerator<> with prepare() of
# a model, an optimizer and a data loader (bench/compile_time/accel_prepare.cpp),
# of the same code including only <accel/accelerator.hpp> and <accel/data.hpp>
# (accel_prepare.cpp with ACCEL_PROBE_LIGHT), vs one that includes <torch/torch.h> alone and does the
# plain equivalent (bench/compile_time/torch_plain.cpp).
#
#   bench/compile_time.sh [BUILD_DIR=build-bench] [RUNS=5]
#   BEFORE_INCLUDE=<old checkout>/include bench/compile_time.sh ...
#     adds (d) = (a) and (e) = (c) compiled against older headers, in the same
#     alternation.
#
# The compile commands are the project's own (Release, no precompiled header),
# read from BUILD_DIR with `ninja -t commands` for the targets
# compile_time_accel / compile_time_accel_light / compile_time_torch, minus
# ccache and dependency-file flags. The compiles alternate RUNS times (a, c, b,
# a, c, b, ...) so all see the same machine load; prints wall and CPU
# (user+sys) seconds, min and median, and the ratios to torch. Needs a
# configured Ninja build dir.
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
cmd_c=$(compile_cmd compile_time_accel_light accel_prepare.cpp "$out/c.o")
cmd_b=$(compile_cmd compile_time_torch torch_plain.cpp "$out/b.o")
cmd_d= cmd_e=
if [[ -n "${BEFORE_INCLUDE:-}" ]]; then
  cmd_d=${cmd_a//-I$root\/include/-I$BEFORE_INCLUDE} && cmd_d=${cmd_d//$out\/a.o/$out\/d.o}
  cmd_e=${cmd_c//-I$root\/include/-I$BEFORE_INCLUDE} && cmd_e=${cmd_e//$out\/c.o/$out\/e.o}
fi
[[ -n "$cmd_a" && -n "$cmd_c" && -n "$cmd_b" ]] || { echo "compile_time.sh: no compile command found in $build" >&2; exit 1; }
echo "compiler: $(${cmd_a%% *} --version | head -n 1)"
echo "(a) $cmd_a"
echo "(c) $cmd_c"
[[ -z "$cmd_d" ]] || echo "(d) $cmd_d"
[[ -z "$cmd_e" ]] || echo "(e) $cmd_e"
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
  measure "$cmd_c" "$out/c"
  measure "$cmd_b" "$out/b"
  [[ -z "$cmd_d" ]] || measure "$cmd_d" "$out/d"
  [[ -z "$cmd_e" ]] || measure "$cmd_e" "$out/e"
  echo "run $i: accel $(tail -n 1 "$out/a")  light $(tail -n 1 "$out/c")  torch $(tail -n 1 "$out/b")  (wall cpu, s)"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

stats() {  # file column -> "min median"
  cut -d' ' -f"$2" "$1" | sort -g | awk '{v[NR]=$1} END {m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2; printf "%.2f %.2f", v[1], m}'
}
read -r _ bw_med <<<"$(stats "$out/b" 1)"
read -r bc_min _ <<<"$(stats "$out/b" 2)"
row() {  # label file -> one table row, ratios to (b) by median wall and min CPU
  local w_min w_med c_min c_med
  read -r w_min w_med <<<"$(stats "$2" 1)"
  read -r c_min c_med <<<"$(stats "$2" 2)"
  awk -v l="$1" -v a="$w_min" -v b="$w_med" -v c="$c_min" -v d="$c_med" -v e="$bw_med" -v f="$bc_min" \
    'BEGIN {printf "| %s | %.2f | %.2f | %.2f | %.2f | %.3fx, %.3fx |\n", l, a, b, c, d, b/e, c/f}'
}
echo
echo "| translation unit | wall min (s) | wall median (s) | CPU min (s) | CPU median (s) | / torch.h (median wall, min CPU) |"
echo "|---|---|---|---|---|---|"
row "(a) accel.hpp + Accelerator<>::prepare(model, optimizer, loader)" "$out/a"
row "(c) accelerator.hpp + data.hpp, the same code" "$out/c"
row "(b) torch/torch.h + the plain equivalent" "$out/b"
[[ -z "$cmd_d" ]] || row "(d) (a) with the headers in $BEFORE_INCLUDE" "$out/d"
[[ -z "$cmd_e" ]] || row "(e) (c) with the headers in $BEFORE_INCLUDE" "$out/e"
