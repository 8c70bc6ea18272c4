// SPDX-License-Identifier: Apache-2.0
/// @file Declares what a shard policy is: the trait, the concept and the check.
#ifndef ACCEL_SHARD_CONCEPT_HPP
#define ACCEL_SHARD_CONCEPT_HPP

#include <concepts>
#include <string_view>
#include <type_traits>

namespace accel {

/// A shard policy says what each rank keeps:
///   static constexpr std::string_view name;
///   static constexpr bool shards_optimizer_state;  // ZeRO-1
///   static constexpr bool shards_gradients;        // ZeRO-2
///   static constexpr bool shards_parameters;       // ZeRO-3 (optional: false when absent)
template <class S>
concept ShardPolicy = requires {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::shards_optimizer_state } -> std::convertible_to<bool>;
  { S::shards_gradients } -> std::convertible_to<bool>;
};

/// Whether S partitions the parameters themselves (ZeRO-3).
template <class S>
inline constexpr bool shards_parameters_v = [] {
  if constexpr (requires { S::shards_parameters; }) return static_cast<bool>(S::shards_parameters);
  else return false;
}();

template <class S>
struct is_shard_policy : std::bool_constant<ShardPolicy<S>> {};
template <class S>
inline constexpr bool is_shard_policy_v = is_shard_policy<S>::value;

template <class S>
struct check_shard_policy {
  static_assert(is_shard_policy_v<S>,
                "accel: the Shard parameter of Accelerator is not a shard policy. Use "
                "accel::shard::Replicate, ShardOptimizer, ShardGradients or ShardParameters.");
  static constexpr bool value = is_shard_policy_v<S>;
};

}  // namespace accel

#endif  // ACCEL_SHARD_CONCEPT_HPP
