// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::Fp32: no autocast, no loss scaling.
#ifndef ACCEL_PRECISION_FP32_HPP
#define ACCEL_PRECISION_FP32_HPP

#include <string_view>

#include <accel/precision/concept.hpp>

namespace accel::precision {

struct Fp32 {
  static constexpr std::string_view name = "no";
  static constexpr bool autocast = false;
  static constexpr at::ScalarType autocast_dtype = at::kFloat;
  static constexpr bool loss_scaling = false;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_FP32_HPP
