// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel's experiment trackers (JSONL, CSV, TensorBoard event
/// files) and accel::tracking::Trackers, which the Accelerator's
/// init_trackers()/log()/end_training() drive on the main process.
#ifndef ACCEL_TRACKING_TRACKERS_HPP
#define ACCEL_TRACKING_TRACKERS_HPP

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <accel/errors.hpp>
#include <accel/tracking/detail/tfevents.hpp>
#include <accel/tracking/tracker_options.hpp>
#include <accel/tracking/value.hpp>

namespace accel::tracking {

/// One output format. log() receives the step already resolved.
class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual std::string name() const = 0;
  virtual void log(const Values& values, int64_t step) = 0;
  virtual void finish() = 0;
};

namespace detail {
inline double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::ofstream open_or_throw(const std::filesystem::path& p, std::ios::openmode mode) {
  std::ofstream f(p, mode);
  ACCEL_CHECK(f.good(), "accel: cannot open ", p, " for writing. Check that project_dir is a "
              "writable directory.");
  return f;
}

inline void write_or_throw(std::ofstream& f, const std::string& data,
                           const std::filesystem::path& p) {
  f << data;
  f.flush();  // each call reaches the file: a crashed run keeps its metrics
  ACCEL_CHECK(f.good(), "accel: writing ", p, " failed (disk full?). Free space in project_dir.");
}
}  // namespace detail

/// {"step": N, "<key>": value, ...} per line; strings kept, NaN/inf as strings.
class JsonlTracker : public Tracker {
 public:
  explicit JsonlTracker(std::filesystem::path path)
      : path_(std::move(path)), out_(detail::open_or_throw(path_, std::ios::trunc)) {}
  std::string name() const override { return "jsonl"; }
  void log(const Values& values, int64_t step) override {
    nlohmann::ordered_json j;
    j["step"] = step;
    for (const auto& [k, v] : values) j[k] = v.to_json();
    detail::write_or_throw(out_, j.dump() + "\n", path_);
  }
  void finish() override { out_.close(); }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

/// Header "step,<keys of the first call, sorted>". A later call with a key
/// the header lacks widens it: the file is rewritten (to a temporary file,
/// then renamed) with the new column appended and the earlier rows' cells
/// left empty. A key missing from a call leaves its cell empty.
class CsvTracker : public Tracker {
 public:
  explicit CsvTracker(std::filesystem::path path) : path_(std::move(path)) { rewrite(); }
  std::string name() const override { return "csv"; }
  void log(const Values& values, int64_t step) override {
    bool widened = false;
    for (const auto& [k, v] : values)
      if (std::find(columns_.begin(), columns_.end(), k) == columns_.end()) {
        columns_.push_back(k);
        widened = true;
      }
    std::vector<std::string> row{std::to_string(step)};
    for (size_t c = 1; c < columns_.size(); ++c) {
      auto it = values.find(columns_[c]);
      row.push_back(it == values.end() ? std::string() : it->second.to_csv());
    }
    rows_.push_back(std::move(row));
    if (widened && header_written_) {
      rewrite();
    } else {
      if (!header_written_) detail::write_or_throw(out_, join(columns_), path_);
      header_written_ = true;
      detail::write_or_throw(out_, join(rows_.back()), path_);
    }
  }
  void finish() override { out_.close(); }
  const std::vector<std::string>& columns() const { return columns_; }

 private:
  static std::string join(const std::vector<std::string>& cells) {
    std::string s;
    for (size_t i = 0; i < cells.size(); ++i) s += (i ? "," : "") + cells[i];
    return s + "\n";
  }
  void rewrite() {
    if (out_.is_open()) out_.close();
    auto tmp = path_;
    tmp += ".tmp";
    {
      auto f = detail::open_or_throw(tmp, std::ios::trunc);
      std::string text = rows_.empty() ? std::string() : join(columns_);
      for (auto row : rows_) {
        row.resize(columns_.size());
        text += join(row);
      }
      detail::write_or_throw(f, text, tmp);
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path_, ec);
    ACCEL_CHECK(!ec, "accel: cannot replace ", path_, ": ", ec.message(),
                ". Check the permissions of project_dir.");
    out_ = detail::open_or_throw(path_, std::ios::app);
    header_written_ = !rows_.empty();
  }

  std::filesystem::path path_;
  std::ofstream out_;
  std::vector<std::string> columns_{"step"};
  std::vector<std::vector<std::string>> rows_;
  bool header_written_ = false;
};

/// TensorBoard event file: TFRecords of tf.Event; numeric values become
/// scalar summaries tagged with their key, strings are left out.
class TensorBoardTracker : public Tracker {
 public:
  explicit TensorBoardTracker(const std::filesystem::path& dir) {
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    const double now = detail::wall_time_now();
    auto base = "events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host;
    path_ = dir / base;
    for (int i = 1; std::filesystem::exists(path_); ++i) path_ = dir / (base + "." + std::to_string(i));
    out_ = detail::open_or_throw(path_, std::ios::binary | std::ios::trunc);
    detail::write_or_throw(out_, tracking::detail::tfrecord(
                                     tracking::detail::encode_file_version_event(now)), path_);
  }
  std::string name() const override { return "tensorboard"; }
  void log(const Values& values, int64_t step) override {
    std::vector<std::pair<std::string, float>> scalars;
    for (const auto& [k, v] : values)
      if (auto x = v.as_number()) scalars.emplace_back(k, static_cast<float>(*x));
    if (scalars.empty()) return;
    detail::write_or_throw(out_, tracking::detail::tfrecord(tracking::detail::encode_scalars_event(
                                     detail::wall_time_now(), step, scalars)), path_);
  }
  void finish() override { out_.close(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

/// The trackers of one run, in project_dir/project_name/: config.json,
/// metrics.jsonl, metrics.csv (both started afresh by each init), and
/// events.out.tfevents.* (a new file per init; TensorBoard reads them all). Only the process with
/// `writer` true creates files; the others only check the calls.
class Trackers {
 public:
  void init(const std::optional<std::string>& project_dir, const std::string& project_name,
            const Config& config, TrackerOptions options, bool writer) {
    ACCEL_CHECK(project_dir && !project_dir->empty(),
                "accel: init_trackers() needs a directory to write to, and "
                "AcceleratorOptions::project_dir is not set. Construct the Accelerator with "
                "AcceleratorOptions{.project_dir = \"runs\"} (any writable directory).");
    ACCEL_CHECK(!project_name.empty() && project_name.find('/') == std::string::npos &&
                    project_name != "." && project_name != "..",
                "accel: init_trackers() needs a project name that is one directory name (got \"",
                project_name, "\"). Pass a name such as \"my_run\".");
    finish();
    initialised_ = true;
    step_ = 0;
    dir_ = std::filesystem::path(*project_dir) / project_name;
    if (!writer) return;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    ACCEL_CHECK(!ec, "accel: cannot create the tracking directory ", dir_, ": ", ec.message(),
                ". Set AcceleratorOptions::project_dir to a writable directory.");
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (const auto& [k, v] : config) j[k] = v.to_json();
    {
      auto f = detail::open_or_throw(dir_ / "config.json", std::ios::trunc);
      detail::write_or_throw(f, j.dump(2) + "\n", dir_ / "config.json");
    }
    if (options.jsonl) trackers_.push_back(std::make_unique<JsonlTracker>(dir_ / "metrics.jsonl"));
    if (options.csv) trackers_.push_back(std::make_unique<CsvTracker>(dir_ / "metrics.csv"));
    if (options.tensorboard) trackers_.push_back(std::make_unique<TensorBoardTracker>(dir_));
  }

  /// step: nullopt uses the number of earlier log() calls since init (0, 1, ...).
  void log(const Values& values, std::optional<int64_t> step = {}) {
    ACCEL_CHECK(initialised_, "accel: log() was called before init_trackers(). Call "
                "accelerator.init_trackers(\"project_name\", config) once before logging.");
    const int64_t s = step.value_or(step_);
    ++step_;
    for (auto& t : trackers_) t->log(values, s);
  }

  /// Closes every writer; log() afterwards needs a new init_trackers().
  void finish() {
    for (auto& t : trackers_) t->finish();
    trackers_.clear();
    initialised_ = false;
  }

  bool initialised() const { return initialised_; }
  /// project_dir/project_name (also on processes that do not write).
  const std::filesystem::path& directory() const { return dir_; }
  /// The active writers (empty on processes that do not write).
  const std::vector<std::unique_ptr<Tracker>>& trackers() const { return trackers_; }

 private:
  bool initialised_ = false;
  int64_t step_ = 0;
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<Tracker>> trackers_;
};

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_TRACKERS_HPP
