// Twin of area_without_header_fail.cpp: with the areas' headers, it compiles.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/ops.hpp>
#include <accel/profiling.hpp>
#include <accel/tracking.hpp>

int main() {
  accel::Accelerator<> acc;
  if (acc.num_processes() < 0) {  // compiled, never run
    acc.save_state("checkpoint");
    (void)acc.gather_object(1);
    acc.init_trackers("project");
    auto trace = acc.profile("trace");
  }
}
