// Twin of shard_with_single_device_fail.cpp: sharding with a multi-process
// backend compiles.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>

int main() {
  using A = accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32,
                               accel::shard::ShardOptimizer>;
  static_assert(accel::check_accelerator_policies<accel::backend::Gloo, accel::precision::Fp32,
                                                  accel::shard::ShardOptimizer>::value);
  A* never_constructed = nullptr;
  (void)never_constructed;
}
