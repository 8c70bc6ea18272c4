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
namespace shard::detail {
// One concept per member, so that check_shard_policy names the missing one.
template <class S>
concept has_name = requires { { S::name } -> std::convertible_to<std::string_view>; };
template <class S>
concept has_shards_optimizer_state = requires { { S::shards_optimizer_state } -> std::convertible_to<bool>; };
template <class S>
concept has_shards_gradients = requires { { S::shards_gradients } -> std::convertible_to<bool>; };
}  // namespace shard::detail

template <class S>
concept ShardPolicy = shard::detail::has_name<S> && shard::detail::has_shards_optimizer_state<S> &&
                      shard::detail::has_shards_gradients<S>;

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

/// A type with none of a shard policy's own members (every policy has a
/// name) is not meant as one: one message says which to use. A shard policy
/// that lacks some gets one message per member.
template <class S>
struct check_shard_policy {
  static constexpr bool own_member =
      shard::detail::has_shards_optimizer_state<S> || shard::detail::has_shards_gradients<S>;
  static_assert(own_member,
                "accel: the Shard parameter of Accelerator is not a shard policy. Use "
                "accel::shard::Replicate, ShardOptimizer, ShardGradients or ShardParameters.");
  static_assert(!own_member || shard::detail::has_name<S>,
                "accel: this shard policy has no `static constexpr std::string_view name`. Add it.");
  static_assert(!own_member || shard::detail::has_shards_optimizer_state<S>,
                "accel: this shard policy has no `static constexpr bool shards_optimizer_state`. Add it "
                "(true: ZeRO-1, each rank keeps 1/N of the optimizer state).");
  static_assert(!own_member || shard::detail::has_shards_gradients<S>,
                "accel: this shard policy has no `static constexpr bool shards_gradients`. Add it (true: "
                "ZeRO-2, each rank keeps 1/N of the gradients).");
  static constexpr bool value = is_shard_policy_v<S>;
};

}  // namespace accel

#endif  // ACCEL_SHARD_CONCEPT_HPP
