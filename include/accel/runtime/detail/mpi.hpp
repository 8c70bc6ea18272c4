// SPDX-License-Identifier: Apache-2.0
/// @file Includes MPI's C interface, the only one accel uses. Without the
/// SKIP macros OpenMPI's and MPICH's mpi.h also define the C++ bindings
/// (removed from the MPI standard in 3.0), whose classes and vtables every
/// translation unit would compile: about a second each.
#ifndef ACCEL_RUNTIME_DETAIL_MPI_HPP
#define ACCEL_RUNTIME_DETAIL_MPI_HPP

#if ACCEL_WITH_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#endif

#endif  // ACCEL_RUNTIME_DETAIL_MPI_HPP
