// Twin of nccl_without_nccl_fail.cpp: the same program with backend::Gloo compiles.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>

int main() {
  accel::Accelerator<accel::backend::Gloo>* acc = nullptr;
  (void)acc;
}
