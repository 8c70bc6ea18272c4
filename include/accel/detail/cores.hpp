// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::available_cores(): the CPUs this process may use.
#ifndef ACCEL_DETAIL_CORES_HPP
#define ACCEL_DETAIL_CORES_HPP

#include <sched.h>

#include <algorithm>
#include <thread>

namespace accel::detail {

/// CPUs this process may run on (its affinity mask: what taskset, cgroups
/// cpusets, Slurm and mpirun's binding allow), not the machine's total.
inline int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_CORES_HPP
