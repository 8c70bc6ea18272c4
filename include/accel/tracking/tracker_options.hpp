// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::tracking::TrackerOptions, which writers
/// init_trackers() starts (apart from trackers.hpp, which holds the writers:
/// accelerator.hpp declares init_trackers() with this alone).
#ifndef ACCEL_TRACKING_TRACKER_OPTIONS_HPP
#define ACCEL_TRACKING_TRACKER_OPTIONS_HPP

namespace accel::tracking {

/// Which writers init_trackers() starts (Accelerate's log_with); all by default.
struct TrackerOptions {
  bool jsonl = true;        ///< metrics.jsonl: one JSON object per log() call
  bool csv = true;          ///< metrics.csv: one row per log() call
  bool tensorboard = true;  ///< events.out.tfevents.<time>.<host>: numeric values
};

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_TRACKER_OPTIONS_HPP
