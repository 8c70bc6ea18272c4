# Tests of the `accel` command (tools/cli): each runs the built binary from a
# POSIX sh script under tests/cli/ with its own scratch directory.
if(TARGET accel_cli)
  foreach(_t config_default config_interactive launch_env launch_failure launch_ports launch_restart env
                 test_command)
    add_test(NAME cli.${_t}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/${_t}.sh $<TARGET_FILE:accel_cli>
              ${CMAKE_CURRENT_BINARY_DIR}/tmp/cli_${_t} ${PROJECT_VERSION})
    # The launch tests start 2 to 4 workers and bound how long things take.
    set(_processes 1)
    if(_t MATCHES "^launch_|^test_command$")
      set(_processes 2)
    endif()
    set_tests_properties(cli.${_t} PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS cli
                         PROCESSORS ${_processes})
  endforeach()

  # A real accel worker: ranks meet in the c10d store accel launch points them to.
  add_executable(accel_cli_probe ${CMAKE_CURRENT_SOURCE_DIR}/cli/rendezvous_probe.cpp)
  target_link_libraries(accel_cli_probe PRIVATE accel::accel)
  target_compile_options(accel_cli_probe PRIVATE -Wall -Wextra)
  add_test(NAME cli.launch_rendezvous
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/launch_rendezvous.sh $<TARGET_FILE:accel_cli>
            ${CMAKE_CURRENT_BINARY_DIR}/tmp/cli_launch_rendezvous $<TARGET_FILE:accel_cli_probe>)
  set_tests_properties(cli.launch_rendezvous PROPERTIES TIMEOUT 180 LABELS cli PROCESSORS 2)
endif()

# Two machines on a simulated network (two network namespaces and a veth pair,
# tests/cli/launch_netns.sh): needs root, SKIPs (77) where namespaces cannot
# be created.
if(TARGET accel_cli)
  add_executable(accel_cli_netns_train ${CMAKE_CURRENT_SOURCE_DIR}/cli/netns_train.cpp)
  target_link_libraries(accel_cli_netns_train PRIVATE accel::accel)
  target_compile_options(accel_cli_netns_train PRIVATE -Wall -Wextra $<$<CONFIG:Release>:-O0>)
  add_test(NAME cli.launch_netns
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/launch_netns.sh $<TARGET_FILE:accel_cli>
            ${CMAKE_CURRENT_BINARY_DIR}/tmp/cli_launch_netns $<TARGET_FILE:accel_cli_netns_train>)
  set_tests_properties(cli.launch_netns PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS cli PROCESSORS 2)
endif()
