// Twin of backend_missing_member_fail.cpp: with make_communicator the user's
// backend is a backend policy and the Accelerator compiles.
#include <accel/accelerator.hpp>

struct MyBackend {
  static constexpr std::string_view name = "mine";
  static constexpr bool multi_process = false;
  static constexpr bool available = true;
  static torch::Device device(const accel::runtime::ProcessEnv&) { return torch::Device(torch::kCPU); }
  static std::shared_ptr<accel::runtime::Communicator> make_communicator(const accel::runtime::ProcessEnv&,
                                                                         const accel::AcceleratorOptions&) {
    return std::make_shared<accel::runtime::LocalCommunicator>();
  }
};

int main() {
  static_assert(accel::BackendPolicy<MyBackend>);
  static_assert(accel::check_backend_policy<MyBackend>::value);
  accel::Accelerator<MyBackend> acc;
  (void)acc;
}
