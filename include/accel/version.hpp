// SPDX-License-Identifier: Apache-2.0
/// @file Defines the accel version macros (CMake reads them from here).
#ifndef ACCEL_VERSION_HPP
#define ACCEL_VERSION_HPP

#define ACCEL_VERSION_MAJOR 0
#define ACCEL_VERSION_MINOR 1
#define ACCEL_VERSION_PATCH 0

namespace accel {
inline constexpr const char* version_string = "0.1.0";
}  // namespace accel

#endif  // ACCEL_VERSION_HPP
