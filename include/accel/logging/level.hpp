// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::logging::Level (spdlog's levels), their names, and
/// the level a new logger gets: ACCEL_LOG_LEVEL, else info.
#ifndef ACCEL_LOGGING_LEVEL_HPP
#define ACCEL_LOGGING_LEVEL_HPP

#include <array>
#include <cctype>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <spdlog/common.h>

#include <accel/errors.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::logging {

/// spdlog's levels: spdlog::level::trace, debug, info, warn, err, critical, off.
using Level = spdlog::level::level_enum;

namespace detail {

/// The names ACCEL_LOG_LEVEL accepts (any case), least to most severe.
inline constexpr std::array<std::pair<std::string_view, Level>, 7> kLevelNames{{
    {"trace", Level::trace},
    {"debug", Level::debug},
    {"info", Level::info},
    {"warning", Level::warn},
    {"error", Level::err},
    {"critical", Level::critical},
    {"off", Level::off},
}};

}  // namespace detail

/// The level named `name` (trace, debug, info, warning, error, critical or
/// off, any case); empty when it names none.
inline std::optional<Level> parse_level(std::string_view name) {
  std::string lower(name);
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& [n, level] : detail::kLevelNames)
    if (lower == n) return level;
  return std::nullopt;
}

/// The name parse_level() reads for `level` ("warning", not spdlog's "warn").
inline std::string_view level_name(Level level) {
  for (const auto& [n, l] : detail::kLevelNames)
    if (l == level) return n;
  return "off";
}

/// The level ACCEL_LOG_LEVEL names; info when it is unset or empty. Any
/// other value is a ConfigError that names the variable and the choices.
inline Level level_from_env() {
  auto value = runtime::detail::getenv_str("ACCEL_LOG_LEVEL");
  if (!value) return Level::info;
  if (auto level = parse_level(*value)) return *level;
  // The choices spelled out (as kLevelNames has them) so that docs/errors.md shows them.
  throw ConfigError(accel::detail::concat(
      "accel: environment variable ACCEL_LOG_LEVEL='", value->substr(0, 100),
      "' is not a log level. Set it to one of trace, debug, info, warning, error, critical, off "
      "(any case), or unset it for info."));
}

}  // namespace accel::logging

#endif  // ACCEL_LOGGING_LEVEL_HPP
