// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::profiling::Trace, what Accelerator::profile returns:
/// LibTorch's operators and accel's own events (profiling::Events) on this
/// process, recorded while it lives and written
/// as a Chrome trace (trace_dir/trace_rank<r>.json); merge_traces puts the
/// ranks' files into one trace with a track per rank.
#ifndef ACCEL_PROFILING_TRACE_HPP
#define ACCEL_PROFILING_TRACE_HPP

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/profiling/events.hpp>

namespace accel::profiling {

namespace detail {

inline std::filesystem::path rank_file(const std::filesystem::path& dir, int rank) {
  return dir / ("trace_rank" + std::to_string(rank) + ".json");
}

inline void write_json_atomic(const std::filesystem::path& file, const nlohmann::json& j) {
  auto tmp = file;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ACCEL_CHECK(out.good(), "accel: cannot write the trace file '", tmp.string(),
                "'. Give profile() a directory this process can write to.");
    out << j.dump();
    ACCEL_CHECK(out.good(), "accel: writing the trace file '", tmp.string(), "' failed. Check the free space.");
  }
  std::filesystem::rename(tmp, file);
}

/// Drops the asynchronous spans that recording cut in half (begun before it
/// started or ended after it stopped): every "b" has its "e" in the file.
inline std::vector<Event> matched_spans(std::vector<Event> events) {
  const auto async = [](const Event& e) { return e.phase == 'b' || e.phase == 'n' || e.phase == 'e'; };
  std::set<std::pair<std::string, int64_t>> begun, ended;
  for (const auto& e : events) {
    if (e.phase == 'b') begun.emplace(e.category, e.id);
    if (e.phase == 'e') ended.emplace(e.category, e.id);
  }
  std::erase_if(events, [&](const Event& e) {
    const std::pair key{std::string(e.category), e.id};
    return async(e) && (!begun.count(key) || !ended.count(key));
  });
  return events;
}

/// An accel event as a Chrome trace event of process `pid`.
inline nlohmann::json event_json(const Event& e, int pid) {
  nlohmann::json args = nlohmann::json::object();
  for (const auto& arg : e.args) std::visit([&](const auto& v) { args[arg.first] = v; }, arg.second);
  nlohmann::json j = {{"name", e.name}, {"cat", e.category}, {"ph", std::string(1, e.phase)}, {"ts", e.ts_us},
                      {"pid", pid}, {"tid", e.tid}, {"args", std::move(args)}};
  if (e.phase == 'X')
    j["dur"] = e.dur_us;
  else
    j["id"] = e.id;
  return j;
}

/// LibTorch's legacy profiler events as Chrome "X" events: each push matched
/// with its pop (by handle and node, as LibTorch's RecordProfile writer
/// does), timed from the profiler's start mark plus start_us, with the
/// operator's input shapes in args["Input Dims"] (Kineto's name) when it had
/// tensor inputs. A push without its pop (still open at the end) is dropped.
inline nlohmann::json operator_events(const torch::autograd::profiler::thread_event_lists& lists, double start_us) {
  using torch::autograd::profiler::EventKind;
  using torch::autograd::profiler::LegacyEvent;
  const LegacyEvent* start = nullptr;
  std::map<std::pair<uint64_t, int64_t>, const LegacyEvent*> pushed;
  for (const auto& list : lists)
    for (const auto& e : list) {
      if (e.kind() == EventKind::PushRange) pushed[{e.handle(), e.nodeId()}] = &e;
      if (!start && e.kind() == EventKind::Mark && std::string_view(e.name()) == "__start_profile") start = &e;
    }
  nlohmann::json out = nlohmann::json::array();
  if (!start) return out;  // nothing was recorded
  for (const auto& list : lists)
    for (const auto& e : list) {
      if (e.kind() != EventKind::PopRange) continue;
      const auto it = pushed.find({e.handle(), e.nodeId()});
      if (it == pushed.end()) continue;
      const LegacyEvent& b = *it->second;
      nlohmann::json args = nlohmann::json::object();
      auto shapes = b.shapes();
      const bool any = std::any_of(shapes.begin(), shapes.end(), [](const auto& d) { return !d.empty(); });
      if (any) args["Input Dims"] = std::move(shapes);
      out.push_back({{"name", b.name()}, {"cat", "cpu_op"}, {"ph", "X"}, {"ts", start_us + start->cpuElapsedUs(b)},
                     {"dur", b.cpuElapsedUs(e)}, {"tid", b.threadId()}, {"args", std::move(args)}});
      pushed.erase(it);
    }
  return out;
}

}  // namespace detail

/// RAII: LibTorch's profiler (CPU operators, on every thread that runs them
/// for this process) records while the Trace lives. stop() or the destructor
/// writes trace_dir/trace_rank<r>.json in the Chrome trace event format
/// (operators and accel's scopes as complete "X" events, bucket reductions as
/// asynchronous "b"/"n"/"e" spans; pid = rank; timestamps in microseconds
/// since the epoch, so the ranks' files line up when merged). One per process
/// at a time. Movable, not copyable.
class Trace {
 public:
  Trace(std::filesystem::path trace_dir, int rank)
      : impl_(std::make_unique<Impl>(std::move(trace_dir), rank)) {}
  Trace(Trace&&) noexcept = default;
  Trace& operator=(Trace&&) noexcept = default;
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;
  ~Trace() {
    try {
      stop();
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";  // a destructor must not throw
    }
  }

  /// Stops recording and writes the file (once); returns its path.
  std::filesystem::path stop() {
    if (!impl_) return {};
    auto file = impl_->file;
    impl_->finish();
    impl_.reset();
    return file;
  }

 private:
  struct Impl {
    Impl(std::filesystem::path dir, int r)
        : rank(r), file(detail::rank_file(dir, r)),
          start_us(static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count())) {
      std::filesystem::create_directories(dir);
      Events::start();
      try {
        // CPU operators with their input shapes (recording shapes costs a
        // few vectors per operator: docs/profiling.md has the measured cost).
        torch::autograd::profiler::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(
            torch::profiler::impl::ProfilerState::CPU, /*report_input_shapes=*/true));
        recording = true;
      } catch (...) {
        Events::stop();
        throw;
      }
    }
    ~Impl() {
      if (!recording) return;
      try {
        Events::stop();
        (void)torch::autograd::profiler::disableProfilerLegacy();
      } catch (...) {
      }
    }
    void finish() {
      auto own = Events::stop();
      recording = false;
      const auto lists = torch::autograd::profiler::disableProfilerLegacy();
      nlohmann::json out = nlohmann::json::array();
      out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                     {"args", {{"name", "rank " + std::to_string(rank)}}}});
      for (auto& e : detail::operator_events(lists, start_us)) {
        e["pid"] = rank;
        out.push_back(std::move(e));
      }
      for (const auto& e : detail::matched_spans(std::move(own)))  // already in us since the epoch
        out.push_back(detail::event_json(e, rank));
      detail::write_json_atomic(file, out);
    }
    int rank;
    std::filesystem::path file;
    double start_us;
    bool recording = false;
  };
  std::unique_ptr<Impl> impl_;
};

/// Merges trace_rank0.json .. trace_rank<world-1>.json of trace_dir into
/// trace_dir/trace.json (one track per rank); call it once every rank's
/// Trace is gone (after wait_for_everyone()), on one process.
inline std::filesystem::path merge_traces(const std::filesystem::path& trace_dir, int world_size) {
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < world_size; ++r) {
    const auto file = detail::rank_file(trace_dir, r);
    std::ifstream in(file);
    ACCEL_CHECK(in.good(), "accel: the trace of rank ", r, " ('", file.string(),
                "') is missing. Merge after every rank's profile() object is gone.");
    for (auto& e : nlohmann::json::parse(in)) events.push_back(std::move(e));
  }
  const auto merged = trace_dir / "trace.json";
  detail::write_json_atomic(merged, {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}});
  return merged;
}

}  // namespace accel::profiling

#endif  // ACCEL_PROFILING_TRACE_HPP
