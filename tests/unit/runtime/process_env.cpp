#include <accel/runtime/process_env.hpp>

#include <cstdlib>

#include "catch.hpp"

namespace {
// Sets the variables for one test and restores the previous values after it.
struct ScopedEnv {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const char* n : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
                          "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR",
                          "MASTER_PORT"}) {
      const char* v = std::getenv(n);
      saved.emplace_back(n, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(n);
    }
    for (auto& [n, v] : vars) ::setenv(n, v, 1);
  }
  ~ScopedEnv() {
    for (auto& [n, v] : saved) {
      if (v) ::setenv(n.c_str(), v->c_str(), 1); else ::unsetenv(n.c_str());
    }
  }
};
}  // namespace

TEST_CASE("no launcher variables means one process", "[runtime][env]") {
  ScopedEnv env({});
  auto e = accel::runtime::ProcessEnv::discover();
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);
  CHECK(e.source == "none");
  CHECK_FALSE(e.distributed());
}

TEST_CASE("torchrun variables win over MPI and Slurm", "[runtime][env]") {
  ScopedEnv env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
                 {"OMPI_COMM_WORLD_SIZE", "8"}, {"MASTER_PORT", "1234"}});
  auto e = accel::runtime::ProcessEnv::discover();
  CHECK(e.rank == 3);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.master_port == 1234);
  CHECK(e.source == "torchrun");
}

TEST_CASE("OpenMPI, then PMI, then Slurm", "[runtime][env]") {
  {
    ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                   {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}});
    auto e = accel::runtime::ProcessEnv::discover();
    CHECK(e.source == "openmpi");
    CHECK(e.rank == 1);
  }
  {
    ScopedEnv env({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"SLURM_PROCID", "5"},
                   {"SLURM_NTASKS", "6"}});
    CHECK(accel::runtime::ProcessEnv::discover().source == "pmi");
  }
  {
    ScopedEnv env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}});
    auto e = accel::runtime::ProcessEnv::discover();
    CHECK(e.source == "slurm");
    CHECK(e.rank == 5);
    CHECK(e.world_size == 6);
  }
}

TEST_CASE("bad rank variables are a clear error", "[runtime][env]") {
  {
    ScopedEnv env({{"RANK", "two"}, {"WORLD_SIZE", "4"}});
    CHECK_THROWS_WITH(accel::runtime::ProcessEnv::discover(),
                      Catch::Matchers::ContainsSubstring("RANK='two' is not an integer"));
  }
  {
    ScopedEnv env({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
    CHECK_THROWS_WITH(accel::runtime::ProcessEnv::discover(),
                      Catch::Matchers::ContainsSubstring("rank 4 is outside world size 4"));
  }
}

TEST_CASE("half of torchrun's variables, or a world size below 1, is an error", "[runtime][env]") {
  using accel::runtime::ProcessEnv;
  using Catch::Matchers::ContainsSubstring;
  {
    ScopedEnv env({{"RANK", "1"}});
    CHECK_THROWS_WITH(ProcessEnv::discover(), ContainsSubstring("RANK=1 is set but WORLD_SIZE is not"));
  }
  {
    ScopedEnv env({{"WORLD_SIZE", "-3"}});
    CHECK_THROWS_WITH(ProcessEnv::discover(), ContainsSubstring("WORLD_SIZE=-3 is set but RANK is not"));
  }
  {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "-3"}});
    CHECK_THROWS_WITH(ProcessEnv::discover(), ContainsSubstring("world size -3 (from torchrun variables) is not a number of processes"));
  }
}

TEST_CASE("yes/no variables take Accelerate's spellings and refuse others", "[runtime][env]") {
  using accel::runtime::detail::getenv_flag;
  struct Restore {
    ~Restore() { ::unsetenv("ACCEL_TEST_FLAG"); }
  } restore;
  CHECK_FALSE(getenv_flag("ACCEL_TEST_FLAG"));
  for (const char* yes : {"1", "y", "YES", "t", "True", "on"}) {
    ::setenv("ACCEL_TEST_FLAG", yes, 1);
    CHECK(getenv_flag("ACCEL_TEST_FLAG"));
  }
  for (const char* no : {"0", "n", "No", "f", "FALSE", "off", ""}) {
    ::setenv("ACCEL_TEST_FLAG", no, 1);
    CHECK_FALSE(getenv_flag("ACCEL_TEST_FLAG"));
  }
  ::setenv("ACCEL_TEST_FLAG", "banana", 1);
  CHECK_THROWS_WITH(getenv_flag("ACCEL_TEST_FLAG"),
                    Catch::Matchers::ContainsSubstring("ACCEL_TEST_FLAG='banana' is neither yes nor no"));
}
