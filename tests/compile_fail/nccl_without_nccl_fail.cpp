// expected-error {{accel: backend::Nccl is not available in this build}}
// Built only where ACCEL_WITH_NCCL is 0 (a CPU LibTorch).
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>

int main() {
  accel::Accelerator<accel::backend::Nccl> acc;
  (void)acc;
}
