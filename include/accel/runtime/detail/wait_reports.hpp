// SPDX-License-Identifier: Apache-2.0
/// @file Defines WaitReports: when a wait that goes on (a rendezvous, machines
/// that have not joined) is reported. Free of LibTorch (the launchers use it).
#ifndef ACCEL_RUNTIME_DETAIL_WAIT_REPORTS_HPP
#define ACCEL_RUNTIME_DETAIL_WAIT_REPORTS_HPP

#include <algorithm>
#include <chrono>

namespace accel::runtime::detail {

/// When a wait that goes on is reported: after 5, 10, 20, 40 ... s (or from
/// `first` on, doubling), then every 5 minutes.
class WaitReports {
 public:
  using Clock = std::chrono::steady_clock;
  explicit WaitReports(Clock::time_point start, std::chrono::seconds first = std::chrono::seconds(5))
      : start_(start), next_(first) {}
  bool due() {
    if (Clock::now() - start_ < next_) return false;
    next_ = std::min(next_ * 2, next_ + std::chrono::seconds(300));
    return true;
  }
  /// Whole seconds waited, rounded.
  long long seconds() const {
    return (std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_).count() + 500) / 1000;
  }

 private:
  Clock::time_point start_;
  std::chrono::seconds next_;
};

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_WAIT_REPORTS_HPP
