# --max_restarts: a failing rank stops every rank and the group starts again,
# each attempt told by TORCHELASTIC_RESTART_COUNT; after the last allowed
# failure accel exits with its status, naming the rank and the attempt;
# --monitor_interval kills a process that stops heart-beating.
. "$(dirname "$0")/common.sh"
nap="60.$$"   # a sleep only this test starts, to look for in the process table

# Rank 1 fails on attempts 0 and 1 (exit 3, then SIGKILL); attempt 2 succeeds.
out=$("$ACCEL" launch -q --max_restarts 2 --num_processes 2 sh -c "
  echo \"\$TORCHELASTIC_RESTART_COUNT \$TORCHELASTIC_MAX_RESTARTS \$RANK \$\$\" >> '$T/starts'
  if [ \$RANK = 1 ] && [ \$TORCHELASTIC_RESTART_COUNT = 0 ]; then exit 3; fi
  if [ \$RANK = 1 ] && [ \$TORCHELASTIC_RESTART_COUNT = 1 ]; then kill -KILL \$\$; fi
  if [ \$TORCHELASTIC_RESTART_COUNT != 2 ]; then sleep $nap; fi" 2>&1)
rc=$?
[ "$rc" = 0 ] || fail "exit status $rc, expected 0: $out"
contains "$out" "process 1 failed on attempt 1 of 3: exited with status 3; process 0 was stopped. Restarting all 2 processes (restart 1 of 2)."
contains "$out" "process 1 failed on attempt 2 of 3: killed by signal SIGKILL"
[ "$(sort "$T/starts" | cut -d' ' -f1-3 | tr '\n' ,)" = "0 2 0,0 2 1,1 2 0,1 2 1,2 2 0,2 2 1," ] ||
  fail "attempts seen by the ranks: $(cat "$T/starts")"
[ "$(cut -d' ' -f4 "$T/starts" | sort -u | wc -l)" = 6 ] || fail "not 6 fresh processes: $(cat "$T/starts")"
no_process "sleep $nap"

# Failing on every attempt: 1 + 1 attempts, then rank 1's status, naming the attempt.
out=$("$ACCEL" launch -q --max_restarts 1 --num_processes 2 sh -c "if [ \$RANK = 1 ]; then exit 5; fi; sleep $nap" 2>&1)
rc=$?
[ "$rc" = 5 ] || fail "exit status $rc, expected 5: $out"
contains "$out" "rank 1 ("
contains "$out" "failed on attempt 2 of 2 (--max_restarts 1): exited with status 5"
no_process "sleep $nap"

# Without --max_restarts nothing restarts, and every rank sees restart count 0.
rm -f "$T/starts"
out=$("$ACCEL" launch -q --num_processes 2 sh -c "echo \$TORCHELASTIC_RESTART_COUNT >> '$T/starts'; if [ \$RANK = 1 ]; then exit 4; fi; sleep $nap" 2>&1)
rc=$?
[ "$rc" = 4 ] || fail "exit status $rc, expected 4: $out"
not_contains "$out" "attempt"
[ "$(tr '\n' , < "$T/starts")" = "0,0," ] || fail "restart counts: $(cat "$T/starts")"
no_process "sleep $nap"

# --monitor_interval: rank 1 beats once (touches its ACCEL_HEARTBEAT_FILE) and
# hangs; rank 0 goes on beating. Rank 1 is killed as hung within seconds.
start=$(now_ms)
out=$("$ACCEL" launch -q --monitor_interval 1 --num_processes 2 sh -c "
  touch \"\$ACCEL_HEARTBEAT_FILE\"
  if [ \$RANK = 1 ]; then sleep $nap; fi
  while :; do touch \"\$ACCEL_HEARTBEAT_FILE\"; sleep 0.1; done" 2>&1)
rc=$?
[ "$rc" = 137 ] || fail "exit status $rc after a hang, expected 137: $out"
[ "$(( $(now_ms) - start ))" -lt 15000 ] || fail "the hang took too long to detect"
contains "$out" "rank 1 ("
contains "$out" "made no progress (no heartbeat) for"
contains "$out" "more than the monitor interval of 1 s; it was killed as hung"
no_process "sleep $nap"

# Several machines are refused (a restart is decided on one machine).
out=$("$ACCEL" launch -q --max_restarts 1 --num_machines 2 --num_processes 2 --machine_rank 1 \
      --main_process_ip 127.0.0.1 --main_process_port 29999 sh -c "true" 2>&1)
rc=$?
[ "$rc" != 0 ] || fail "--max_restarts with 2 machines was accepted"
contains "$out" "is not supported"
echo PASS
