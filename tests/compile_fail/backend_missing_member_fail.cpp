// expected-error {{accel: this backend policy has no `static std::shared_ptr<runtime::Communicator> make_communicator(...)`}}
#include <accel/accelerator.hpp>

// A backend written by a user who left out make_communicator: the error names
// that member, not only "not a backend policy".
struct MyBackend {
  static constexpr std::string_view name = "mine";
  static constexpr bool multi_process = false;
  static constexpr bool available = true;
  static torch::Device device(const accel::runtime::ProcessEnv&) { return torch::Device(torch::kCPU); }
};

int main() {
  accel::Accelerator<MyBackend> acc;
  (void)acc;
}
