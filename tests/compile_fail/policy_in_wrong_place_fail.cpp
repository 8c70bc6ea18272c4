// expected-error {{accel: the Backend parameter of Accelerator is not a backend policy}}
#include <accel/accelerator.hpp>

// A precision given where the backend goes (Accelerate's Accelerator takes
// mixed_precision first): one message says which parameter and what to use.
int main() {
  accel::Accelerator<accel::precision::Bf16> acc;
  (void)acc;
}
