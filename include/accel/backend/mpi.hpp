// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::Mpi: MPI's shared-memory collectives, run on a progress thread.
#ifndef ACCEL_BACKEND_MPI_HPP
#define ACCEL_BACKEND_MPI_HPP

#include <cstdlib>
#include <memory>
#include <string_view>

#include <accel/backend/concept.hpp>
#include <accel/config.hpp>
#include <accel/errors.hpp>
#if ACCEL_WITH_MPI
#include <accel/runtime/mpi_communicator.hpp>
#endif

namespace accel::backend {

/// CPU tensors; ranks from mpirun/srun (OMPI_COMM_WORLD_*, PMI_*). Shared
/// memory all-reduce on one machine is several times faster than Gloo's TCP.
struct Mpi {
  static constexpr std::string_view name = "Mpi";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "mpi";
  static constexpr bool multi_process = true;
  static constexpr bool available = ACCEL_WITH_MPI;

  static torch::Device device(const runtime::ProcessEnv&) { return torch::Device(torch::kCPU); }
  static std::shared_ptr<runtime::Communicator> make_communicator(
      [[maybe_unused]] const runtime::ProcessEnv& env,
      [[maybe_unused]] const AcceleratorOptions& opts) {
#if ACCEL_WITH_MPI
    runtime::MpiOptions m;
    m.timeout = opts.timeout;
    m.file_store = opts.file_store;
    // ACCEL_MPI_PROGRESS=thread|test (default thread): see runtime::MpiProgress.
    if (const char* v = std::getenv("ACCEL_MPI_PROGRESS"); v && *v) {
      const std::string_view s(v);
      ACCEL_CHECK(s == "thread" || s == "test", "accel: ACCEL_MPI_PROGRESS='", s,
                  "' is not a progress mode. Use thread or test, or unset it.");
      m.progress = s == "thread" ? runtime::MpiProgress::Thread : runtime::MpiProgress::Test;
    }
    return runtime::make_mpi_communicator(env, m);
#else
    throw Error("accel: backend::Mpi is not available in this build. Use backend::Gloo.");
#endif
  }
};

#if ACCEL_WITH_MPI
static_assert(Mpi::name == runtime::MpiCommunicator::name);
#endif

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_MPI_HPP
