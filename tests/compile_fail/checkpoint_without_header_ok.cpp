// Twin of checkpoint_without_header_fail.cpp: with the checkpoint header, save_state compiles.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>

int main() {
  accel::Accelerator<> acc;
  if (acc.num_processes() < 0) acc.save_state("checkpoint");  // compiled, never run
}
