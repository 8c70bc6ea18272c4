// Catch2's main for every test executable, made rank-aware: under mpirun or a
// launcher each rank reports with its rank in the name of its output.
#if ACCEL_TEST_CATCH2_V3
#include <catch2/catch_session.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif
#include <torch/torch.h>

namespace {
bool all_skipped = false;  ///< every test case that ran was skipped (Catch2 v3's SKIP)
}  // namespace

#if ACCEL_TEST_CATCH2_V3
class AccelSkipListener : public Catch::EventListenerBase {
 public:
  using Catch::EventListenerBase::EventListenerBase;
  void testRunEnded(Catch::TestRunStats const& stats) override {
    const auto& cases = stats.totals.testCases;
    all_skipped = cases.total() > 0 && cases.skipped == cases.total();
  }
};
CATCH_REGISTER_LISTENER(AccelSkipListener)
#endif

int main(int argc, char* argv[]) {
  // One intra-op thread: tests fork workers and two of them share 2 cores.
  at::set_num_threads(1);
  const int rc = Catch::Session().run(argc, argv);
  // ctest reads exit code 4 as "skipped" (SKIP_RETURN_CODE, tests/CMakeLists.txt),
  // but Catch2 also exits with the number of failed assertions: 4 failures
  // must stay a failure.
  if (rc == 4 && !all_skipped) return 5;
  return rc;
}
