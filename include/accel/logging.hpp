// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the logging area: accel::get_logger (Accelerate's
/// get_logger over spdlog), Logger, LogOptions, and the ACCEL_LOG_LEVEL
/// levels (docs/logging.md).
#ifndef ACCEL_LOGGING_HPP
#define ACCEL_LOGGING_HPP

#include <accel/logging/level.hpp>
#include <accel/logging/logger.hpp>

#endif  // ACCEL_LOGGING_HPP
