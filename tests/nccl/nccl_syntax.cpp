// Compiled with -fsyntax-only by ctest nccl.syntax where the CUDA toolkit's
// NCCL headers exist: backend::Nccl and NcclCommunicator as a CUDA build of
// LibTorch sees them (ACCEL_WITH_NCCL=1), checked on a CPU machine. Running
// them needs a GPU (issue 8).
#include <accel/accelerator.hpp>

int main() {
  accel::Accelerator<accel::backend::Nccl, accel::precision::Bf16>* acc = nullptr;
  auto make = &accel::runtime::make_nccl_communicator;
  (void)acc;
  (void)make;
}
