# The single header single_include/accel/accel.hpp (tools/amalgamate.py):
#   ctest amalgamate.up_to_date   the committed file equals a fresh generation
#   ctest amalgamate.selftest     the script's own behaviour on small trees
#   target accel_amalgamate       rewrites the committed file
#   unit_single_include           a test built against the single header only
# The script needs only Python's standard library; Debian's /usr/bin/python3 first.
find_program(ACCEL_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT ACCEL_PYTHON3)
  find_program(ACCEL_PYTHON3 NAMES python3)
endif()

if(ACCEL_PYTHON3)
  set(_accel_amalgamate ${accel_SOURCE_DIR}/tools/amalgamate.py)
  add_test(NAME amalgamate.up_to_date COMMAND ${ACCEL_PYTHON3} ${_accel_amalgamate} --check)
  set_tests_properties(amalgamate.up_to_date PROPERTIES TIMEOUT 60)
  add_test(NAME amalgamate.selftest
    COMMAND ${ACCEL_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/../single_include/test_amalgamate.py)
  set_tests_properties(amalgamate.selftest PROPERTIES TIMEOUT 60)
  add_custom_target(accel_amalgamate
    COMMAND ${ACCEL_PYTHON3} ${_accel_amalgamate}
    WORKING_DIRECTORY ${accel_SOURCE_DIR}
    COMMENT "Regenerating single_include/accel/accel.hpp from include/accel"
    VERBATIM)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../single_include ${CMAKE_CURRENT_BINARY_DIR}/single_include)
else()
  message(STATUS "accel: python3 not found; amalgamate.up_to_date and the single-header test are off")
endif()
