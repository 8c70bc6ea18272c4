// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the memory area: activation checkpointing
/// (accel::checkpoint, accel::checkpoint_sequential).
#ifndef ACCEL_MEMORY_HPP
#define ACCEL_MEMORY_HPP

#include <accel/memory/checkpoint.hpp>

#endif  // ACCEL_MEMORY_HPP
