// Compiled by clang++ in CI (ctest clang.torch_free_headers): every accel
// header that does not need LibTorch, under -Wall -Wextra -Werror. The
// LibTorch-dependent headers cannot be checked with clang here: LibTorch
// 1.13's own <torch/torch.h> does not compile under clang in C++20 mode
// (an incomplete c10::IValue inside std::vector), with libstdc++ or libc++.
#include <accel/checkpoint/detail/file_io.hpp>
#include <accel/checkpoint/detail/safetensors_format.hpp>
#include <accel/config.hpp>
#include <accel/data/detail/prefetcher.hpp>
#include <accel/data/loader_options.hpp>
#include <accel/data/loader_state.hpp>
#include <accel/errors.hpp>
#include <accel/launch.hpp>
#include <accel/launch/detail/config_keys.hpp>
#include <accel/launch/detail/elastic.hpp>
#include <accel/launch/detail/worker_pool.hpp>
#include <accel/options.hpp>
#include <accel/runtime/detail/tcp_probe.hpp>
#include <accel/runtime/detail/wait_reports.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/version.hpp>

int main() {
  auto env = accel::runtime::ProcessEnv::discover();
  accel::LaunchOptions launch;
  accel::AcceleratorOptions options;
  return env.world_size >= 1 && launch.num_processes == 1 && options.bucket_cap_mb > 0 ? 0 : 1;
}
