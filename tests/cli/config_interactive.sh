# accel config asks its questions on stdin/stdout: a bad answer is asked
# again, the answers land in the file, and the end of input is an error.
. "$(dirname "$0")/common.sh"

# machine type, backend, machines, processes (bad, then 3), debug, precision
out=$(printf 'MULTI_CPU\ngloo\n1\nthree\n3\nyes\n2\n' | "$ACCEL" config 2>&1) || fail "accel config failed: $out"
contains "$out" "Which type of machine are you using?"
contains "$out" "'three' is not a valid answer"
contains "$out" "accel configuration saved at $ACCEL_CONFIG_FILE"
text=$(cat "$ACCEL_CONFIG_FILE")
contains "$text" "distributed_type: MULTI_CPU"
contains "$text" "backend: gloo"
contains "$text" "num_processes: 3"
contains "$text" "debug: true"
contains "$text" "mixed_precision: bf16"
contains "$text" "use_cpu: true"

# The file drives accel launch: 3 processes, bf16, debug mode.
out=$("$ACCEL" launch sh -c 'echo "rank=$RANK/$WORLD_SIZE mp=$ACCEL_MIXED_PRECISION dbg=$ACCEL_DEBUG_MODE be=$ACCEL_BACKEND"' 2>&1) || fail "$out"
contains "$out" "rank=2/3 mp=bf16 dbg=yes be=gloo"

# Two machines: rank, address and port are asked and written.
out=$(printf '1\n\n2\n5\n1\n10.1.2.3\n\n\n4\n\nfp16\n' | "$ACCEL" config --config_file "$T/two.yaml" 2>&1) || fail "$out"
contains "$out" "'5' is not a valid answer"
text=$(cat "$T/two.yaml")
contains "$text" "num_machines: 2"
contains "$text" "machine_rank: 1"
contains "$text" "main_process_ip: 10.1.2.3"
contains "$text" "main_process_port: 29500"
contains "$text" "num_processes: 4"

# --mixed_precision answers that question in advance.
out=$(printf '0\n' | "$ACCEL" config --mixed_precision fp16 --config_file "$T/mp.yaml" 2>&1) || fail "$out"
not_contains "$out" "mixed precision?"
contains "$(cat "$T/mp.yaml")" "mixed_precision: fp16"
contains "$(cat "$T/mp.yaml")" "num_processes: 1"

out=$(printf '1\n' | "$ACCEL" config --config_file "$T/eof.yaml" 2>&1) && fail "end of input was accepted"
contains "$out" "the input ended before"
[ ! -f "$T/eof.yaml" ] || fail "a file was written from incomplete answers"
echo PASS
