// SPDX-License-Identifier: Apache-2.0
/// @file Every build-availability macro of accel, documented in one place.
///
/// ACCEL_WITH_NCCL  1 when LibTorch was built with CUDA and NCCL (CMake sets it
///                  from the Torch package); enables backend::Nccl.
/// ACCEL_WITH_MPI   1 when an MPI implementation is linked (CMake sets it when
///                  find_package(MPI) succeeds); enables backend::Mpi.
/// ACCEL_WITH_CUDA  1 when LibTorch has CUDA (implied by ACCEL_WITH_NCCL).
#ifndef ACCEL_CONFIG_HPP
#define ACCEL_CONFIG_HPP

#ifndef ACCEL_WITH_NCCL
#define ACCEL_WITH_NCCL 0
#endif
#ifndef ACCEL_WITH_MPI
#define ACCEL_WITH_MPI 0
#endif
#ifndef ACCEL_WITH_CUDA
#define ACCEL_WITH_CUDA ACCEL_WITH_NCCL
#endif

#endif  // ACCEL_CONFIG_HPP
