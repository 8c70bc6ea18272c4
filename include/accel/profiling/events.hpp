// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::profiling::Events, accel's own trace events (gradient
/// bucket reductions, waits for them, data loading, checkpoints) recorded
/// beside LibTorch's operators while an Accelerator::profile() object lives,
/// and profiling::Span, the scope that records one of them.
#ifndef ACCEL_PROFILING_EVENTS_HPP
#define ACCEL_PROFILING_EVENTS_HPP

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <accel/errors.hpp>

namespace accel::profiling {

/// One recorded event in Chrome trace terms. Plain data, so that the hot
/// path (bucket rounds, optimizer steps, loaders) compiles no JSON: trace.hpp
/// writes it out.
struct Event {
  using Arg = std::pair<std::string, std::variant<int64_t, double, std::string>>;
  std::string name;
  const char* category;  // a string literal at every call site
  char phase;            // 'X' complete; 'b', 'n', 'e' an asynchronous span
  int64_t ts_us;
  int64_t dur_us = 0;    // 'X' only
  int64_t id = -1;       // asynchronous spans only
  int64_t tid = 0;
  std::vector<Arg> args;
};

/// An argument shown with an event: integers, floating point, else a string.
template <class V>
Event::Arg event_arg(std::string key, V&& value) {
  using U = std::remove_cvref_t<V>;
  if constexpr (std::is_integral_v<U>)
    return {std::move(key), static_cast<int64_t>(value)};
  else if constexpr (std::is_floating_point_v<U>)
    return {std::move(key), static_cast<double>(value)};
  else
    return {std::move(key), std::string(std::forward<V>(value))};
}

/// The process's recording of accel events. When nothing records, every
/// call site costs one relaxed atomic load: no clock read, no allocation.
class Events {
 public:
  /// Whether a profile() object is recording on this process.
  static bool recording() noexcept { return on_.load(std::memory_order_relaxed); }
  /// Microseconds since the epoch: every rank's clock, so merged traces line up.
  static int64_t now_us() noexcept {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  /// Chrome trace tid of the calling thread: the id LibTorch's profiler gives
  /// it, so accel's events share the track of the operators around them.
  static int64_t thread_id() { return static_cast<int64_t>(at::RecordFunction::currentThreadId()); }

  /// A complete ("X") event on the calling thread.
  static void complete(const char* name, const char* category, int64_t begin_us, int64_t end_us,
                       std::vector<Event::Arg> args = {}) {
    add(Event{name, category, 'X', begin_us, end_us - begin_us, -1, thread_id(), std::move(args)});
  }
  /// One end of an asynchronous span ("b" or "e", or "n" a mark inside it): a
  /// bucket's reduction runs while the thread that started it goes on, so it
  /// gets its own row.
  static void async(char phase, std::string name, const char* category, int64_t id, int64_t ts_us,
                    std::vector<Event::Arg> args = {}) {
    add(Event{std::move(name), category, phase, ts_us, 0, id, thread_id(), std::move(args)});
  }

  /// Starts recording (Trace's constructor); one recording at a time.
  static void start() {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    ACCEL_CHECK(!on_.load(), "accel: profile() was called while another profile() object of this "
                "process is still recording. Let the first one go out of scope (or stop() it) first.");
    s.events.clear();
    on_.store(true);
  }
  /// Stops recording and hands over what was recorded (Trace's stop()).
  static std::vector<Event> stop() {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    on_.store(false);
    return std::exchange(s.events, {});
  }

 private:
  // Constant-initialised: reading it needs no guard of a function's static.
  inline static std::atomic<bool> on_{false};
  struct State {
    std::mutex mutex;  // reductions finish and loaders prefetch on other threads
    std::vector<Event> events;
  };
  static State& state() {
    static State s;  // one per program: an inline function's static
    return s;
  }
  static void add(Event event) {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    if (on_.load()) s.events.push_back(std::move(event));  // a span that outlived stop() is dropped
  }
};

/// RAII: records [construction, destruction) as a complete event when a
/// profile() object records at construction; otherwise does nothing else.
class Span {
 public:
  Span(const char* name, const char* category) noexcept
      : name_(name), category_(category), begin_us_(Events::recording() ? Events::now_us() : -1) {}
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span() {
    if (begin_us_ < 0) return;
    try {
      Events::complete(name_, category_, begin_us_, Events::now_us(), std::move(args_));
    } catch (...) {  // profiling never breaks training
    }
  }
  /// Adds an argument shown with the event (only evaluated while recording).
  template <class V>
  void arg(const char* key, V&& value) {
    if (begin_us_ >= 0) args_.push_back(event_arg(key, std::forward<V>(value)));
  }

 private:
  const char* name_;
  const char* category_;
  int64_t begin_us_;
  std::vector<Event::Arg> args_;  // empty until an argument is set: no allocation when not recording
};

}  // namespace accel::profiling

#endif  // ACCEL_PROFILING_EVENTS_HPP
