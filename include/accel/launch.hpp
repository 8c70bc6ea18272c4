// SPDX-License-Identifier: Apache-2.0
/// @file Defines the launch area's public surface: accel::LaunchOptions and
/// accel::notebook_launcher / accel::launch (fork-based, one node at a time),
/// and the config file of the `accel` command (accel::LaunchConfig,
/// read_config_file, write_basic_config, default_config_path).
#ifndef ACCEL_LAUNCH_HPP
#define ACCEL_LAUNCH_HPP

#include <accel/launch/config_file.hpp>
#include <accel/launch/launch_options.hpp>
#include <accel/launch/notebook_launcher.hpp>

#endif  // ACCEL_LAUNCH_HPP
