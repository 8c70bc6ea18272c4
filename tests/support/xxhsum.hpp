// The independent reference for accel's checkpoint checksums: Debian's
// xxhsum (package xxhash, installed by tools/setup.sh), XXH64 with -H1.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace accel_test {

/// xxhsum's XXH64 of `file` (16 hex digits), or of its bytes from `offset` on.
inline std::string xxhsum(const std::filesystem::path& file, std::uint64_t offset = 0) {
  if (!std::filesystem::exists("/usr/bin/xxhsum"))
    throw std::runtime_error("/usr/bin/xxhsum is missing: tools/setup.sh installs it (package xxhash)");
  const std::string cmd = "tail -c +" + std::to_string(offset + 1) + " '" + file.string() +
                          "' | /usr/bin/xxhsum -H1 -";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + cmd);
  char out[128] = {};
  const std::size_t n = std::fread(out, 1, sizeof out - 1, pipe);
  ::pclose(pipe);
  const std::string text(out, n);
  if (text.size() < 16) throw std::runtime_error("xxhsum printed '" + text + "'");
  return text.substr(0, 16);
}

}  // namespace accel_test
