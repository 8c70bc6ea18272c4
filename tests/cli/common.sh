# Sourced by the accel command tests: $1 is the built `accel`, $2 a scratch
# directory (emptied here). POSIX sh, so that it runs under dash.
set -u
ACCEL="$1"
T="$2"
rm -rf "$T"
mkdir -p "$T"
export ACCEL_CONFIG_FILE="$T/default_config.yaml"
export HF_HOME="$T/no-hf-home"  # an Accelerate config of the user running the tests is not read

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# contains TEXT NEEDLE: fails (showing TEXT) unless NEEDLE occurs in it.
contains() {
  case "$1" in
    *"$2"*) ;;
    *) printf '%s\n' "--- output was:" "$1" "---" >&2; fail "expected to find: $2" ;;
  esac
}

not_contains() {
  case "$1" in
    *"$2"*) printf '%s\n' "--- output was:" "$1" "---" >&2; fail "did not expect: $2" ;;
    *) ;;
  esac
}

# no_process PATTERN: fails when a process whose command line matches is alive.
no_process() {
  if pgrep -f "$1" >/dev/null 2>&1; then
    ps -eo pid,ppid,pgid,args | grep -F "$1" | grep -v grep >&2
    pkill -KILL -f "$1"
    fail "processes matching '$1' were left running"
  fi
}

now_ms() { date +%s%3N; }
