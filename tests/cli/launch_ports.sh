# --main_process_port 0 picks a free port shared by all ranks; a fixed port
# that is taken is an error naming it and the way out.
. "$(dirname "$0")/common.sh"

out=$("$ACCEL" launch --num_processes 2 --main_process_port 0 sh -c 'echo "port=$MASTER_PORT"' 2>&1) || fail "$out"
p0=$(printf '%s\n' "$out" | sed -n 's/^port=//p' | sort -u)
[ "$(printf '%s\n' "$p0" | wc -l)" = 1 ] || fail "ranks saw different ports: $out"
[ "$p0" -gt 0 ] 2>/dev/null || fail "no port chosen: $out"
contains "$out" "using free port $p0"

out=$("$ACCEL" launch --num_machines 2 --num_processes 2 --main_process_ip 127.0.0.1 --main_process_port 0 true 2>&1) && fail "port 0 on two machines accepted"
contains "$out" "needs --rdzv_file PATH on a filesystem all machines share"

py=$(command -v /usr/bin/python3 || command -v python3) || { echo "SKIP: no python3 to hold a port"; exit 77; }
"$py" -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
time.sleep(30)' > "$T/port" &
holder=$!
i=0
while [ ! -s "$T/port" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
taken=$(cat "$T/port")
out=$("$ACCEL" launch --main_process_port "$taken" sh -c 'echo started' 2>&1)
rc=$?
kill $holder 2>/dev/null
wait $holder 2>/dev/null
[ "$rc" != 0 ] || fail "a taken port was accepted: $out"
contains "$out" "port $taken on 127.0.0.1 is already in use"
contains "$out" "--main_process_port 0"
not_contains "$out" "started"
echo PASS
