// expected-error {{accel: save_state(), load_state(), load_latest_state() and save_model() need #include <accel/checkpoint.hpp>}}
// and the same error for each area accelerator.hpp declares but does not
// compile: the object collectives, the trackers, the profiler.
// Built without the tests' precompiled header: accelerator.hpp alone.
#include <accel/accelerator.hpp>

int main() {
  accel::Accelerator<> acc;
  acc.save_state("checkpoint");
  (void)acc.gather_object(1);
  acc.init_trackers("project");
  auto trace = acc.profile("trace");
}
