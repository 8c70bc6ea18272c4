// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::Replicate: data parallel, every rank holds everything.
#ifndef ACCEL_SHARD_REPLICATE_HPP
#define ACCEL_SHARD_REPLICATE_HPP

#include <string_view>

#include <accel/shard/concept.hpp>

namespace accel::shard {

/// Data parallel (DDP): parameters broadcast from rank 0 at prepare(),
/// gradients averaged in buckets whose all-reduce starts during backward.
struct Replicate {
  static constexpr std::string_view name = "Replicate";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "replicate";
  static constexpr bool shards_optimizer_state = false;
  static constexpr bool shards_gradients = false;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_REPLICATE_HPP
