// expected-error {{accel: save_state(), load_state(), load_latest_state() and save_model() need #include <accel/checkpoint.hpp>}}
// Built without the tests' precompiled header: accelerator.hpp alone.
#include <accel/accelerator.hpp>

int main() {
  accel::Accelerator<> acc;
  acc.save_state("checkpoint");
}
