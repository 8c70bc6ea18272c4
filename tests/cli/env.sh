# accel env prints versions, backends, cores and the config in effect.
. "$(dirname "$0")/common.sh"
version="$3"

out=$("$ACCEL" env 2>&1) || fail "$out"
contains "$out" "accel version: $version"
contains "$out" "LibTorch version: "
contains "$out" "CUDA: "
contains "$out" "MPI: "
contains "$out" "Backends compiled in: SingleDevice, Gloo"
contains "$out" "CPU cores available: "
contains "$out" "Config file: $ACCEL_CONFIG_FILE (not found"

"$ACCEL" config --default --mixed_precision fp16 >/dev/null 2>&1 || fail "config --default failed"
out=$("$ACCEL" env 2>&1) || fail "$out"
contains "$out" "Config file: $ACCEL_CONFIG_FILE"
contains "$out" '"mixed_precision": "fp16"'
[ "$("$ACCEL" --version)" = "$version" ] || fail "--version is not $version"

# A garbage config file is named as unreadable, not dumped.
head -c 3000 /dev/urandom | tr -d '\000' > "$ACCEL_CONFIG_FILE"
printf '\n- [unbalanced\n' >> "$ACCEL_CONFIG_FILE"
out=$("$ACCEL" env 2>&1) || fail "$out"
contains "$out" "Config file: $ACCEL_CONFIG_FILE (unreadable: "
[ "$(printf '%s' "$out" | wc -c)" -lt 3000 ] || fail "accel env printed the raw file: $(printf '%s' "$out" | wc -c) bytes"
echo PASS
