# Real rendezvous through accel launch: the ranks of a port-0 launch meet on the
# port accel chose, and two launchers (machine ranks 0 and 1 on this host) form
# one world of 4 through the main machine's store.
. "$(dirname "$0")/common.sh"
PROBE="$3"

out=$("$ACCEL" launch --num_processes 2 --main_process_port 0 "$PROBE" 2>&1) || fail "$out"
contains "$out" "rank 0/2 met all ranks"
contains "$out" "rank 1/2 met all ranks"

port=$("$ACCEL" launch -q --main_process_port 0 sh -c 'echo $MASTER_PORT') || fail "no free port"
two="--num_processes 4 --num_machines 2 --main_process_ip 127.0.0.1 --main_process_port $port"
"$ACCEL" launch $two --machine_rank 1 "$PROBE" > "$T/machine1.out" 2>&1 &
m1=$!
out=$("$ACCEL" launch $two --machine_rank 0 "$PROBE" 2>&1) || { kill $m1; fail "machine 0: $out"; }
wait $m1 || fail "machine 1: $(cat "$T/machine1.out")"
contains "$out" "rank 0/4 met all ranks on port $port nodes=0,0,1,1"
contains "$out" "rank 1/4 met all ranks"
contains "$(cat "$T/machine1.out")" "rank 3/4 met all ranks on port $port nodes=0,0,1,1"

# Port 0 on two machines: machine 0 chooses, machine 1 learns it through the
# shared rendezvous file (started first, it waits for the file); the file is
# gone after the launch.
rdzv="$T/rdzv"
two0="--num_processes 4 --num_machines 2 --main_process_ip 127.0.0.1 --main_process_port 0 --rdzv_file $rdzv"
"$ACCEL" launch $two0 --machine_rank 1 "$PROBE" > "$T/machine1b.out" 2>&1 &
m1=$!
sleep 0.5
out=$("$ACCEL" launch $two0 --machine_rank 0 "$PROBE" 2>&1) || { kill $m1; fail "machine 0 (port 0): $out"; }
wait $m1 || fail "machine 1 (port 0): $(cat "$T/machine1b.out")"
chosen=$(printf '%s\n' "$out" | sed -n 's/.*chose free port \([0-9]*\).*/\1/p')
[ -n "$chosen" ] || fail "machine 0 did not say which port it chose: $out"
contains "$out" "rank 0/4 met all ranks on port $chosen nodes=0,0,1,1"
contains "$(cat "$T/machine1b.out")" "machine 0 chose port $chosen"
contains "$(cat "$T/machine1b.out")" "rank 3/4 met all ranks on port $chosen nodes=0,0,1,1"
[ ! -e "$rdzv" ] || fail "the rendezvous file was left behind"

# One machine started alone says what it waits for, and gives up after
# --rdzv_timeout naming the address and who is missing.
port2=$("$ACCEL" launch -q --main_process_port 0 sh -c 'echo $MASTER_PORT') || fail "no free port"
alone="--num_processes 4 --num_machines 2 --main_process_ip 127.0.0.1 --main_process_port $port2 --rdzv_timeout 7"
out=$("$ACCEL" launch $alone --machine_rank 1 "$PROBE" 2>&1) && fail "machine 1 alone succeeded: $out"
contains "$out" "waiting for rank 0 at 127.0.0.1:$port2"
contains "$out" "could not rendezvous with 127.0.0.1:$port2"
out=$("$ACCEL" launch $alone --machine_rank 0 "$PROBE" 2>&1) && fail "machine 0 alone succeeded: $out"
contains "$out" "waiting at 127.0.0.1:$port2 for the other processes (2 of 4 joined, missing ranks 2, 3 (machine 1)"
contains "$out" "missing: ranks 2, 3 (machine 1)"
# --debug checks machine 0's address first: one that does not resolve fails at
# once ("no..such.host" is refused by the resolver without a query).
start=$(now_ms)
out=$("$ACCEL" launch --debug --num_processes 2 --num_machines 2 --machine_rank 1 \
      --main_process_ip no..such.host --main_process_port 29999 "$PROBE" 2>&1) && fail "--debug accepted no..such.host"
contains "$out" "cannot resolve master_addr 'no..such.host'"
[ "$(( $(now_ms) - start ))" -lt 5000 ] || fail "the address check took too long"

# No port given, several machines, a rendezvous file, and the default port 29500
# taken on machine 0: it moves to a free port and machine 1 follows.
py=$(command -v /usr/bin/python3) || fail "python3 is missing (tools/setup.sh installs it)"
"$py" -c '
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("0.0.0.0", 29500)); s.listen(1)
except OSError:
    pass  # already taken by someone else: the case holds as well
print("held", flush=True)
time.sleep(60)' > "$T/held" &
holder=$!
i=0
while [ ! -s "$T/held" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
twoU="--num_processes 4 --num_machines 2 --main_process_ip 127.0.0.1 --rdzv_file $rdzv"
"$ACCEL" launch $twoU --machine_rank 1 "$PROBE" > "$T/machine1c.out" 2>&1 &
m1=$!
out=$("$ACCEL" launch $twoU --machine_rank 0 "$PROBE" 2>&1) || { kill $m1 $holder; fail "machine 0 (29500 taken): $out"; }
wait $m1 || { kill $holder; fail "machine 1 (29500 taken): $(cat "$T/machine1c.out")"; }
kill $holder 2>/dev/null; wait $holder 2>/dev/null
moved=$(printf '%s\n' "$out" | sed -n 's/.*default port 29500 is in use; chose free port \([0-9]*\).*/\1/p')
[ -n "$moved" ] || fail "machine 0 did not move off the taken port 29500: $out"
contains "$(cat "$T/machine1c.out")" "rank 3/4 met all ranks on port $moved nodes=0,0,1,1"
[ ! -e "$rdzv" ] || fail "the rendezvous file was left behind (29500 case)"
echo PASS
