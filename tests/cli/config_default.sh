# accel config --default writes Accelerate's basic config, never overwrites it,
# and --config_file writes elsewhere.
. "$(dirname "$0")/common.sh"

out=$("$ACCEL" config --default --mixed_precision bf16 2>&1) || fail "accel config --default failed: $out"
contains "$out" "accel configuration saved at $ACCEL_CONFIG_FILE"
[ -f "$ACCEL_CONFIG_FILE" ] || fail "no file at $ACCEL_CONFIG_FILE"
text=$(cat "$ACCEL_CONFIG_FILE")
contains "$text" '"mixed_precision": "bf16"'
contains "$text" '"compute_environment": "LOCAL_MACHINE"'
contains "$text" '"num_machines": 1'

cp "$ACCEL_CONFIG_FILE" "$T/before"
out=$("$ACCEL" config --default --mixed_precision no 2>&1) || fail "second run failed: $out"
contains "$out" "will not override"
cmp -s "$ACCEL_CONFIG_FILE" "$T/before" || fail "an existing config file was overwritten"

out=$("$ACCEL" config --default --config_file "$T/other/dir/c.yaml" 2>&1) || fail "$out"
contains "$(cat "$T/other/dir/c.yaml")" '"mixed_precision": "no"'

out=$("$ACCEL" config --default --mixed_precision fp8 2>&1) && fail "fp8 was accepted"
contains "$out" "fp8"
echo PASS
