// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the backend policies.
#ifndef ACCEL_BACKEND_HPP
#define ACCEL_BACKEND_HPP

#include <accel/backend/concept.hpp>
#include <accel/backend/gloo.hpp>
#include <accel/backend/mpi.hpp>
#include <accel/backend/nccl.hpp>
#include <accel/backend/single_device.hpp>

#endif  // ACCEL_BACKEND_HPP
