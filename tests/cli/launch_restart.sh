# --max_restarts: a failing rank stops every rank and the group starts again,
# each attempt told by TORCHELASTIC_RESTART_COUNT; after the last allowed
# failure accel exits with its status, naming the rank and the attempt;
# --monitor_interval kills a process that stops heart-beating; over two
# machines a failure on either restarts both, and a lost machine rejoins.
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

# Two machines on this one (loopback), 2 processes each. machine M runs
# "accel launch --machine_rank M"; `exec` so that $! is the launcher itself.
port=$("$ACCEL" launch -q --main_process_port 0 sh -c 'echo $MASTER_PORT') || fail "no free port"
machine() {  # machine RANK MAX_RESTARTS SCRIPT [FLAGS...]
  m=$1 r=$2 script=$3
  shift 3
  exec "$ACCEL" launch -q --max_restarts "$r" --num_machines 2 --num_processes 4 --machine_rank "$m" \
       --main_process_ip 127.0.0.1 --main_process_port "$port" "$@" sh -c "$script"
}

# Rank 3 (machine 1) dies by SIGKILL on attempt 0: the processes of both
# machines stop within seconds (not after their 60 s sleep) and both machines
# start attempt 1 together, with a new job id and a shared worker port.
script="echo \"\$TORCHELASTIC_RESTART_COUNT \$RANK \$MASTER_PORT \$ACCEL_JOB_ID\" >> '$T/starts2'
  if [ \$RANK = 3 ] && [ \$TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 1; kill -KILL \$\$; fi
  if [ \$TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep $nap; fi"
start=$(now_ms)
machine 0 1 "$script" > "$T/m0.out" 2>&1 & p0=$!
machine 1 1 "$script" > "$T/m1.out" 2>&1 & p1=$!
wait $p0; rc0=$?
wait $p1; rc1=$?
[ "$rc0" = 0 ] && [ "$rc1" = 0 ] || fail "exit statuses $rc0 / $rc1: $(cat "$T/m0.out" "$T/m1.out")"
[ "$(( $(now_ms) - start ))" -lt 30000 ] || fail "the restart over two machines took $(( $(now_ms) - start )) ms"
for f in m0 m1; do
  contains "$(cat "$T/$f.out")" "process 3 failed on attempt 1 of 2: killed by signal SIGKILL"
  contains "$(cat "$T/$f.out")" "Restarting all 4 processes on 2 machines (restart 1 of 1)."
done
[ "$(cut -d' ' -f1-2 "$T/starts2" | sort | tr '\n' ,)" = "0 0,0 1,0 2,0 3,1 0,1 1,1 2,1 3," ] ||
  fail "attempts seen by the ranks: $(cat "$T/starts2")"
for a in 0 1; do  # one worker port and one job id per attempt, on both machines
  [ "$(grep "^$a " "$T/starts2" | cut -d' ' -f3,4 | sort -u | wc -l)" = 1 ] || fail "attempt $a: $(cat "$T/starts2")"
  [ -n "$(grep "^$a " "$T/starts2" | head -1 | cut -d' ' -f4)" ] || fail "attempt $a has no job id"
done
[ "$(cut -d' ' -f4 "$T/starts2" | sort -u | wc -l)" = 2 ] || fail "job ids: $(cat "$T/starts2")"
no_process "sleep $nap"

# Machine 1 dies completely (its launcher SIGKILLed) and is started again: it
# rejoins, and attempt 1 runs on both machines.
# (`exec sleep`: a worker whose launcher is killed dies with it, PR_SET_PDEATHSIG,
# but not what it started itself.)
script="echo \"\$TORCHELASTIC_RESTART_COUNT \$RANK\" >> '$T/starts3'
  if [ \$TORCHELASTIC_RESTART_COUNT = 0 ]; then exec sleep $nap; fi"
machine 0 1 "$script" > "$T/m0.out" 2>&1 & p0=$!
machine 1 1 "$script" > "$T/m1.out" 2>&1 & p1=$!
i=0
while [ "$(cat "$T/starts3" 2>/dev/null | wc -l)" -lt 4 ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i + 1)); done
kill -KILL $p1
wait $p1 2>/dev/null
sleep 1
machine 1 1 "$script" > "$T/m1b.out" 2>&1 & p1=$!
wait $p0; rc0=$?
wait $p1; rc1=$?
[ "$rc0" = 0 ] && [ "$rc1" = 0 ] || fail "exit statuses $rc0 / $rc1: $(cat "$T/m0.out" "$T/m1b.out")"
contains "$(cat "$T/m0.out")" "process 2 failed on attempt 1 of 2: machine 1 (processes 2-3) was lost: its launcher's connection to machine 0 closed"
contains "$(cat "$T/m0.out")" "Restarting all 4 processes on 2 machines (restart 1 of 1)."
[ "$(sort "$T/starts3" | tr '\n' ,)" = "0 0,0 1,0 2,0 3,1 0,1 1,1 2,1 3," ] || fail "attempts: $(cat "$T/starts3")"
no_process "sleep $nap"

# Rank 1 (machine 0) fails on every attempt: machine 1's processes are
# stopped at once each time (not after their 60 s sleep), and both machines
# stop after 2 attempts, naming rank 1 and exiting with its status.
start=$(now_ms)
machine 0 1 "if [ \$RANK = 1 ]; then exit 5; fi; sleep $nap" > "$T/m0.out" 2>&1 & p0=$!
machine 1 1 "if [ \$RANK = 1 ]; then exit 5; fi; sleep $nap" > "$T/m1.out" 2>&1 & p1=$!
wait $p0; rc0=$?
wait $p1; rc1=$?
[ "$rc0" = 5 ] && [ "$rc1" = 5 ] || fail "exit statuses $rc0 / $rc1, expected 5: $(cat "$T/m0.out" "$T/m1.out")"
[ "$(( $(now_ms) - start ))" -lt 40000 ] || fail "machine 1 was not stopped with machine 0: $(( $(now_ms) - start )) ms"
for f in m0 m1; do
  contains "$(cat "$T/$f.out")" "failed on attempt 2 of 2 (--max_restarts 1): exited with status 5"
  contains "$(cat "$T/$f.out")" "rank 1 ("
  contains "$(cat "$T/$f.out")" "processes 0, 2, 3 were stopped"
done
no_process "sleep $nap"

# A machine that never comes: machine 0 gives up after --rdzv_timeout, naming it.
start=$(now_ms)
out=$(machine 0 1 "true" --rdzv_timeout 2 2>&1)
rc=$?
[ "$rc" != 0 ] || fail "machine 0 succeeded without machine 1: $out"
[ "$(( $(now_ms) - start ))" -lt 15000 ] || fail "machine 0 waited too long for machine 1"
contains "$out" "machine 1 did not join the launch at 127.0.0.1:$port within 2 s"
echo PASS
