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

// A test whose dependency is truly absent on this system: Catch2 v3 reports
// it as skipped (ctest: SKIP_RETURN_CODE 4 where each case is its own test).
// Catch2 v2 has no skip, and on Debian 12 tools/setup.sh installs everything
// such tests need: there a missing dependency fails, naming it.
#if ACCEL_TEST_CATCH2_V3
#define ACCEL_TEST_SKIP(msg) SKIP(msg)
#else
#define ACCEL_TEST_SKIP(msg) FAIL("cannot run (tools/setup.sh installs it): " << msg)
#endif

#endif  // ACCEL_TESTS_SUPPORT_CATCH_HPP
