// SPDX-License-Identifier: Apache-2.0
/// @file Defines detail::Prefetcher: worker threads that produce the batches
/// of one epoch ahead of the consumer, handed out strictly in order.
#ifndef ACCEL_DATA_DETAIL_PREFETCHER_HPP
#define ACCEL_DATA_DETAIL_PREFETCHER_HPP

#include <accel/errors.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace accel::data::detail {

// Workers claim batch numbers in increasing order, at most `capacity` ahead of
// the consumer, and file each result (or the exception that producing it
// threw) under its number: so the consumer sees exactly the sequential
// batches, an exception surfaces at the batch that raised it, and memory is
// bounded. stop() (also run by the destructor) makes idle workers exit and
// joins them; a worker inside produce() finishes that one batch first.
template <class Batch>
class Prefetcher {
 public:
  using Produce = std::function<Batch(int64_t)>;

  Prefetcher(int64_t first, int64_t end, int workers, int64_t capacity, Produce produce,
             std::chrono::milliseconds timeout)
      : produce_(std::move(produce)),
        next_claim_(first),
        next_consume_(first),
        end_(end),
        capacity_(capacity < 1 ? 1 : capacity),
        timeout_(timeout) {
    alive_ = workers;
    threads_.reserve(static_cast<size_t>(workers));
    try {
      for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
    } catch (...) {
      alive_ = static_cast<int>(threads_.size());
      stop();
      throw;
    }
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() { stop(); }

  // Batch number j; must be called for first, first+1, ... in order.
  Batch get(int64_t j) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (auto it = ready_.find(j); it != ready_.end()) {
        Slot slot = std::move(it->second);
        ready_.erase(it);
        next_consume_ = j + 1;
        lock.unlock();
        space_.notify_all();
        if (auto* error = std::get_if<std::exception_ptr>(&slot)) std::rethrow_exception(*error);
        return std::move(std::get<Batch>(slot));
      }
      ACCEL_CHECK(alive_ > 0, "accel: the data loader's worker threads stopped before batch ", j,
                  " was produced. Report this as a bug; use num_workers = 0 meanwhile.");
      if (ready_cv_.wait_until(lock, deadline) == std::cv_status::timeout && !ready_.count(j))
        throw Error(::accel::detail::concat("accel: a data loader worker took more than ", timeout_.count(),
                           " ms to produce batch ", j,
                           ". Check the dataset's get() for a hang, or raise "
                           "LoaderOptions::timeout."));
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    space_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

 private:
  using Slot = std::variant<Batch, std::exception_ptr>;

  void work() {
    for (;;) {
      int64_t j = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        space_.wait(lock, [&] {
          return stopping_ || next_claim_ >= end_ || next_claim_ < next_consume_ + capacity_;
        });
        if (stopping_ || next_claim_ >= end_) break;
        j = next_claim_++;
      }
      Slot slot = [&]() -> Slot {
        try {
          return Slot(std::in_place_index<0>, produce_(j));
        } catch (...) {
          return Slot(std::in_place_index<1>, std::current_exception());
        }
      }();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ready_.emplace(j, std::move(slot));
      }
      ready_cv_.notify_all();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --alive_;
    }
    ready_cv_.notify_all();
  }

  Produce produce_;
  std::mutex mutex_;
  std::condition_variable space_;     // workers wait for room in the window
  std::condition_variable ready_cv_;  // the consumer waits for its batch
  std::map<int64_t, Slot> ready_;
  int64_t next_claim_, next_consume_, end_, capacity_;
  std::chrono::milliseconds timeout_;
  int alive_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace accel::data::detail

#endif  // ACCEL_DATA_DETAIL_PREFETCHER_HPP
