// Catch2's main for every test executable, made rank-aware: under mpirun or a
// launcher each rank reports with its rank in the name of its output.
#if ACCEL_TEST_CATCH2_V3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif
#include <torch/torch.h>

int main(int argc, char* argv[]) {
  // One intra-op thread: tests fork workers and two of them share 2 cores.
  at::set_num_threads(1);
  return Catch::Session().run(argc, argv);
}
