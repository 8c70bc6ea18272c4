// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the tracking area: experiment trackers (init_trackers,
/// log) and the progress bar.
#ifndef ACCEL_TRACKING_HPP
#define ACCEL_TRACKING_HPP

#include <accel/tracking/progress.hpp>
#include <accel/tracking/tracker_options.hpp>
#include <accel/tracking/trackers.hpp>
#include <accel/tracking/value.hpp>

#endif  // ACCEL_TRACKING_HPP
