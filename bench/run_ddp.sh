#!/usr/bin/env bash
# Workload W on 2 processes: PyTorch's Python DDP (gloo) vs accel Gloo and
# accel Mpi: with accel's defaults (25 MiB buckets; overlap with backward only
# when each process has a spare core), with overlap forced on, and with one
# flat all-reduce after backward (bucket_cap_mb = 1e6). The contenders run one
# after the other, ROUNDS times, so all of them see the same machine load.
#
#   bench/run_ddp.sh [BUILD_DIR=build-bench] [ROUNDS=3]
#
# Environment: MPIRUN_ARGS (default "--bind-to none": no contender is pinned,
# as the forked ones are not), PYTHON (default /usr/bin/python3, Debian's
# python3-torch), EXTRA (more accel runs per round, e.g. "gloo:cap=1 mpi:cap=1"
# for a bucket-size sweep: backend:w_ddp-arguments, comma-separated arguments).
# Every process uses one intra-op thread, and OpenBLAS one
# thread (OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1, the same for everyone).
# Each contender checks W's loss gate (mean over ranks: 2.298264 at step 0,
# 2.311658 at step 32) and fails the script if it does not reproduce it.
# Prints every run's RESULT line, then one table over all windows of all
# rounds (ms/step: min and median) with the ratio to Python DDP.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-bench}" && pwd)
rounds=${2:-3}
python=${PYTHON:-/usr/bin/python3}
mpirun_args=${MPIRUN_ARGS:---bind-to none}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
bin=$build/bench/w_ddp
log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "date $(date -u '+%Y-%m-%d %H:%M UTC'), nproc $(getconf _NPROCESSORS_ONLN), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # label command...
  local out
  if ! out=$("$@" 2>&1); then
    echo "$out" | tail -n 20 >&2
    echo "run_ddp.sh: $1 failed" >&2
    exit 1
  fi
  echo "$out" | grep '^RESULT' | tee -a "$log"
}
for ((r = 1; r <= rounds; r++)); do
  echo "-- round $r"
  run "$python" "$root/bench/w_ddp.py" --port $((29611 + r))
  run "$bin" gloo
  run mpirun --allow-run-as-root -np 2 $mpirun_args -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "$bin" mpi
  run "$bin" gloo overlap
  run mpirun --allow-run-as-root -np 2 $mpirun_args -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "$bin" mpi overlap
  run "$bin" gloo flat
  run mpirun --allow-run-as-root -np 2 $mpirun_args -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "$bin" mpi flat
  for extra in ${EXTRA:-}; do
    backend=${extra%%:*}
    IFS=, read -r -a args <<<"${extra#*:}"
    if [[ $backend == mpi ]]; then
      run mpirun --allow-run-as-root -np 2 $mpirun_args -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "$bin" mpi "${args[@]}"
    else
      run "$bin" "$backend" "${args[@]}"
    fi
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# RESULT name min median loss0 loss32 gate buckets launched w1 w2 w3
awk -v rounds="$rounds" '
  function sort(a, n,   i, j, t) { for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t } }
  {
    name = $2; if (!(name in n)) order[++k] = name
    for (f = 10; f <= 12; f++) w[name, ++n[name]] = $f
    if (!(name in gate) || gate[name] == "ok") gate[name] = $7  # keeps the first failure
    buckets[name] = $8; launched[name] = $9
  }
  END {
    label["python_ddp_gloo"] = "Python DDP, gloo (torch 1.13)"
    label["accel_gloo"] = "accel Gloo, defaults (25 MiB buckets, overlap decided by accel)"
    label["accel_mpi"] = "accel Mpi, defaults (25 MiB buckets, overlap decided by accel)"
    label["accel_gloo_overlap"] = "accel Gloo, 25 MiB buckets, overlap forced on"
    label["accel_mpi_overlap"] = "accel Mpi, 25 MiB buckets, overlap forced on"
    label["accel_gloo_flat"] = "accel Gloo, one flat all-reduce after backward"
    label["accel_mpi_flat"] = "accel Mpi, one flat all-reduce after backward"
    for (i = 1; i <= k; i++) {
      name = order[i]; m = n[name]
      for (j = 1; j <= m; j++) v[j] = w[name, j]
      sort(v, m)
      mn[name] = v[1]; md[name] = (m % 2) ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
    }
    printf "\nW, 2 processes, per-rank batch 32, %d rounds x 3 windows of 10 steps (ms/step)\n", rounds
    print "| contender | min | median | min / DDP min | median / DDP median | buckets | all-reduces started in backward (33 steps) | loss gate |"
    print "|---|---|---|---|---|---|---|---|"
    for (i = 1; i <= k; i++) {
      name = order[i]
      l = name
      if (name in label) l = label[name]
      else if (sub(/^accel_gloo_cap/, "accel Gloo, ", l) || sub(/^accel_mpi_cap/, "accel Mpi, ", l)) l = l " MiB buckets"
      printf "| %s | %.1f | %.1f | %.2fx | %.2fx | %s | %s | %s |\n", l,
        mn[name], md[name], mn[name] / mn["python_ddp_gloo"], md[name] / md["python_ddp_gloo"],
        buckets[name], launched[name], gate[name]
    }
  }' "$log"
