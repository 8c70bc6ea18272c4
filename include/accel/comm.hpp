// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the gradient communication hooks (AcceleratorOptions::comm_hook,
/// Accelerator::register_comm_hook).
#ifndef ACCEL_COMM_HPP
#define ACCEL_COMM_HPP

#include <accel/comm/cast_hook.hpp>
#include <accel/comm/grad_bucket.hpp>
#include <accel/comm/hook.hpp>
#include <accel/comm/make_hook.hpp>
#include <accel/comm/powersgd_hook.hpp>

#endif  // ACCEL_COMM_HPP
