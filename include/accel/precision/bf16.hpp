// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::Bf16: autocast to bfloat16 on CPU and CUDA; no loss scaling (bfloat16 has fp32's range).
#ifndef ACCEL_PRECISION_BF16_HPP
#define ACCEL_PRECISION_BF16_HPP

#include <string_view>

#include <accel/precision/concept.hpp>

namespace accel::precision {

struct Bf16 {
  static constexpr std::string_view name = "bf16";
  static constexpr bool autocast = true;
  static constexpr at::ScalarType autocast_dtype = at::kBFloat16;
  static constexpr bool loss_scaling = false;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_BF16_HPP
