# MPI collectives of unit_runtime under mpirun (the hidden Catch tag [.mpi] is
# left out of the plain unit.runtime run): 2 and 3 ranks.
if(TARGET unit_runtime AND MPI_CXX_FOUND AND MPIEXEC_EXECUTABLE)
  foreach(_np 2 3)
    add_test(NAME unit.runtime.mpi.np${_np}
      COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe ${MPIEXEC_NUMPROC_FLAG} ${_np}
              $<TARGET_FILE:unit_runtime> "[mpi]")
    set_tests_properties(unit.runtime.mpi.np${_np} PROPERTIES TIMEOUT 300 PROCESSORS ${_np}
      ENVIRONMENT "ACCEL_TEST_TMP=${CMAKE_CURRENT_BINARY_DIR}/tmp")
  endforeach()
endif()
