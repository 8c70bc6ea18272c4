// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella: everything in API.md.
#ifndef ACCEL_ACCEL_HPP
#define ACCEL_ACCEL_HPP

#include <accel/config.hpp>
#include <accel/version.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/random.hpp>
#include <accel/runtime.hpp>
#include <accel/logging.hpp>
#include <accel/backend.hpp>
#include <accel/precision.hpp>
#include <accel/comm.hpp>
#include <accel/shard.hpp>
#include <accel/compatibility.hpp>
#include <accel/data.hpp>
#include <accel/sched.hpp>
#include <accel/checkpoint.hpp>
#include <accel/memory.hpp>
#include <accel/profiling.hpp>
#include <accel/launch.hpp>
#include <accel/prepare.hpp>
#include <accel/accelerator.hpp>
#include <accel/ops.hpp>
#include <accel/tracking.hpp>
#include <accel/dispatch.hpp>

#endif  // ACCEL_ACCEL_HPP
