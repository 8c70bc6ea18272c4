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
# and a table: ms/step min and median, the bytes machine 0 put on the veth per
# step, the final loss, and the ratio to Python DDP with the same hook.
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
tx_bytes() {  # bytes sent so far by machine 0's end of the veth
  ip netns exec "${ns[0]}" cat /proc/net/dev | sed 's/:/ /' | awk -v d="${dev[0]}" '$1 == d { print $10 }'
}
run() {  # [--optional] label command...: rank 0 in namespace a, rank 1 in namespace b
  local optional=0
  [[ $1 == --optional ]] && { optional=1; shift; }
  local label=$1 port=$((29800 + RANDOM % 100)) limit=180
  shift
  # W takes under 30 s here. An optional contender that hangs (PyTorch
  # 1.13's powerSGD_hook over Gloo did, 2026-12-07) is stopped sooner.
  ((optional)) && limit=120
  for i in 1 0; do
    ip netns exec "${ns[$i]}" env RANK=$i WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR="${ip[0]}" MASTER_PORT=$port GLOO_SOCKET_IFNAME="${dev[$i]}" \
      timeout "$limit" "$@" >"$log/$i.out" 2>&1 &
    pids[$i]=$!
  done
  local rc=0 tx0
  tx0=$(tx_bytes)
  wait "${pids[0]}" || rc=$?
  wait "${pids[1]}" || rc=$?
  # Python DDP's processes once printed their result and then hung on exit
  # (2026-12-07): the result stands, the hang is reported.
  if ((rc != 0)) && grep -q '^RESULT' "$log/0.out"; then
    echo "note: $label printed its result but did not exit cleanly (status $rc)"
  elif ((rc != 0)) || ! grep -q '^RESULT' "$log/0.out"; then
    if ((optional)); then
      if ((rc == 124)); then
        echo "$label hung: no result after $limit s, stopped"
      else
        echo "$label failed: $(grep -h -m1 -E 'Error|enforce|what\(\)' "$log/0.out" "$log/1.out" | head -n 1)"
      fi
      return 0
    fi
    tail -n 15 "$log/0.out" "$log/1.out" >&2
    echo "comm_hooks_net.sh: $label failed" >&2
    exit 1
  fi
  # The bytes machine 0 put on the veth over the whole run (rendezvous,
  # initial broadcast, 33 steps), per step.
  echo "$(grep '^RESULT' "$log/0.out") $(( ($(tx_bytes) - tx0) / 33 ))" | tee -a "$log/results"
}
for ((r = 1; r <= rounds; r++)); do
  echo "-- round $r"
  for hook in none fp16 bf16 powersgd; do
    if [[ $hook == none ]]; then
      run "python $hook" "$python" "$root/bench/w_ddp.py" --env
      run "accel $hook" "$bin" env
    else
      # PyTorch's bf16_compress_hook refuses to run without CUDA 11+ and NCCL 2.10+.
      # (PyTorch 1.13's powerSGD_hook over Gloo crashed here, its ranks issuing
      # all-reduces of different sizes, or hung: recorded, not fatal.)
      [[ $hook == bf16 ]] || run --optional "python $hook" "$python" "$root/bench/w_ddp.py" --env --hook "$hook"
      run "accel $hook" "$bin" env "hook=$hook"
    fi
  done
done
echo
echo "rate $rate: ms/step min and median over all 10-step windows of all rounds, MB machine 0"
echo "sent per step (veth; the run's total / 33 steps) and final loss (step 32), medians of the runs:"
awk '
  # Fields: RESULT name min median loss0 loss32 gate - - w1 w2 w3 bytes/step
  # (accel: buckets and launched-in-backward instead of the two dashes).
  { name = $2; n[name]++; ls[name, n[name]] = $6; by[name, n[name]] = $NF / 1e6
    for (w = 10; w <= 12; w++) win[name, ++nw[name]] = $w }
  END {
    split("none fp16 bf16 powersgd", hooks, " ")
    printf "%-9s | %-34s | %-34s | %s\n", "", "python DDP (same hook)", "accel", ""
    printf "%-9s | %7s %7s %8s %9s | %7s %7s %8s %9s | %s\n", "hook", "min", "median", "MB/step",
           "loss", "min", "median", "MB/step", "loss", "accel/DDP"
    for (h = 1; h <= 4; h++) {
      py = (hooks[h] == "none") ? "python_ddp_gloo" : "python_ddp_gloo_" hooks[h]
      ac = (hooks[h] == "none") ? "accel_env" : "accel_env_" hooks[h]
      line = sprintf("%-9s | ", hooks[h])
      if (n[py]) line = line sprintf("%7.1f %7.1f %8.2f %9.6f | ", wmin(py), wmed(py), med(by, py), med(ls, py))
      else line = line sprintf("%34s | ", "n/a")
      line = line sprintf("%7.1f %7.1f %8.2f %9.6f | ", wmin(ac), wmed(ac), med(by, ac), med(ls, ac))
      line = line (n[py] ? sprintf("%.2f", wmed(ac) / wmed(py)) : "-")
      print line
    }
  }
  function wmin(name,   i, m) {
    m = win[name, 1]
    for (i = 2; i <= nw[name]; i++) if (win[name, i] < m) m = win[name, i]
    return m
  }
  function wmed(name,   i, b) {
    for (i = 1; i <= nw[name]; i++) b[i] = win[name, i]
    return median(b, nw[name])
  }
  function med(a, name,   i, b) {
    for (i = 1; i <= n[name]; i++) b[i] = a[name, i]
    return median(b, n[name])
  }
  function median(b, k,   i, j, t) {
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (b[j] < b[i]) { t = b[i]; b[i] = b[j]; b[j] = t }
    if (!k) return 0
    return (k % 2) ? b[(k + 1) / 2] : (b[k / 2] + b[k / 2 + 1]) / 2
  }' "$log/results"
