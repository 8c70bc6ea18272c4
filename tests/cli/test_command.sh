# accel test: the four checks pass with gloo (fp32, bf16 from the config file)
# and with mpi when compiled in; a failing or hanging check is named, with a
# non-zero exit; the temporary checkpoint directory is removed every time.
. "$(dirname "$0")/common.sh"
export TMPDIR="$T/tmp"   # accel test's scratch directory goes here: checked empty after each run
mkdir -p "$TMPDIR"

# (OpenMPI's singletons keep their own session directory there: not ours.)
no_scratch_left() {
  left=$(ls -A "$TMPDIR" | grep accel-test)
  [ -z "$left" ] || fail "accel test left $left in TMPDIR after: $1"
}

# expect_pass NAME "BACKEND, PRECISION, N processes" ARGS...: exit 0 and the
# five lines, in order, on stdout.
expect_pass() {
  name="$1"
  what="$2"
  shift 2
  out=$("$ACCEL" test "$@" 2>"$T/$name.err")
  rc=$?
  [ "$rc" = 0 ] || fail "accel test $* exited with $rc: $out $(cat "$T/$name.err")"
  backend=${what%%,*}
  printf '%s\n' "$out" > "$T/$name.out"
  [ "$(wc -l < "$T/$name.out")" = 5 ] || fail "expected 5 lines from accel test $*, got: $out"
  i=0
  while IFS= read -r line; do
    i=$((i + 1))
    case "$i:$line" in
      "1:rendezvous: 2 processes joined ($backend, 127.0.0.1:"[0-9]*")") ;;
      "2:all_reduce: sum of ranks' values [1, 2] = 3 on every rank (expected 3)") ;;
      "3:gradient sync: parameters after 3 steps equal one process's training on the whole batch (max diff "*" <= "*")") ;;
      "4:save_state/load_state: a resumed run's next step equals the uninterrupted one (bit-exact)") ;;
      "5:accel test: all checks passed ($what)") ;;
      *) printf '%s\n' "--- output was:" "$out" "---" >&2; fail "line $i of accel test $* is wrong: $line" ;;
    esac
  done < "$T/$name.out"
  no_scratch_left "accel test $*"
}

expect_pass gloo_fp32 "gloo, fp32, 2 processes" --backend gloo --mixed_precision no
contains "$(cat "$T/gloo_fp32.err")" "no config file at $ACCEL_CONFIG_FILE"
# fp32 data parallelism matches one process to rounding.
contains "$(cat "$T/gloo_fp32.out")" "<= 1e-05)"

# bf16 from the config file `accel config` writes.
"$ACCEL" config --default --mixed_precision bf16 >/dev/null 2>&1 || fail "accel config failed"
expect_pass gloo_bf16 "gloo, bf16, 2 processes"
contains "$(cat "$T/gloo_bf16.err")" "testing with the config file $ACCEL_CONFIG_FILE"

# MPI: runs where compiled in, else says why.
backends=$("$ACCEL" env 2>&1 | grep "Backends compiled in:")
case "$backends" in *Mpi*) with_mpi=yes ;; *) with_mpi=no ;; esac
case "$backends" in *Nccl*) with_nccl=yes ;; *) with_nccl=no ;; esac
if [ "$with_mpi" = yes ] && ! command -v ompi-server >/dev/null 2>&1; then
  # OpenMPI 5 (Debian 13) ships no ompi-server: MPI processes that mpirun did
  # not start cannot join, and accel test says so instead of hanging.
  out=$("$ACCEL" test --backend mpi --mixed_precision no 2>&1) && fail "--backend mpi passed without ompi-server: $out"
  contains "$out" "accel: \`accel test\` check 'rendezvous' failed on process "
  # Rank 0's own error is the one reported, whichever rank fails first (rank
  # 1 loses the store rank 0 serves, and says that rank 0 failed).
  contains "$out" "failed on process 0 "
  contains "$out" "needs OpenMPI's ompi-server, which is not on PATH"
  no_scratch_left "--backend mpi without ompi-server"
elif [ "$with_mpi" = yes ]; then
  expect_pass mpi "mpi, fp32, 2 processes" --backend mpi --mixed_precision no
  # An error of accel's own in a worker is passed on with the check it stopped.
  out=$(ACCEL_MPI_PROGRESS=bad "$ACCEL" test --backend mpi 2>&1) && fail "a bad ACCEL_MPI_PROGRESS passed: $out"
  contains "$out" "accel: \`accel test\` check 'rendezvous' failed on process "
  contains "$out" "ACCEL_MPI_PROGRESS='bad' is not a progress mode"
  no_scratch_left "a bad ACCEL_MPI_PROGRESS"
else
  out=$("$ACCEL" test --backend mpi 2>&1) && fail "--backend mpi passed without MPI: $out"
  contains "$out" "accel: backend mpi: MPI is not compiled into this accel"
fi
if [ "$with_nccl" = no ]; then
  out=$("$ACCEL" test --backend nccl 2>&1) && fail "--backend nccl passed without NCCL: $out"
  contains "$out" "accel: backend nccl: NCCL is not compiled into this accel"
  out=$("$ACCEL" test --mixed_precision fp16 2>&1) && fail "fp16 passed without CUDA: $out"
  contains "$out" "accel: mixed precision fp16: fp16 needs CUDA devices"
fi

# Refused before any process starts.
out=$("$ACCEL" test --num_processes 0 2>&1) && fail "--num_processes 0 was accepted: $out"
contains "$out" "accel: --num_processes 0: \`accel test\` checks how processes work together and needs at least 2"
printf 'distributed_type: MULTI_CPU\nmixed_precision: [bf16\n' > "$T/broken.yaml"
out=$("$ACCEL" test --config_file "$T/broken.yaml" 2>&1) && fail "a broken config file was accepted"
contains "$out" "accel: $T/broken.yaml:"
contains "$out" "not valid YAML or JSON"
out=$("$ACCEL" test --config_file "$T/missing.yaml" 2>&1) && fail "a missing config file was accepted"
contains "$out" "accel: config file $T/missing.yaml does not exist"
no_scratch_left "the refused runs"

# A check that finds a wrong result names itself and the cause; exit 1.
for pair in "all_reduce:the sum of the values 1..2 arrived as 4, expected 3" \
            "gradient sync:differ from one process's training on the whole batch by" \
            "save_state/load_state:the step after load_state differs from the uninterrupted run's"; do
  check=${pair%%:*}
  cause=${pair#*:}
  out=$(ACCEL_TEST_INJECT="wrong:$check" "$ACCEL" test --mixed_precision no 2>&1)
  rc=$?
  [ "$rc" = 1 ] || fail "a wrong $check exited with $rc, expected 1: $out"
  contains "$out" "accel: \`accel test\` check '$check' failed on process "
  contains "$out" "$cause"
  contains "$out" "accel env"
  not_contains "$out" "all checks passed"
  no_scratch_left "a wrong $check"
done

# A hang is bounded by --timeout: every process stopped, exit 124, and the
# message says which check and what each process waited for.
mkdir -p "$T/stall"
cp "$ACCEL_CONFIG_FILE" "$T/stall/config.yaml"   # its path marks this run's processes
start=$(now_ms)
out=$(ACCEL_TEST_INJECT="stall:gradient sync" "$ACCEL" test --mixed_precision no --timeout 8 \
      --config_file "$T/stall/config.yaml" 2>&1)
rc=$?
took=$(( $(now_ms) - start ))
[ "$rc" = 124 ] || fail "a hang exited with $rc, expected 124: $out"
[ "$took" -lt 30000 ] || fail "--timeout 8 took $took ms"
contains "$out" "check 'gradient sync' did not finish within --timeout 8 s; every process was stopped."
contains "$out" "process 1 was in 'gradient sync', waiting for the gradient all-reduces"
contains "$out" "larger --timeout"
no_process "$T/stall/config.yaml"
no_scratch_left "a hang"

# accel hands the command to accel-test beside it; without it, it says so.
mkdir -p "$T/lonely"
cp "$ACCEL" "$T/lonely/accel"
out=$("$T/lonely/accel" test 2>&1) && fail "accel test without accel-test passed: $out"
contains "$out" "accel: \`accel test\` runs $T/lonely/accel-test, which could not be started"
# and accel itself starts without LibTorch (a CUDA build links it to count devices).
if [ "$with_nccl" = no ] && command -v ldd >/dev/null; then
  not_contains "$(ldd "$ACCEL")" "libtorch"
fi
echo PASS
