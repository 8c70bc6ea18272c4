// SPDX-License-Identifier: Apache-2.0
/// @file Defines the runtime area's public surface: ProcessEnv (who am I),
/// restart_count() (which attempt of an elastic launch), heartbeat() (progress
/// for the launcher's hang detection),
/// the Communicator interface, the rendezvous store (make_store), and the
/// Gloo and MPI communicators (make_gloo_communicator, make_mpi_communicator;
/// the MPI one only when ACCEL_WITH_MPI).
#ifndef ACCEL_RUNTIME_HPP
#define ACCEL_RUNTIME_HPP

#include <accel/runtime/communicator.hpp>
#include <accel/runtime/counting_communicator.hpp>
#include <accel/runtime/gloo_communicator.hpp>
#include <accel/runtime/heartbeat.hpp>
#include <accel/runtime/mpi_communicator.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/restart_count.hpp>
#include <accel/runtime/store.hpp>

#endif  // ACCEL_RUNTIME_HPP
