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
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <accel/runtime/detail/wait_reports.hpp>

namespace accel::runtime::detail {

/// Shared by a communicator's work handles. Each rank that has waited 5 s in
/// its collective number `seq` writes "seq op" under its key in the
/// rendezvous store; at 10, 20, 40 ... s it reads the others' keys: a process
/// whose key is missing or lower has not reached this collective, and one at
/// the same number in another operation runs the collectives in another
/// order (one called on some processes only).
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
        const std::string value = std::to_string(seq) + " " + op;
        store_->set(key(rank_), std::vector<uint8_t>(value.begin(), value.end()));
      } catch (const std::exception&) {
        // The store's host (rank 0) is gone: the collective fails by itself soon.
      }
    }
    if (!reports.due()) return;
    std::string missing, elsewhere;
    int absent = 0;
    try {
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        const auto [at, their_op] = progress(r);
        if (at < seq) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          ++absent;
        } else if (at == seq && their_op != op) {
          elsewhere += (elsewhere.empty() ? "" : ", ") + ("process " + std::to_string(r) + " is in " + their_op);
        }
      }
    } catch (const std::exception&) {
      missing.clear();
      elsewhere.clear();
    }
    log_ << "accel: rank " << rank_ << " has waited " << reports.seconds() << " s in " << backend_ << " "
         << op << " (its collective #" << seq << ") for the other processes; ";
    if (!elsewhere.empty())
      log_ << "at that collective " << elsewhere << ": the processes call collectives in different "
           << "orders (one called on some processes only, as a save_model() or gather inside "
           << "`if (is_main_process())`; every process must make the same calls)";
    else if (!missing.empty())
      log_ << (absent == 1 ? "process " : "processes ") << missing << (absent == 1 ? " has" : " have")
           << " not reached it (still computing or loading data, hung, or skipped this collective)";
    else
      log_ << "all have reached it (a slow network or a large tensor?)";
    log_ << ". It gives up after " << timeout_.count() / 1000 << " s." << std::endl;
  }

 private:
  static std::string key(int rank) { return "accel/collective_progress/" + std::to_string(rank); }

  /// Rank r's published collective number and operation (0 when none yet).
  std::pair<std::uint64_t, std::string> progress(int r) {
    if (!store_->check({key(r)})) return {0, ""};
    const auto v = store_->get(key(r));
    const std::string text(v.begin(), v.end());
    const auto space = text.find(' ');
    return {std::stoull(text.substr(0, space)), space == std::string::npos ? "" : text.substr(space + 1)};
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
