// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the shard policies.
#ifndef ACCEL_SHARD_HPP
#define ACCEL_SHARD_HPP

#include <accel/shard/concept.hpp>
#include <accel/shard/replicate.hpp>
#include <accel/shard/shard_gradients.hpp>
#include <accel/shard/shard_optimizer.hpp>
#include <accel/shard/shard_parameters.hpp>
#include <accel/shard/unit.hpp>

#endif  // ACCEL_SHARD_HPP
