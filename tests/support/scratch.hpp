// A fresh path for one test's files: $ACCEL_TEST_TMP/<area>/<name>_<pid>
// (/tmp when unset), removed first; the area directory exists.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace test_support {

inline std::filesystem::path scratch(const std::string& area, const std::string& name) {
  const char* base = std::getenv("ACCEL_TEST_TMP");
  auto dir = std::filesystem::path(base ? base : "/tmp") / area;
  std::filesystem::create_directories(dir);
  auto p = dir / (name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p;
}

}  // namespace test_support
