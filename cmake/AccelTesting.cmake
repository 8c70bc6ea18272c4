# Helpers for accel's tests (installed, so users can write the same tests).

# accel_add_compile_fail_test(NAME <name> SOURCE <file> REGEX <regex>)
# The source must NOT compile, and the compiler output must match REGEX; both
# are required (PASS_REGULAR_EXPRESSION alone would ignore the exit code).
function(accel_add_compile_fail_test)
  # NO_PCH: a test of what a header alone gives (the precompiled header has all of accel).
  cmake_parse_arguments(A "NO_PCH" "NAME;SOURCE;REGEX" "" ${ARGN})
  set(_target compile_fail_${A_NAME})
  add_executable(${_target} EXCLUDE_FROM_ALL ${A_SOURCE})
  target_link_libraries(${_target} PRIVATE accel::accel)
  if(TARGET accel_test_pch AND NOT A_NO_PCH)
    target_precompile_headers(${_target} REUSE_FROM accel_test_pch)
    target_link_libraries(${_target} PRIVATE accel_test_catch)
  endif()
  add_test(NAME compile_fail.${A_NAME}
    COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${CMAKE_BINARY_DIR} -DTARGET=${_target}
            "-DREGEX=${A_REGEX}" -P ${PROJECT_SOURCE_DIR}/cmake/CheckCompileFail.cmake)
  set_tests_properties(compile_fail.${A_NAME} PROPERTIES RESOURCE_LOCK accel_build_tree TIMEOUT 900)
endfunction()
