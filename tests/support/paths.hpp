// Where tests find their inputs and put their files. The defaults come from
// CMake (test_paths_config.hpp), not from __FILE__ or the working directory:
// with CCACHE_BASEDIR (CI) __FILE__ is relative to the build folder, and each
// test case may run as its own process from wherever ctest starts it.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "test_paths_config.hpp"

namespace accel_test {

/// The repository's tests/ folder.
inline std::filesystem::path source_dir() { return ACCEL_TEST_SOURCE_DIR; }

/// Root of the tests' own files: $ACCEL_TEST_TMP, else <build>/tests/tmp.
inline std::filesystem::path tmp_root() {
  const char* env = std::getenv("ACCEL_TEST_TMP");
  return (env != nullptr && *env != '\0') ? std::filesystem::path(env)
                                          : std::filesystem::path(ACCEL_TEST_TMP_DEFAULT);
}

/// A fresh path for one test's files, <tmp>/<area>/<name>_<pid>, removed
/// first; the area directory exists.
inline std::filesystem::path scratch(const std::string& area, const std::string& name) {
  auto dir = tmp_root() / area;
  std::filesystem::create_directories(dir);
  auto p = dir / (name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p;
}

/// scratch(), created as an empty directory.
inline std::filesystem::path fresh_dir(const std::string& area, const std::string& name) {
  auto p = scratch(area, name);
  std::filesystem::create_directories(p);
  return p;
}

}  // namespace accel_test
