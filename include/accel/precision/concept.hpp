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
template <class P>
concept PrecisionPolicy = requires {
  { P::name } -> std::convertible_to<std::string_view>;
  { P::autocast } -> std::convertible_to<bool>;
  { P::autocast_dtype } -> std::convertible_to<at::ScalarType>;
  { P::loss_scaling } -> std::convertible_to<bool>;
};

template <class P>
struct is_precision_policy : std::bool_constant<PrecisionPolicy<P>> {};
template <class P>
inline constexpr bool is_precision_policy_v = is_precision_policy<P>::value;

template <class P>
struct check_precision_policy {
  static_assert(is_precision_policy_v<P>,
                "accel: the Precision parameter of Accelerator is not a precision policy. Use "
                "accel::precision::Fp32, Fp16 or Bf16.");
  static constexpr bool value = is_precision_policy_v<P>;
};

}  // namespace accel

#endif  // ACCEL_PRECISION_CONCEPT_HPP
