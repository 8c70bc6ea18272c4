// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the precision policies.
#ifndef ACCEL_PRECISION_HPP
#define ACCEL_PRECISION_HPP

#include <accel/precision/autocast.hpp>
#include <accel/precision/bf16.hpp>
#include <accel/precision/concept.hpp>
#include <accel/precision/fp16.hpp>
#include <accel/precision/fp32.hpp>
#include <accel/precision/loss_scaler.hpp>

#endif  // ACCEL_PRECISION_HPP
