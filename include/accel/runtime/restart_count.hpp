// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::restart_count(): which attempt of an elastic launch
/// this process belongs to (torchrun's TORCHELASTIC_RESTART_COUNT).
#ifndef ACCEL_RUNTIME_RESTART_COUNT_HPP
#define ACCEL_RUNTIME_RESTART_COUNT_HPP

#include <accel/errors.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel {

/// 0 on the first attempt of a launch, N after the N-th restart of the worker
/// group (LaunchOptions::max_restarts, `accel launch --max_restarts`); read
/// from TORCHELASTIC_RESTART_COUNT, which accel's launchers and torchrun set.
/// Unset (a plain run, mpirun): 0.
inline int restart_count() {
  const auto n = runtime::detail::getenv_int("TORCHELASTIC_RESTART_COUNT");
  ACCEL_CHECK(!n || *n >= 0, "accel: TORCHELASTIC_RESTART_COUNT=", *n,
              " is negative. Unset it, or let the launcher set it.");
  return n.value_or(0);
}

}  // namespace accel

#endif  // ACCEL_RUNTIME_RESTART_COUNT_HPP
