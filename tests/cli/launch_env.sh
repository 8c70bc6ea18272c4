# accel launch gives every rank its variables; flags override the config file,
# which overrides the defaults; --prefix_output prefixes lines.
. "$(dirname "$0")/common.sh"
show='echo "R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE N=$NODE_RANK A=$MASTER_ADDR P=$MASTER_PORT MP=$ACCEL_MIXED_PRECISION T=$OMP_NUM_THREADS"'

# Free ports, not fixed ones: other tests run at the same time (ctest -j).
port=$("$ACCEL" launch -q --main_process_port 0 sh -c 'echo $MASTER_PORT') || fail "no free port"
out=$(env -u OMP_NUM_THREADS "$ACCEL" launch --num_processes 2 --main_process_port $port /bin/sh -c "$show" 2>&1) || fail "$out"
contains "$out" "R=0 W=2 L=0 LW=2 N=0 A=127.0.0.1 P=$port MP=no T="
contains "$out" "R=1 W=2 L=1 LW=2 N=0 A=127.0.0.1 P=$port MP=no T="
contains "$out" "no config file at"

out=$("$ACCEL" launch --num_processes 2 --prefix_output -- sh -c 'echo out $RANK; echo err $RANK >&2' 2>&1) || fail "$out"
contains "$out" "[rank 0] out 0"
contains "$out" "[rank 1] err 1"

out=$("$ACCEL" launch --num_processes 2 --tee 3 sh -c 'echo teed $RANK' 2>&1) || fail "$out"
contains "$out" "[rank 1] teed 1"

# A machine set up with `accelerate config` only: its file is used.
mkdir -p "$T/hf/accelerate"
printf 'num_processes: 3\nmixed_precision: fp16\n' > "$T/hf/accelerate/default_config.yaml"
out=$(HF_HOME="$T/hf" "$ACCEL" launch sh -c "$show" 2>&1) || fail "$out"
contains "$out" "reading Accelerate's config file $T/hf/accelerate/default_config.yaml"
contains "$out" "R=2 W=3"

# The program's own flags are not accel's.
out=$("$ACCEL" launch --num_processes 1 sh -c 'echo "args:$*"' x --num_processes 9 2>&1) || fail "$out"
contains "$out" "args:--num_processes 9"

# Config file < flags.
port2=$("$ACCEL" launch -q --main_process_port 0 sh -c 'echo $MASTER_PORT') || fail "no free port"
printf 'mixed_precision: fp16\nnum_processes: 3\nmain_process_port: %s\nunknown_key: 1\n' "$port2" > "$T/c.yaml"
out=$("$ACCEL" launch --config_file "$T/c.yaml" sh -c "$show" 2>&1) || fail "$out"
contains "$out" "R=2 W=3"
contains "$out" "P=$port2 MP=fp16"
contains "$out" "key 'unknown_key'"
out=$("$ACCEL" launch --config_file "$T/c.yaml" --num_processes 2 --mixed_precision bf16 sh -c "$show" 2>&1) || fail "$out"
contains "$out" "R=1 W=2"
not_contains "$out" "R=2"
contains "$out" "MP=bf16"

# One of two machines: ranks are offset, nothing is hosted here.
out=$("$ACCEL" launch --num_processes 4 --num_machines 2 --machine_rank 1 --main_process_ip 10.9.9.9 sh -c "$show" 2>&1) || fail "$out"
contains "$out" "R=3 W=4 L=1 LW=2 N=1 A=10.9.9.9"

out=$("$ACCEL" launch --num_processes 3 --num_machines 2 --main_process_ip 10.9.9.9 true 2>&1) && fail "3 processes on 2 machines accepted"
contains "$out" "not a multiple of --num_machines 2"
out=$("$ACCEL" launch --num_processes 1 no-such-program-accel 2>&1)
rc=$?
[ "$rc" = 127 ] || fail "exit status $rc for a missing program, expected 127: $out"
contains "$out" "cannot execute 'no-such-program-accel'"
echo PASS
