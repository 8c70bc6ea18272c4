# cmake -P script: build TARGET in BUILD_DIR; succeed only if the build fails
# AND its output matches REGEX.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(_rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not (expected: ${REGEX})")
endif()
if(NOT _out MATCHES "${REGEX}")
  message(FATAL_ERROR "${TARGET} failed for another reason than '${REGEX}':\n${_out}")
endif()
message(STATUS "${TARGET} failed as expected: ${REGEX}")
