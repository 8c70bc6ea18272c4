# The data-parallel equivalence under mpirun (the Gloo cases fork through
# accel's own launcher inside unit.parallel).
if(MPI_CXX_FOUND AND TARGET unit_parallel)
  add_test(NAME mpi.parallel.equivalence
    COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2
            $<TARGET_FILE:unit_parallel> "[mpi]")
  set_tests_properties(mpi.parallel.equivalence PROPERTIES TIMEOUT 600 PROCESSORS 2
    ENVIRONMENT "ACCEL_TEST_TMP=${CMAKE_CURRENT_BINARY_DIR}/tmp;OMPI_MCA_rmaps_base_oversubscribe=1")
endif()
