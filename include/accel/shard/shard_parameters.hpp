// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::ShardParameters (ZeRO stage 3).
#ifndef ACCEL_SHARD_SHARD_PARAMETERS_HPP
#define ACCEL_SHARD_SHARD_PARAMETERS_HPP

#include <string_view>

#include <accel/shard/concept.hpp>

namespace accel::shard {

/// ZeRO-3: as ShardGradients, and each rank keeps only its partition of the
/// parameters too. A unit's parameters are all-gathered just before its
/// forward and freed after it, gathered again for its backward and freed
/// once their gradients are reduce-scattered. Units: the children of a
/// torch::nn::Sequential, or the modules wrapped in shard::Unit (any model);
/// any other model is one unit (docs/sharding.md).
struct ShardParameters {
  static constexpr std::string_view name = "ShardParameters";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "shard_parameters";
  static constexpr bool shards_optimizer_state = true;
  static constexpr bool shards_gradients = true;
  static constexpr bool shards_parameters = true;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_SHARD_PARAMETERS_HPP
