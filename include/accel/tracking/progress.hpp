// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::tracking::ProgressBar: a one-line progress bar (steps,
/// rate, elapsed, ETA) redrawn with '\r' on a terminal, silent otherwise.
#ifndef ACCEL_TRACKING_PROGRESS_HPP
#define ACCEL_TRACKING_PROGRESS_HPP

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accel::tracking {

struct ProgressOptions {
  /// nullopt: on when the stream is a terminal and ACCEL_DISABLE_PROGRESS is
  /// not set; true/false force it (forcing on still needs a main process).
  std::optional<bool> enabled{};
  /// Whether this process draws at all (the Accelerator passes
  /// is_local_main_process()).
  bool main_process = true;
  std::FILE* stream = stdout;
  /// At most one redraw per interval (10/s): drawing is cheap, terminals are not.
  double min_interval_s = 0.1;
  int bar_width = 24;
};

namespace detail {

/// "05:07", or "1:02:03" past an hour; "?" for a negative or non-finite time.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%02lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  return buf;
}

/// "12.34it/s", or "2.50s/it" below one step per second (as tqdm), "?it/s" unknown.
inline std::string format_rate(double steps_per_second) {
  if (!std::isfinite(steps_per_second) || steps_per_second <= 0) return "?it/s";
  char buf[32];
  if (steps_per_second >= 1.0)
    std::snprintf(buf, sizeof buf, "%.2fit/s", steps_per_second);
  else
    std::snprintf(buf, sizeof buf, "%.2fs/it", 1.0 / steps_per_second);
  return buf;
}

/// "[######----]" with width cells; n clamped to [0, total].
inline std::string format_bar(int64_t n, int64_t total, int width) {
  if (width <= 0) return "";
  int64_t filled = 0;
  if (total > 0) filled = std::min<int64_t>(width, std::max<int64_t>(0, n) * width / total);
  std::string s = "[";
  s.append(static_cast<size_t>(filled), '#');
  s.append(static_cast<size_t>(width - filled), '-');
  s += ']';
  return s;
}

/// Values shown after the counters: "loss=0.1235" (4 significant digits).
inline std::string format_postfix(const std::vector<std::pair<std::string, double>>& values) {
  std::string s;
  for (const auto& [k, v] : values) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.4g", v);
    s += (s.empty() ? "" : ", ") + k + "=" + buf;
  }
  return s;
}

/// The whole line, without '\r': "train  40%[####------] 4/10 [00:02<00:03, 2.00it/s, loss=0.5]".
/// total <= 0 means unknown: no percentage, bar or ETA.
inline std::string format_line(const std::string& desc, int64_t n, int64_t total,
                               double elapsed_s, int bar_width,
                               const std::vector<std::pair<std::string, double>>& postfix = {}) {
  const double rate = elapsed_s > 0 ? static_cast<double>(n) / elapsed_s : 0.0;
  std::string line = desc.empty() ? "" : desc + " ";
  if (total > 0) {
    char pct[16];
    std::snprintf(pct, sizeof pct, "%3d%%",
                  static_cast<int>(100 * std::min<int64_t>(n, total) / total));
    line += pct + format_bar(n, total, bar_width) + " " + std::to_string(n) + "/" +
            std::to_string(total) + " [" + format_duration(elapsed_s) + "<" +
            format_duration(rate > 0 ? static_cast<double>(total - n) / rate : -1.0) + ", ";
  } else {
    line += std::to_string(n) + " [" + format_duration(elapsed_s) + ", ";
  }
  line += format_rate(rate);
  if (!postfix.empty()) line += ", " + format_postfix(postfix);
  return line + "]";
}

inline bool env_disables_progress() {
  const char* v = std::getenv("ACCEL_DISABLE_PROGRESS");
  if (v == nullptr) return false;
  std::string s = v;
  return !(s.empty() || s == "0" || s == "no" || s == "false" || s == "off");
}

}  // namespace detail

/// Whether a bar with these options draws: main process, and either forced on
/// or (default) a terminal without ACCEL_DISABLE_PROGRESS.
inline bool progress_enabled(const ProgressOptions& o) {
  if (!o.main_process || o.stream == nullptr) return false;
  if (o.enabled) return *o.enabled;
  if (detail::env_disables_progress()) return false;
  return ::isatty(::fileno(o.stream)) == 1;
}

/// tqdm's everyday subset. update() advances and redraws at most every
/// min_interval_s; close() (or the destructor) draws the final state and ends
/// the line. Disabled bars only count.
class ProgressBar {
 public:
  using clock = std::chrono::steady_clock;
  using Postfix = std::vector<std::pair<std::string, double>>;

  explicit ProgressBar(int64_t total, std::string desc = {}, ProgressOptions options = {})
      : total_(total), desc_(std::move(desc)), options_(options),
        enabled_(progress_enabled(options_)), start_(clock::now()) {
    if (enabled_) draw();
  }
  ProgressBar(ProgressBar&& o) noexcept
      : total_(o.total_), n_(o.n_), desc_(std::move(o.desc_)), options_(o.options_),
        enabled_(std::exchange(o.enabled_, false)), closed_(std::exchange(o.closed_, true)),
        start_(o.start_), last_draw_(o.last_draw_), postfix_(std::move(o.postfix_)),
        width_(o.width_) {}
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ProgressBar& operator=(ProgressBar&&) = delete;
  ~ProgressBar() { close(); }

  /// Advances by steps; values (e.g. {{"loss", x}}) replace the shown postfix.
  void update(int64_t steps = 1, Postfix values = {}) {
    n_ += steps;
    if (!values.empty()) postfix_ = std::move(values);
    if (!enabled_ || closed_) return;
    auto now = clock::now();
    const bool last = total_ > 0 && n_ >= total_;
    if (last || std::chrono::duration<double>(now - last_draw_).count() >= options_.min_interval_s)
      draw();
  }
  void set_postfix(Postfix values) { postfix_ = std::move(values); }
  void set_description(std::string desc) { desc_ = std::move(desc); }

  /// Final redraw and newline; idempotent.
  void close() {
    if (closed_) return;
    closed_ = true;
    if (!enabled_) return;
    draw();
    std::fputc('\n', options_.stream);
    std::fflush(options_.stream);
  }

  int64_t n() const { return n_; }
  int64_t total() const { return total_; }
  bool enabled() const { return enabled_; }
  double elapsed_seconds() const {
    return std::chrono::duration<double>(clock::now() - start_).count();
  }

 private:
  void draw() {
    last_draw_ = clock::now();
    auto line = detail::format_line(desc_, n_, total_, elapsed_seconds(), options_.bar_width,
                                    postfix_);
    // Pad with spaces so a shorter line fully covers the previous one.
    if (line.size() < width_) line.append(width_ - line.size(), ' ');
    width_ = line.size();
    std::fputc('\r', options_.stream);
    std::fputs(line.c_str(), options_.stream);
    std::fflush(options_.stream);
  }

  int64_t total_;
  int64_t n_ = 0;
  std::string desc_;
  ProgressOptions options_;
  bool enabled_;
  bool closed_ = false;
  clock::time_point start_;
  clock::time_point last_draw_{};
  Postfix postfix_;
  size_t width_ = 0;
};

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_PROGRESS_HPP
