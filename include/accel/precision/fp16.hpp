// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::Fp16: autocast to float16 with dynamic loss scaling; CUDA only (on CPU a run-time accel::Error suggests Bf16).
#ifndef ACCEL_PRECISION_FP16_HPP
#define ACCEL_PRECISION_FP16_HPP

#include <string_view>

#include <accel/precision/concept.hpp>

namespace accel::precision {

struct Fp16 {
  static constexpr std::string_view name = "fp16";
  static constexpr bool autocast = true;
  static constexpr at::ScalarType autocast_dtype = at::kHalf;
  static constexpr bool loss_scaling = true;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_FP16_HPP
