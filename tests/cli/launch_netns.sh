# Two machines on a simulated network: two Linux network namespaces joined by
# a veth pair limited to 1 Gbit/s each way (tc tbf), one `accel launch
# --num_machines 2` per namespace, Gloo over the veth (GLOO_SOCKET_IFNAME), so
# the rendezvous, the store and every gradient cross a real non-loopback
# interface. For each communication hook (none, fp16, powersgd) the
# parameters after 20 steps equal, bit for bit, those of the same 2 processes
# launched on one machine over loopback, and the bytes the veth carried are
# checked against what the hook must send. Needs root (CI has it); without
# root, or where namespaces cannot be created (a container), it SKIPs.
. "$(dirname "$0")/common.sh"
PROBE="$3"

skip() {
  echo "SKIP: $*"
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "creating network namespaces needs root"
command -v ip >/dev/null && command -v tc >/dev/null ||
  fail "ip and tc (Debian's iproute2) are missing: tools/setup.sh installs them"

# Names unique to this run (an interface name has at most 15 characters).
A="accel-t$$-a" B="accel-t$$-b" DA="acct$$a" DB="acct$$b"
IP_A=10.231.78.1 IP_B=10.231.78.2
cleanup() {
  for n in "$A" "$B"; do
    pids=$(ip netns pids "$n" 2>/dev/null)
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
    ip netns del "$n" 2>/dev/null
  done
  ip link del "$DA" 2>/dev/null
  return 0
}
trap cleanup EXIT
trap 'exit 1' INT TERM
ip netns add "$A" 2>"$T/netns.err" || skip "cannot create a network namespace here: $(cat "$T/netns.err")"
ip netns exec "$A" true 2>"$T/netns.err" || skip "cannot enter a network namespace here: $(cat "$T/netns.err")"
ip netns add "$B" || fail "a second network namespace could not be created"
ip link add "$DA" type veth peer name "$DB" || fail "cannot create a veth pair"
for side in "$A $DA $IP_A" "$B $DB $IP_B"; do
  set -- $side
  ip link set "$2" netns "$1" &&
    ip netns exec "$1" ip addr add "$3/24" dev "$2" &&
    ip netns exec "$1" ip link set "$2" up &&
    ip netns exec "$1" ip link set lo up || fail "cannot set up $2 in $1"
  # 1 Gbit/s, a 256 KB burst, at most 50 ms of queue (no netem in this kernel).
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate 1gbit burst 256kb latency 50ms ||
    fail "tc tbf on $2 failed"
done

# One intra-op thread per process on both machine shapes: otherwise accel
# launch gives each process cores / local processes threads, and a matrix
# product split another way may round differently.
export OMP_NUM_THREADS=1

tx_bytes() {  # bytes sent so far by machine 0's end of the veth
  ip netns exec "$A" cat /proc/net/dev | sed 's/:/ /' | awk -v d="$DA" '$1 == d { print $10 }'
}

port=29500
for hook in none fp16 powersgd; do
  # Two machines, one process each, over the veth.
  port=$((port + 1))
  two="--num_processes 2 --num_machines 2 --main_process_ip $IP_A --main_process_port $port --rdzv_timeout 60"
  before=$(tx_bytes)
  ip netns exec "$B" env GLOO_SOCKET_IFNAME="$DB" timeout 120 \
    "$ACCEL" launch $two --machine_rank 1 "$PROBE" "$hook" "$T/m1_$hook.bin" >"$T/m1_$hook.out" 2>&1 &
  m1=$!
  out=$(ip netns exec "$A" env GLOO_SOCKET_IFNAME="$DA" timeout 120 \
    "$ACCEL" launch $two --machine_rank 0 "$PROBE" "$hook" "$T/two_$hook.bin" 2>&1) ||
    { kill $m1 2>/dev/null; fail "machine 0 ($hook): $out
machine 1: $(cat "$T/m1_$hook.out")"; }
  wait $m1 || fail "machine 1 ($hook): $(cat "$T/m1_$hook.out")"
  sent=$(( $(tx_bytes) - before ))
  contains "$out" "processes 2 hook $hook parameters"
  eval "sent_$hook=$sent"
  echo "$hook: two machines over the veth, machine 0 sent $sent bytes; $(printf '%s\n' "$out" | grep '^processes')"

  # The same 2 processes on one machine, over loopback.
  one=$("$ACCEL" launch --num_processes 2 --main_process_port 0 "$PROBE" "$hook" "$T/one_$hook.bin" 2>&1) ||
    fail "one machine ($hook): $one"
  cmp -s "$T/two_$hook.bin" "$T/one_$hook.bin" ||
    fail "$hook: the parameters after 20 steps differ between two machines and one machine"
  [ -s "$T/one_$hook.bin" ] || fail "$hook: no parameters written"

  # Against one process on the whole batches (LibTorch alone): no hook is the
  # same computation up to float rounding; fp16 rounds every gradient to 11
  # bits; PowerSGD is a different optimizer path (bytes checked instead).
  diff=$(printf '%s\n' "$out" | sed -n 's/.*max_abs_diff_vs_one_process \([^ ]*\).*/\1/p')
  params=$(printf '%s\n' "$out" | sed -n 's/.* parameters \([0-9]*\) .*/\1/p')
  case $hook in
    none) tol=1e-6 ;;
    fp16) tol=1e-4 ;;
    *) tol= ;;
  esac
  if [ -n "$tol" ]; then
    awk -v d="$diff" -v t="$tol" 'BEGIN { exit !(d != "" && d + 0 <= t + 0) }' ||
      fail "$hook: max |two machines - one process| = $diff, above $tol"
  fi
done

# Every step machine 1 needs, for each gradient element, machine 0's value or
# a sum that includes it: at least 20 x parameters x 4 bytes (2 with fp16)
# must cross the veth. Fp16 sends half of what none sends; PowerSGD rank 1
# all-reduces only its first 2 steps whole.
grad=$((20 * params * 4))
[ "$sent_none" -ge "$grad" ] || fail "no hook: the veth carried $sent_none bytes, less than 20 steps of gradients ($grad)"
[ "$sent_fp16" -ge $((grad / 2)) ] || fail "fp16: the veth carried $sent_fp16 bytes, less than 20 steps of fp16 gradients"
[ $((sent_fp16 * 10)) -le $((sent_none * 6)) ] || fail "fp16 sent $sent_fp16 bytes, more than 0.6 x no hook ($sent_none)"
[ $((sent_powersgd * 4)) -le "$sent_none" ] ||
  fail "powersgd sent $sent_powersgd bytes, more than 0.25 x no hook ($sent_none)"
[ -z "$(ip netns pids "$A")$(ip netns pids "$B")" ] || fail "processes were left running on the two machines"
pgrep -x "$(basename "$PROBE" | cut -c1-15)" >/dev/null && fail "a worker was left running"
echo PASS
