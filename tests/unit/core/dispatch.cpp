// dispatch_accelerator: run-time choice -> compile-time policies.
#include <accel/dispatch.hpp>

#include "catch.hpp"

namespace {
using Backends = std::tuple<accel::backend::SingleDevice, accel::backend::Gloo>;
using Precisions = std::tuple<accel::precision::Fp32, accel::precision::Bf16>;
using Shards = std::tuple<accel::shard::Replicate, accel::shard::ShardOptimizer>;
}  // namespace

TEST_CASE("the matching Accelerator is instantiated and called", "[core][dispatch]") {
  std::string seen;
  auto record = [&](auto& acc) {
    using A = std::remove_reference_t<decltype(acc)>;
    seen = std::string(A::backend_type::name) + "/" + std::string(A::precision_type::name) + "/" +
           std::string(A::shard_type::name);
    CHECK(acc.num_processes() == 1);
  };
  accel::dispatch_accelerator<Backends, Precisions, Shards>({"single", "bf16", "replicate"}, record);
  CHECK(seen == "SingleDevice/bf16/Replicate");
  accel::dispatch_accelerator<Backends, Precisions, Shards>({"single", "no", "replicate"}, record);
  CHECK(seen == "SingleDevice/no/Replicate");
}

TEST_CASE("a choice nothing compiled serves lists what is available", "[core][dispatch]") {
  auto never = [](auto&) { FAIL("must not be called"); };
  // Sharding with one device is not a valid combination, so it is not listed.
  CHECK_THROWS_WITH((accel::dispatch_accelerator<Backends, Precisions, Shards>(
                        {"single", "no", "shard_optimizer"}, never)),
                    Catch::Matchers::ContainsSubstring("no compiled Accelerator serves backend=single precision=no "
                                    "shard=shard_optimizer") &&
                        Catch::Matchers::ContainsSubstring("backend=gloo precision=bf16 shard=shard_optimizer") &&
                        !Catch::Matchers::ContainsSubstring("backend=single precision=no shard=shard_optimizer\n"));
  CHECK_THROWS_AS((accel::dispatch_accelerator<Backends, Precisions, Shards>({"nccl", "no", "replicate"}, never)),
                  accel::ConfigError);
}

TEST_CASE("choices from a config file and from the environment", "[core][dispatch]") {
  accel::LaunchConfig cfg;
  cfg.distributed_type = accel::DistributedType::MultiCpu;
  cfg.mixed_precision = "bf16";
  auto c = accel::PolicyChoice::from_config(cfg);
  CHECK(c.backend == "gloo");
  CHECK(c.precision == "bf16");
  CHECK(c.shard == "replicate");
  cfg.backend = "mpi";
  CHECK(accel::PolicyChoice::from_config(cfg).backend == "mpi");
  ::setenv("ACCEL_BACKEND", "single", 1);
  ::setenv("ACCEL_MIXED_PRECISION", "bf16", 1);
  auto e = accel::PolicyChoice::from_environment();
  ::unsetenv("ACCEL_BACKEND");
  ::unsetenv("ACCEL_MIXED_PRECISION");
  CHECK(e.backend == "single");
  CHECK(e.precision == "bf16");
}
