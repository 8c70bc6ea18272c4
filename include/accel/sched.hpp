// SPDX-License-Identifier: Apache-2.0
/// @file Defines nothing itself: includes the learning-rate schedulers
/// (accel::sched::OneCycleLR, accel::sched::LinearWarmup).
#ifndef ACCEL_SCHED_HPP
#define ACCEL_SCHED_HPP

#include <accel/sched/linear_warmup.hpp>
#include <accel/sched/one_cycle_lr.hpp>

#endif  // ACCEL_SCHED_HPP
