// Issue 19's two costs, measured in one run (bench/README.md section 8):
//
// 1. Activation checkpointing: a W-like deep MLP (`layers` residual blocks
//    x + Linear(h,h)(gelu(Linear(h,h)(x))), h = `hidden`, batch `batch`, Adam)
//    trained on one process with and without accel::checkpoint_sequential:
//    median step time and the peak resident memory of one forward+backward
//    above what the process held before it (the activations; the kernel's
//    high-water mark reset through /proc/self/clear_refs).
// 2. Profiling: W on 2 Gloo processes (forked by notebook_launcher), step time
//    without profile(), inside profile() (LibTorch's operators + accel's
//    events), and the cost of one accel event site when nothing records.
//
//   profile_and_checkpoint [hidden=1024] [layers=24] [batch=256] [steps=10]
#include <accel/accelerator.hpp>
#include <accel/profiling.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/memory/checkpoint.hpp>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double status_mb(const char* key) {  // a field of /proc/self/status, in MB
  std::ifstream f("/proc/self/status");
  std::string k;
  double kb = 0;
  while (f >> k) {
    if (k == key) {
      f >> kb;
      return kb / 1e3;
    }
    f.ignore(1 << 12, '\n');
  }
  return 0;
}
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }  // VmHWM := VmRSS

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  explicit BlockImpl(int64_t h) {
    fc1 = register_module("fc1", torch::nn::Linear(h, h));
    fc2 = register_module("fc2", torch::nn::Linear(h, h));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
};
TORCH_MODULE(Block);

struct Result {
  double step_ms, peak_mb;
};

Result deep_mlp(bool checkpointed, int64_t hidden, int layers, int64_t batch, int steps) {
  accel::Accelerator<> acc;
  torch::manual_seed(1);
  torch::nn::Sequential blocks;
  for (int l = 0; l < layers; ++l) blocks->push_back(Block(hidden));
  torch::optim::Adam adam(blocks->parameters(), torch::optim::AdamOptions(1e-4));
  auto [m, opt] = acc.prepare(blocks, adam);
  auto x = torch::randn({batch, hidden});
  auto y = torch::randn({batch, hidden});
  std::vector<double> times;
  double peak = 0;
  for (int s = 0; s <= steps; ++s) {  // step 0 allocates Adam's state
    const double before = status_mb("VmRSS:");
    reset_peak();
    const auto t0 = Clock::now();
    auto out = checkpointed ? accel::checkpoint_sequential(blocks, x) : m(x);
    acc.backward(torch::mse_loss(out, y));
    opt.step();
    opt.zero_grad();
    if (s == 0) continue;
    times.push_back(ms_since(t0));
    peak = std::max(peak, status_mb("VmHWM:") - before);
  }
  return {median(times), peak};
}

// W (shared/WORKLOAD.md) on each rank: median step time with and without
// profiling, written to out_<rank>.txt.
void w_rank(std::string out, int steps) {
  accel::Accelerator<accel::backend::Gloo> acc;
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                              torch::nn::ReLU(), torch::nn::Linear(2048, 2048), torch::nn::ReLU(),
                              torch::nn::Linear(2048, 10));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto [m, opt] = acc.prepare(model, sgd);
  torch::manual_seed(2 + acc.process_index());
  auto x = torch::randn({64, 784});
  auto y = torch::randint(0, 10, {64});
  auto step = [&] {
    acc.wait_for_everyone();
    const auto t0 = Clock::now();
    opt.zero_grad();
    acc.backward(torch::cross_entropy_loss(m(x), y));
    opt.step();
    return ms_since(t0);
  };
  step();
  std::vector<double> plain, profiled;
  for (int round = 0; round < 2; ++round) {  // alternated, so drift hits both
    for (int s = 0; s < steps; ++s) plain.push_back(step());
    auto trace = acc.profile(out + "_trace");
    for (int s = 0; s < steps; ++s) profiled.push_back(step());
  }
  // One event site when nothing records: what every bucket, step and batch pays.
  constexpr int kSites = 10'000'000;
  const auto t0 = Clock::now();
  for (int i = 0; i < kSites; ++i) {
    accel::profiling::Span span("unused", "bench");
    span.arg("i", i);
  }
  const double site_ns = ms_since(t0) * 1e6 / kSites;
  std::ofstream(out + "_" + std::to_string(acc.process_index()) + ".txt")
      << median(plain) << ' ' << median(profiled) << ' ' << site_ns << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t hidden = argc > 1 ? std::atoll(argv[1]) : 1024;
  const int layers = argc > 2 ? std::atoi(argv[2]) : 24;
  const int64_t batch = argc > 3 ? std::atoll(argv[3]) : 256;
  const int steps = argc > 4 ? std::atoi(argv[4]) : 10;
  mallopt(M_MMAP_THRESHOLD, 1 << 16);  // large tensors come from mmap and go back on free: RSS follows them
  torch::set_num_threads(1);

  std::printf("## activation checkpointing: %d residual blocks of width %lld, batch %lld, Adam, %d steps\n\n",
              layers, static_cast<long long>(hidden), static_cast<long long>(batch), steps);
  const auto plain = deep_mlp(false, hidden, layers, batch, steps);
  const auto ckpt = deep_mlp(true, hidden, layers, batch, steps);
  std::printf("| | step ms (median) | peak MB above the step's start |\n|---|---|---|\n");
  std::printf("| plain | %.1f | %.1f |\n| checkpoint_sequential | %.1f | %.1f |\n", plain.step_ms, plain.peak_mb,
              ckpt.step_ms, ckpt.peak_mb);
  std::printf("| ratio | %.2fx | %.2fx less |\n\n", ckpt.step_ms / plain.step_ms, plain.peak_mb / ckpt.peak_mb);

  const auto dir = std::filesystem::temp_directory_path() / "accel-bench-profile";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto out = (dir / "w").string();
  accel::notebook_launcher(w_rank, std::make_tuple(out, steps), {.num_processes = 2, .master_port = 0});
  std::printf("## profiling: W on 2 Gloo processes, %d steps x 2 rounds each way\n\n", steps);
  std::printf("| rank | step ms | step ms in profile() | overhead | one event site, not recording |\n"
              "|---|---|---|---|---|\n");
  for (int r = 0; r < 2; ++r) {
    std::ifstream f(out + "_" + std::to_string(r) + ".txt");
    double p = 0, q = 0, ns = 0;
    f >> p >> q >> ns;
    std::printf("| %d | %.1f | %.1f | %+.1f %% | %.2f ns |\n", r, p, q, (q / p - 1) * 100, ns);
  }
  return 0;
}
