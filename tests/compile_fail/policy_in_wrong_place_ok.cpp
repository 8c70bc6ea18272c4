// Twin of policy_in_wrong_place_fail.cpp: the precision in its own place compiles.
#include <accel/accelerator.hpp>

int main() {
  static_assert(accel::check_accelerator_policies<accel::backend::SingleDevice, accel::precision::Bf16,
                                                  accel::shard::Replicate>::value);
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16>* never_constructed = nullptr;
  (void)never_constructed;
}
