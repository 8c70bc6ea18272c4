#!/usr/bin/env bash
# Workload W on two "machines" over a slow network: two Linux network
# namespaces joined by one veth pair, each end rate-limited with tc tbf, one
# process per namespace (Gloo over the veth). Contenders per round, one after
# the other: PyTorch's Python DDP and accel, each with no hook, Fp16, Bf16 and
# PowerSGD (rank 1, from step 2); PyTorch's bf16 hook needs CUDA and NCCL, so
# it has no Python contender. Needs root, ip and tc; removes what it made.
#
#   bench/comm_hooks_net.sh [BUILD_DIR=build-bench] [RATE=1gbit] [ROUNDS=2]
#
# Traffic goes only between the two namespaces (10.231.77.1 and .2). Each
# contender checks W's step-0 loss; prints every RESULT line (see w_ddp.cpp)
# and a table of median ms/step with the ratio to Python DDP with the same hook.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-bench}" && pwd)
rate=${2:-1gbit}
rounds=${3:-2}
python=${PYTHON:-/usr/bin/python3}
bin=$build/bench/w_ddp
ns=(accel-bench-a accel-bench-b)
dev=(accb0 accb1)
ip=(10.231.77.1 10.231.77.2)
[[ $(id -u) -eq 0 ]] || { echo "comm_hooks_net.sh: needs root (network namespaces)" >&2; exit 1; }
[[ -x $bin ]] || { echo "comm_hooks_net.sh: $bin not built (cmake --build $build --target w_ddp)" >&2; exit 1; }
log=$(mktemp -d)
cleanup() {
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$log"
}
trap cleanup EXIT
cleanup
mkdir -p "$log"
for i in 0 1; do ip netns add "${ns[$i]}"; done
ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for i in 0 1; do
  ip link set "${dev[$i]}" netns "${ns[$i]}"
  ip netns exec "${ns[$i]}" ip addr add "${ip[$i]}/24" dev "${dev[$i]}"
  ip netns exec "${ns[$i]}" ip link set "${dev[$i]}" up
  ip netns exec "${ns[$i]}" ip link set lo up
  # tbf: the rate, a burst of 1 ms at that rate (at least 64 KB), 50 ms of queue.
  ip netns exec "${ns[$i]}" tc qdisc add dev "${dev[$i]}" root tbf rate "$rate" burst 256kb latency 50ms
done
# (no ping on a minimal Debian: the first contender checks connectivity)

export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
echo "date $(date -u '+%Y-%m-%d %H:%M UTC'), nproc $(getconf _NPROCESSORS_ONLN), veth rate $rate each way"
run() {  # [--optional] label command...: rank 0 in namespace a, rank 1 in namespace b
  local optional=0
  [[ $1 == --optional ]] && { optional=1; shift; }
  local label=$1 port=$((29800 + RANDOM % 100))
  shift
  for i in 1 0; do
    ip netns exec "${ns[$i]}" env RANK=$i WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR="${ip[0]}" MASTER_PORT=$port GLOO_SOCKET_IFNAME="${dev[$i]}" \
      timeout 900 "$@" >"$log/$i.out" 2>&1 &
    pids[$i]=$!
  done
  local rc=0
  wait "${pids[0]}" || rc=$?
  wait "${pids[1]}" || rc=$?
  if ((rc != 0)) || ! grep -q '^RESULT' "$log/0.out"; then
    if ((optional)); then
      echo "$label failed: $(grep -h -m1 -E 'Error|enforce|what\(\)' "$log/0.out" "$log/1.out" | head -n 1)"
      return 0
    fi
    tail -n 15 "$log/0.out" "$log/1.out" >&2
    echo "comm_hooks_net.sh: $label failed" >&2
    exit 1
  fi
  grep '^RESULT' "$log/0.out" | tee -a "$log/results"
}
for ((r = 1; r <= rounds; r++)); do
  echo "-- round $r"
  for hook in none fp16 bf16 powersgd; do
    if [[ $hook == none ]]; then
      run "python $hook" "$python" "$root/bench/w_ddp.py" --env
      run "accel $hook" "$bin" env
    else
      # PyTorch's bf16_compress_hook refuses to run without CUDA 11+ and NCCL 2.10+.
      # (PyTorch 1.13's powerSGD_hook over Gloo crashed here: its ranks issued
      # all-reduces of different sizes; recorded as failed, not fatal.)
      [[ $hook == bf16 ]] || run --optional "python $hook" "$python" "$root/bench/w_ddp.py" --env --hook "$hook"
      run "accel $hook" "$bin" env "hook=$hook"
    fi
  done
done
echo
echo "median ms/step over all windows of all rounds (rate $rate):"
awk '
  { name = $2; n[name]++; v[name, n[name]] = $4 }
  END {
    split("none fp16 bf16 powersgd", hooks, " ")
    printf "%-10s %14s %14s %10s\n", "hook", "python DDP", "accel", "accel/DDP"
    for (h = 1; h <= 4; h++) {
      py = (hooks[h] == "none") ? "python_ddp_gloo" : "python_ddp_gloo_" hooks[h]
      ac = (hooks[h] == "none") ? "accel_env" : "accel_env_" hooks[h]
      mp = med(py); ma = med(ac)
      if (mp > 0) printf "%-10s %14.1f %14.1f %10.2f\n", hooks[h], mp, ma, ma / mp
      else printf "%-10s %14s %14.1f %10s\n", hooks[h], "n/a", ma, "-"
    }
  }
  function med(name,   i, j, k, a, t) {
    k = n[name]
    for (i = 1; i <= k; i++) a[i] = v[name, i]
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return k ? a[int((k + 1) / 2)] : 0
  }' "$log/results"
