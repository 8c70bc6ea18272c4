# A failing rank stops the others quickly, accel exits with its status, and
# nothing is left running; SIGTERM to accel is forwarded to every rank.
. "$(dirname "$0")/common.sh"
nap="60.$$"   # a sleep only this test starts, to look for in the process table

start=$(now_ms)
out=$("$ACCEL" launch --num_processes 2 sh -c "if [ \$RANK = 1 ]; then exit 3; fi; sleep $nap" 2>&1)
rc=$?
took=$(( $(now_ms) - start ))
[ "$rc" = 3 ] || fail "exit status $rc, expected 3: $out"
[ "$took" -lt 20000 ] || fail "took $took ms to stop after rank 1 failed"
contains "$out" "rank 1"
contains "$out" "exited with status 3"
no_process "sleep $nap"

# A rank killed by a signal: 128 + 9.
out=$("$ACCEL" launch --num_processes 2 sh -c "if [ \$RANK = 0 ]; then kill -KILL \$\$; fi; sleep $nap" 2>&1)
rc=$?
[ "$rc" = 137 ] || fail "exit status $rc, expected 137: $out"
contains "$out" "rank 0"
no_process "sleep $nap"

# SIGTERM or SIGINT to accel reaches every rank (and what they started).
for pair in TERM:143 INT:130; do
  sig=${pair%:*}
  expected=${pair#*:}
  "$ACCEL" launch --num_processes 2 sh -c "sleep $nap" > "$T/sig.out" 2>&1 &
  pid=$!
  i=0
  while [ "$(pgrep -f "sleep $nap" | wc -l)" -lt 2 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  [ $i -lt 100 ] || fail "the ranks did not start"
  start=$(now_ms)
  kill -$sig $pid
  wait $pid
  rc=$?
  took=$(( $(now_ms) - start ))
  [ "$rc" = "$expected" ] || fail "exit status $rc after SIG$sig, expected $expected: $(cat "$T/sig.out")"
  [ "$took" -lt 20000 ] || fail "took $took ms to stop after SIG$sig"
  contains "$(cat "$T/sig.out")" "SIG$sig"
  no_process "sleep $nap"
done

# --timeout bounds the whole launch: every process is stopped, exit 124.
start=$(now_ms)
out=$("$ACCEL" launch --timeout 2 --num_processes 2 sh -c "sleep $nap" 2>&1)
rc=$?
[ "$rc" = 124 ] || fail "exit status $rc after --timeout, expected 124: $out"
[ "$(( $(now_ms) - start ))" -lt 15000 ] || fail "--timeout 2 took too long"
contains "$out" "ran past --timeout 2 s"
no_process "sleep $nap"

# A typo in the process count starts nothing, within a second.
start=$(now_ms)
out=$("$ACCEL" launch --num_processes 100000 sh -c "sleep $nap" 2>&1)
rc=$?
[ "$rc" != 0 ] || fail "100000 processes were accepted"
[ "$(( $(now_ms) - start ))" -lt 5000 ] || fail "refusing 100000 processes took too long"
contains "$out" "100000 processes on this machine is more than"
no_process "sleep $nap"
echo PASS
