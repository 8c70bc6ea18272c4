// Shared by the multi-process tests: launch options for N local workers, and
// the check a worker makes (throwing fails the launch, naming the rank).
#pragma once

#include <accel/launch/launch_options.hpp>

#include <chrono>
#include <stdexcept>
#include <string>

namespace accel_test {

/// n processes on this machine, a free port, a timeout that fails a hung test.
inline accel::LaunchOptions local_processes(int n, std::chrono::seconds timeout = std::chrono::seconds(240)) {
  accel::LaunchOptions lo;
  lo.num_processes = n;
  lo.master_port = 0;
  lo.timeout = timeout;
  return lo;
}

/// In a worker: throws `what` unless ok (notebook_launcher then fails with it).
inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

}  // namespace accel_test
