# Packaging: a project that uses an installed accel (find_package) and one
# that embeds it (add_subdirectory) both configure, build and run. They build
# without optimization (no build type): they check packaging, and -O3 was
# half of their time on CI's 2 cores.
set(_consumers ${CMAKE_CURRENT_BINARY_DIR}/consumers)
add_test(NAME cmake.install
  COMMAND ${CMAKE_COMMAND} --install ${PROJECT_BINARY_DIR} --prefix ${_consumers}/prefix)
set_tests_properties(cmake.install PROPERTIES FIXTURES_SETUP accel_installed TIMEOUT 120)

add_test(NAME cmake.find_package
  COMMAND ${CMAKE_CTEST_COMMAND} --build-and-test
          ${CMAKE_CURRENT_SOURCE_DIR}/cmake/find_package ${_consumers}/find_package
          --build-generator ${CMAKE_GENERATOR} --build-target consumer
          --build-options -DCMAKE_PREFIX_PATH=${_consumers}/prefix -DCMAKE_BUILD_TYPE=
            -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
          --test-command consumer)
set_tests_properties(cmake.find_package PROPERTIES FIXTURES_REQUIRED accel_installed TIMEOUT 900)

add_test(NAME cmake.add_subdirectory
  COMMAND ${CMAKE_CTEST_COMMAND} --build-and-test
          ${CMAKE_CURRENT_SOURCE_DIR}/cmake/add_subdirectory ${_consumers}/add_subdirectory
          --build-generator ${CMAKE_GENERATOR} --build-target consumer
          --build-options -DACCEL_SOURCE_DIR=${PROJECT_SOURCE_DIR} -DCMAKE_BUILD_TYPE=
            -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
          --test-command consumer)
set_tests_properties(cmake.add_subdirectory PROPERTIES TIMEOUT 900)
