// SPDX-License-Identifier: Apache-2.0
/// @file Defines SlowCollectiveWatch: a rank that waits long in a collective
/// says so, and names the processes that have not reached it (one that hangs
/// in its own code, loads data forever, or skipped the collective), instead of
/// waiting silently until the backend's timeout. Nothing happens on the fast
/// path: a wait that ends within 5 s costs what it did before.
#ifndef ACCEL_RUNTIME_DETAIL_SLOW_COLLECTIVE_HPP
#define ACCEL_RUNTIME_DETAIL_SLOW_COLLECTIVE_HPP

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <accel/runtime/detail/wait_reports.hpp>

namespace accel::runtime::detail {

/// Shared by a communicator's work handles. Each rank that has waited 5 s in
/// its collective number `seq` writes seq under its key in the rendezvous
/// store; at 10, 20, 40 ... s it reads the others' keys: a process whose key is
/// missing or lower has not reached this collective.
class SlowCollectiveWatch {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kPublishAfter{5};

  SlowCollectiveWatch(c10::intrusive_ptr<c10d::Store> store, std::string backend, int rank, int size,
                      std::chrono::milliseconds timeout, std::ostream& log = std::cerr)
      : store_(std::move(store)), backend_(std::move(backend)), rank_(rank), size_(size),
        timeout_(timeout), log_(log) {}

  /// The number the next collective gets (all ranks issue them in one order).
  std::uint64_t next_seq() { return seq_.fetch_add(1) + 1; }

  /// Called when a wait has gone on for `waited`: publish once, report when due.
  void waiting(const std::string& op, std::uint64_t seq, Clock::duration waited, bool& published,
               WaitReports& reports) {
    if (!published && waited >= kPublishAfter) {
      published = true;
      try {
        const std::string value = std::to_string(seq);
        store_->set(key(rank_), std::vector<uint8_t>(value.begin(), value.end()));
      } catch (const std::exception&) {
        // The store's host (rank 0) is gone: the collective fails by itself soon.
      }
    }
    if (!reports.due()) return;
    std::string missing;
    int absent = 0;
    try {
      for (int r = 0; r < size_; ++r) {
        if (r == rank_ || reached(r, seq)) continue;
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        ++absent;
      }
    } catch (const std::exception&) {
      missing.clear();
    }
    log_ << "accel: rank " << rank_ << " has waited " << reports.seconds() << " s in " << backend_ << " "
         << op << " (its collective #" << seq << ") for the other processes; "
         << (missing.empty() ? std::string("all have reached it (a slow network or a large tensor?)")
                             : std::string(absent == 1 ? "process " : "processes ") + missing +
                                   (absent == 1 ? " has" : " have") +
                                   " not reached it (still computing or loading data, hung, or "
                                   "skipped this collective)")
         << ". It gives up after " << timeout_.count() / 1000 << " s." << std::endl;
  }

 private:
  static std::string key(int rank) { return "accel/collective_progress/" + std::to_string(rank); }

  bool reached(int r, std::uint64_t seq) {
    if (!store_->check({key(r)})) return false;
    const auto v = store_->get(key(r));
    return std::stoull(std::string(v.begin(), v.end())) >= seq;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string backend_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::ostream& log_;
  std::atomic<std::uint64_t> seq_{0};  // collectives may be launched from autograd's threads
};

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_SLOW_COLLECTIVE_HPP
