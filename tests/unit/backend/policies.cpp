// The backend policies themselves (include/accel/backend/): what each says
// about itself, the device and communicator it makes on one process, the
// errors of one this build lacks, and a user-written one in an Accelerator.
// Their communicators across processes: tests/unit/runtime/communicator.cpp.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>

#include "catch.hpp"

namespace {

torch::Device expected_device(int local_rank) {
  if (!torch::cuda::is_available()) return torch::Device(torch::kCPU);
  return torch::Device(torch::kCUDA,
                       static_cast<c10::DeviceIndex>(local_rank % static_cast<int>(torch::cuda::device_count())));
}

accel::runtime::ProcessEnv env_of(int rank, int world_size, int local_rank) {
  accel::runtime::ProcessEnv env;
  env.rank = rank;
  env.world_size = world_size;
  env.local_rank = local_rank;
  env.local_world_size = world_size;
  return env;
}

// Written as docs/backends.md "Writing a backend" says; counts its calls.
struct MyBackend {
  static constexpr std::string_view name = "MyBackend";
  static constexpr bool multi_process = false;
  static constexpr bool available = true;
  static inline int devices_made = 0;
  static inline accel::runtime::Communicator* last_made = nullptr;
  static torch::Device device(const accel::runtime::ProcessEnv&) {
    ++devices_made;
    return torch::Device(torch::kCPU);
  }
  static std::shared_ptr<accel::runtime::Communicator> make_communicator(const accel::runtime::ProcessEnv&,
                                                                         const accel::AcceleratorOptions&) {
    auto comm = std::make_shared<accel::runtime::LocalCommunicator>();
    last_made = comm.get();
    return comm;
  }
};

}  // namespace

TEST_CASE("backend policies: the built-in ones satisfy the concept, other types do not", "[runtime][backend]") {
  STATIC_REQUIRE(accel::is_backend_policy_v<accel::backend::SingleDevice>);
  STATIC_REQUIRE(accel::is_backend_policy_v<accel::backend::Gloo>);
  STATIC_REQUIRE(accel::is_backend_policy_v<accel::backend::Mpi>);
  STATIC_REQUIRE(accel::is_backend_policy_v<accel::backend::Nccl>);
  STATIC_REQUIRE(accel::is_backend_policy_v<MyBackend>);
  STATIC_REQUIRE_FALSE(accel::is_backend_policy_v<int>);
  STATIC_REQUIRE_FALSE(accel::is_backend_policy_v<accel::precision::Bf16>);
  STATIC_REQUIRE_FALSE(accel::backend::SingleDevice::multi_process);
  STATIC_REQUIRE(accel::backend::Gloo::multi_process);
  // available says what this build compiled, as the config macros do.
  STATIC_REQUIRE(accel::backend::Mpi::available == bool(ACCEL_WITH_MPI));
  STATIC_REQUIRE(accel::backend::Nccl::available == bool(ACCEL_WITH_NCCL));
  // The names `accel launch` and config files use.
  CHECK(accel::backend::SingleDevice::config_name == "single");
  CHECK(accel::backend::Gloo::config_name == "gloo");
  CHECK(accel::backend::Mpi::config_name == "mpi");
  CHECK(accel::backend::Nccl::config_name == "nccl");
}

TEST_CASE("backend policies: SingleDevice ignores the launcher's ranks", "[runtime][backend]") {
  const auto env = env_of(2, 4, 1);
  const auto comm = accel::backend::SingleDevice::make_communicator(env, {});
  CHECK(comm->size() == 1);
  CHECK(comm->rank() == 0);
  // Device 0 when there is CUDA, whatever the local rank says.
  CHECK(accel::backend::SingleDevice::device(env) == expected_device(0));
}

TEST_CASE("backend policies: Gloo picks the device by local rank and needs no peers for one process",
          "[runtime][backend]") {
  CHECK(accel::backend::Gloo::device(env_of(3, 4, 3)) == expected_device(3));
  const auto comm = accel::backend::Gloo::make_communicator(env_of(0, 1, 0), {});
  CHECK(comm->size() == 1);
  CHECK(comm->backend_name() == "Local");
  auto t = torch::arange(4, torch::kFloat);
  comm->all_reduce(t, accel::runtime::ReduceOp::Sum)->wait();
  CHECK(torch::equal(t, torch::arange(4, torch::kFloat)));
}

TEST_CASE("backend policies: a backend this machine or build lacks says what to use", "[runtime][backend]") {
  if (torch::cuda::is_available())
    CHECK(accel::backend::Nccl::device(env_of(1, 2, 1)) == expected_device(1));  // it lacks nothing here
  else
    CHECK_THROWS_WITH(accel::backend::Nccl::device(env_of(0, 2, 0)),
                      Catch::Matchers::ContainsSubstring("backend::Nccl needs a CUDA device") &&
                          Catch::Matchers::ContainsSubstring("backend::Gloo"));
  if constexpr (!ACCEL_WITH_NCCL)
    CHECK_THROWS_WITH(accel::backend::Nccl::make_communicator(env_of(0, 2, 0), {}),
                      Catch::Matchers::ContainsSubstring("backend::Nccl is not available in this build") &&
                          Catch::Matchers::ContainsSubstring("Use backend::Gloo"));
  if constexpr (!ACCEL_WITH_MPI)
    CHECK_THROWS_WITH(accel::backend::Mpi::make_communicator(env_of(0, 2, 0), {}),
                      Catch::Matchers::ContainsSubstring("backend::Mpi is not available in this build") &&
                          Catch::Matchers::ContainsSubstring("Use backend::Gloo"));
}

TEST_CASE("backend policies: an Accelerator takes a user-written backend's device and communicator",
          "[runtime][backend]") {
  MyBackend::devices_made = 0;
  MyBackend::last_made = nullptr;
  accel::Accelerator<MyBackend> acc;
  CHECK(MyBackend::devices_made == 1);
  CHECK(&acc.communicator() == MyBackend::last_made);
  CHECK(acc.device() == torch::Device(torch::kCPU));
  CHECK(acc.num_processes() == 1);
  auto net = torch::nn::Linear(2, 1);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, opt] = acc.prepare(net, sgd);
  acc.backward(model(torch::ones({3, 2})).sum());
  opt.step();
  CHECK_FALSE(opt.step_was_skipped());
}
