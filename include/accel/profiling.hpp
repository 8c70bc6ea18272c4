// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the profiling area: the Chrome trace that
/// Accelerator::profile returns, merge_traces, and accel's own events in it.
#ifndef ACCEL_PROFILING_HPP
#define ACCEL_PROFILING_HPP

#include <accel/profiling/events.hpp>
#include <accel/profiling/trace.hpp>

#endif  // ACCEL_PROFILING_HPP
