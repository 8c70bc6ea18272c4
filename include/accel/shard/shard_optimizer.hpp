// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::ShardOptimizer (ZeRO stage 1).
#ifndef ACCEL_SHARD_SHARD_OPTIMIZER_HPP
#define ACCEL_SHARD_SHARD_OPTIMIZER_HPP

#include <string_view>

#include <accel/shard/concept.hpp>

namespace accel::shard {

/// ZeRO-1: optimizer state partitioned across ranks; each rank steps the
/// parameters it owns, then the updated parameters are all-gathered.
struct ShardOptimizer {
  static constexpr std::string_view name = "ShardOptimizer";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "shard_optimizer";
  static constexpr bool shards_optimizer_state = true;
  static constexpr bool shards_gradients = false;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_SHARD_OPTIMIZER_HPP
