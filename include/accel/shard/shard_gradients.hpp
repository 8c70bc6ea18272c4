// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::ShardGradients (ZeRO stage 2).
#ifndef ACCEL_SHARD_SHARD_GRADIENTS_HPP
#define ACCEL_SHARD_SHARD_GRADIENTS_HPP

#include <string_view>

#include <accel/shard/concept.hpp>

namespace accel::shard {

/// ZeRO-2: as ShardOptimizer, and each rank keeps only its partition's
/// gradients (reduce-scatter instead of all-reduce).
struct ShardGradients {
  static constexpr std::string_view name = "ShardGradients";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "shard_gradients";
  static constexpr bool shards_optimizer_state = true;
  static constexpr bool shards_gradients = true;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_SHARD_GRADIENTS_HPP
