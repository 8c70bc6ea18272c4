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
echo PASS
