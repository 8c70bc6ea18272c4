// SPDX-License-Identifier: Apache-2.0
/// @file Declares what a precision policy is: the trait, the concept and the check.
#ifndef ACCEL_PRECISION_CONCEPT_HPP
#define ACCEL_PRECISION_CONCEPT_HPP

#include <concepts>
#include <string_view>
#include <type_traits>

#include <torch/torch.h>

namespace accel {

/// A precision policy is a set of compile-time facts:
///   static constexpr std::string_view name;          // "no" | "fp16" | "bf16" (Accelerate's names)
///   static constexpr bool autocast;                  // forward runs under autocast
///   static constexpr at::ScalarType autocast_dtype;  // its lower-precision type
///   static constexpr bool loss_scaling;              // dynamic loss scaling (Fp16)
namespace precision::detail {
// One concept per member, so that check_precision_policy names the missing one.
template <class P>
concept has_name = requires { { P::name } -> std::convertible_to<std::string_view>; };
template <class P>
concept has_autocast = requires { { P::autocast } -> std::convertible_to<bool>; };
template <class P>
concept has_autocast_dtype = requires { { P::autocast_dtype } -> std::convertible_to<at::ScalarType>; };
template <class P>
concept has_loss_scaling = requires { { P::loss_scaling } -> std::convertible_to<bool>; };
}  // namespace precision::detail

template <class P>
concept PrecisionPolicy = precision::detail::has_name<P> && precision::detail::has_autocast<P> &&
                          precision::detail::has_autocast_dtype<P> && precision::detail::has_loss_scaling<P>;

template <class P>
struct is_precision_policy : std::bool_constant<PrecisionPolicy<P>> {};
template <class P>
inline constexpr bool is_precision_policy_v = is_precision_policy<P>::value;

/// A type with none of a precision's own members (every policy has a name)
/// is not meant as one: one message says which to use. A precision that
/// lacks some gets one message per member.
template <class P>
struct check_precision_policy {
  static constexpr bool own_member = precision::detail::has_autocast<P> || precision::detail::has_autocast_dtype<P> ||
                                     precision::detail::has_loss_scaling<P>;
  static_assert(own_member,
                "accel: the Precision parameter of Accelerator is not a precision policy. Use "
                "accel::precision::Fp32, Fp16 or Bf16.");
  static_assert(!own_member || precision::detail::has_name<P>,
                "accel: this precision policy has no `static constexpr std::string_view name`. Add it "
                "(\"no\", \"fp16\" or \"bf16\", Accelerate's names).");
  static_assert(!own_member || precision::detail::has_autocast<P>,
                "accel: this precision policy has no `static constexpr bool autocast`. Add it (true: the "
                "forward runs under autocast).");
  static_assert(!own_member || precision::detail::has_autocast_dtype<P>,
                "accel: this precision policy has no `static constexpr at::ScalarType autocast_dtype`. Add "
                "it (the lower-precision type autocast uses).");
  static_assert(!own_member || precision::detail::has_loss_scaling<P>,
                "accel: this precision policy has no `static constexpr bool loss_scaling`. Add it (true: "
                "dynamic loss scaling, as Fp16).");
  static constexpr bool value = is_precision_policy_v<P>;
};

}  // namespace accel

#endif  // ACCEL_PRECISION_CONCEPT_HPP
