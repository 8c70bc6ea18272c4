// Catch2 v2 (Debian 12: one header) and v3 (Debian 13: a compiled library)
// behind one include. Tests are written in v3's spelling (Catch::Approx,
// Catch::Matchers::ContainsSubstring / StartsWith); under v2 the missing
// names are provided here. CMake defines ACCEL_TEST_CATCH2_V3 (tests/CMakeLists.txt).
#ifndef ACCEL_TESTS_SUPPORT_CATCH_HPP
#define ACCEL_TESTS_SUPPORT_CATCH_HPP

#if ACCEL_TEST_CATCH2_V3
#include <catch2/catch_all.hpp>
#else
#include <string>

#include <catch2/catch.hpp>
namespace Catch {
using Detail::Approx;
namespace Matchers {
inline StdString::ContainsMatcher ContainsSubstring(const std::string& text,
                                                    CaseSensitive::Choice cs = CaseSensitive::Yes) {
  return Contains(text, cs);
}
}  // namespace Matchers
}  // namespace Catch
#endif

using Catch::Approx;

#endif  // ACCEL_TESTS_SUPPORT_CATCH_HPP
