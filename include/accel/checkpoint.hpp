// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the checkpoint area: safetensors I/O and save_model.
#ifndef ACCEL_CHECKPOINT_HPP
#define ACCEL_CHECKPOINT_HPP

#include <accel/checkpoint/safetensors.hpp>
#include <accel/checkpoint/save_model.hpp>

#endif  // ACCEL_CHECKPOINT_HPP
