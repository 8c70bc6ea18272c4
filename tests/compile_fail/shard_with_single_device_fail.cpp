// expected-error {{accel: shard::ShardOptimizer and shard::ShardGradients need more than one process}}
#include <accel/accelerator.hpp>

int main() {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Fp32,
                     accel::shard::ShardOptimizer>
      acc;
  (void)acc;
}
