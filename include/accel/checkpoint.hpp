// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the checkpoint area: safetensors I/O, save_model, and
/// save_state/load_state with their registry, pre-hooks and the newest
/// automatic checkpoint. (safetensors.hpp and save_model.hpp alone need
/// neither a communicator nor the training state.)
#ifndef ACCEL_CHECKPOINT_HPP
#define ACCEL_CHECKPOINT_HPP

#include <accel/checkpoint/latest_state.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/checkpoint/save_model.hpp>
#include <accel/checkpoint/save_state.hpp>
#include <accel/checkpoint/state_hooks.hpp>
#include <accel/checkpoint/state_io.hpp>
#include <accel/checkpoint/state_registry.hpp>

#endif  // ACCEL_CHECKPOINT_HPP
