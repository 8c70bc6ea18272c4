// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the profiling area: the Chrome trace that
/// Accelerator::profile returns, and merge_traces.
#ifndef ACCEL_PROFILING_HPP
#define ACCEL_PROFILING_HPP

#include <accel/profiling/trace.hpp>

#endif  // ACCEL_PROFILING_HPP
