# ZeRO-1/2/3 against Replicate on workload W (~10M parameters, 2 Gloo processes
# forked by accel's launcher): slower than the rest of unit.parallel, so a
# ctest of its own.
if(TARGET unit_parallel)
  add_test(NAME unit.parallel.zero_w COMMAND unit_parallel "[zero_w]")
  set_tests_properties(unit.parallel.zero_w PROPERTIES TIMEOUT 900 PROCESSORS 2
    ENVIRONMENT "ACCEL_TEST_TMP=${CMAKE_CURRENT_BINARY_DIR}/tmp")
endif()
