// Built against single_include/accel/accel.hpp alone: the amalgamated header
// must stand on its own (every accel header inlined, nothing left that needs
// include/) and work like the headers it came from.
#include <accel/accel.hpp>

#if __has_include(<accel/sched/one_cycle_lr.hpp>) || __has_include(<accel/runtime/process_env.hpp>)
#error "include/ is on the include path: this test must see the single header only"
#endif

#include <cstdlib>
#include <string>

#include "catch.hpp"
#include <torch/torch.h>

#include "../unit/sched/sched_baselines.hpp"

TEST_CASE("single header: version macros and string agree", "[single_include]") {
  CHECK(std::string(accel::version_string) == std::to_string(ACCEL_VERSION_MAJOR) + "." +
                                                   std::to_string(ACCEL_VERSION_MINOR) + "." +
                                                   std::to_string(ACCEL_VERSION_PATCH));
}

TEST_CASE("single header: ProcessEnv reads torchrun variables", "[single_include]") {
  for (const char* n : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                        "SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})
    ::unsetenv(n);
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  auto env = accel::runtime::ProcessEnv::discover();
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  CHECK(env.rank == 2);
  CHECK(env.world_size == 4);
  CHECK(env.source == "torchrun");
  CHECK(accel::runtime::ProcessEnv::discover().world_size == 1);
}

TEST_CASE("single header: OneCycleLR inside a prepared training loop", "[single_include]") {
  // The reference case "cos_default": max_lr 0.1, 100 steps, SGD momentum.
  const auto& ref = accel_test::sched_baselines::one_cycle_cases.front();
  REQUIRE(std::string(ref.name) == "cos_default");

  auto net = torch::nn::Linear(2, 1);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
  accel::sched::OneCycleLR sched(sgd, 0.1, 100);
  accel::Accelerator<> acc;
  CHECK(acc.num_processes() == 1);
  auto [model, opt, s] = acc.prepare(net, sgd, sched);
  for (int step = 0; step < 10; ++step) {
    acc.backward(model(torch::ones({4, 2})).pow(2).mean());
    opt.step();
    s.step();
    opt.zero_grad();
  }
  CHECK(sched.step_count() == 10);
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(ref.lr[10][0]).epsilon(1e-12));
  CHECK(static_cast<torch::optim::SGDOptions&>(sgd.param_groups()[0].options()).momentum() ==
        Approx(ref.momentum[10][0]).epsilon(1e-12));
}

TEST_CASE("single header: LinearWarmup", "[single_include]") {
  torch::optim::SGD sgd(torch::nn::Linear(2, 1)->parameters(), torch::optim::SGDOptions(0.2));
  accel::sched::LinearWarmup warm(sgd, {.warmup_steps = 4, .start_factor = 0.0, .total_steps = 8});
  for (int i = 0; i < 6; ++i) warm.step();
  CHECK(warm.get_last_lr().at(0) == Approx(0.2 * 2.0 / 4.0));
}
