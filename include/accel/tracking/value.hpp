// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::tracking::Value, the scalar or string that log() and
/// init_trackers() take, and its JSON and CSV spellings.
#ifndef ACCEL_TRACKING_VALUE_HPP
#define ACCEL_TRACKING_VALUE_HPP

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>

#include <nlohmann/json_fwd.hpp>

namespace accel::tracking {

/// bool, integer, floating-point or string. Any arithmetic type converts
/// (size_t, float, int...), so {{"loss", loss.item<double>()}, {"epoch", e}} works.
class Value {
 public:
  using variant_type = std::variant<bool, int64_t, double, std::string>;

  template <class T>
    requires std::is_arithmetic_v<T>
  Value(T v) {  // NOLINT(google-explicit-constructor): brace lists of values
    if constexpr (std::is_same_v<T, bool>)
      v_ = v;
    else if constexpr (std::is_integral_v<T>)
      v_ = static_cast<int64_t>(v);
    else
      v_ = static_cast<double>(v);
  }
  Value(std::string s) : v_(std::move(s)) {}  // NOLINT(google-explicit-constructor)
  Value(const char* s) : v_(std::string(s)) {}  // NOLINT(google-explicit-constructor)

  const variant_type& get() const { return v_; }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }

  /// The number TensorBoard plots (bool as 0/1); nullopt for strings.
  std::optional<double> as_number() const {
    if (auto* b = std::get_if<bool>(&v_)) return *b ? 1.0 : 0.0;
    if (auto* i = std::get_if<int64_t>(&v_)) return static_cast<double>(*i);
    if (auto* d = std::get_if<double>(&v_)) return *d;
    return std::nullopt;
  }

  /// JSON value; NaN and infinities (not JSON) become the strings "nan", "inf", "-inf".
  /// A template so that only its callers compile nlohmann's json (they include it).
  template <class Json = nlohmann::json>
  Json to_json() const {
    return std::visit(
        [](const auto& x) -> Json {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, double>) {
            if (std::isnan(x)) return "nan";
            if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
          }
          return x;
        },
        v_);
  }

  /// CSV cell: numbers with full precision (%.17g round-trips a double),
  /// strings quoted when they hold a comma, quote or line break.
  std::string to_csv() const {
    return std::visit(
        [](const auto& x) -> std::string {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, bool>) {
            return x ? "true" : "false";
          } else if constexpr (std::is_same_v<X, int64_t>) {
            return std::to_string(x);
          } else if constexpr (std::is_same_v<X, double>) {
            char buf[40];
            std::snprintf(buf, sizeof buf, "%.17g", x);
            return buf;
          } else {
            if (x.find_first_of(",\"\r\n") == std::string::npos) return x;
            std::string q = "\"";
            for (char c : x) q += c == '"' ? std::string("\"\"") : std::string(1, c);
            return q + "\"";
          }
        },
        v_);
  }

 private:
  variant_type v_;
};

/// What log() takes: name -> value (keys in sorted order in every output).
using Values = std::map<std::string, Value>;
/// What init_trackers() takes: the run's hyper-parameters.
using Config = std::map<std::string, Value>;

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_VALUE_HPP
