// Per-rank memory, step time and bytes communicated of shard::Replicate,
// ShardOptimizer (ZeRO-1), ShardGradients (ZeRO-2) and ShardParameters
// (ZeRO-3) on N Gloo processes (forked by accel::notebook_launcher), for an
// MLP of `layers` Linear(hidden, hidden) with Adam. Prints a markdown table
// (bench/README.md).
//
//   zero_memory [hidden=4096] [layers=6] [steps=5] [batch=16] [processes=2]
//
// hidden 4096 x 6 layers is ~100.7M parameters (403 MB in float32), x 12
// layers ~201M.
// "peak RSS" is the rank's high-water resident memory minus what it had on
// entry (the forked image of the launcher); "state" counts the bytes of the
// tensors in Adam's per-parameter state, "grads" the gradient storage held
// between backward and step, "params" the parameter storage held between
// steps and its peak during the steps (ZeRO-3: chunks plus gathered units).
// "sent" is what the rank hands to the collectives per step
// (runtime::CountingCommunicator: the tensor of an all-reduce, the input of
// an all-gather or reduce-scatter). ShardParameters runs twice: gathering
// each unit when it computes, and with prefetch_parameters (the next unit's
// all-gather started while the current one computes). After the steps each
// run calls save_model() (to /tmp, removed afterwards): "save_model" is the
// most parameter bytes the rank held meanwhile (ZeRO-3 streams one bucket at
// a time) and its duration.
//
//   zero_memory ... [processes] [only]   only: the policies whose name starts so
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/runtime/counting_communicator.hpp>

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

namespace {

double rss_mb() {  // current resident set, from /proc
  std::ifstream f("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  f >> pages_total >> pages_resident;
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1e6;
}
double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1e3;  // KiB on Linux
}

// backend::Gloo with every collective's bytes counted.
struct CountingGloo : accel::backend::Gloo {
  static std::shared_ptr<accel::runtime::Communicator> make_communicator(const accel::runtime::ProcessEnv& env,
                                                                         const accel::AcceleratorOptions& o) {
    return std::make_shared<accel::runtime::CountingCommunicator>(accel::backend::Gloo::make_communicator(env, o));
  }
};

template <class Shard>
void worker(std::string out, int64_t hidden, int layers, int steps, int64_t batch, bool prefetch) {
  const double entry_rss = rss_mb();
  accel::Accelerator<CountingGloo, accel::precision::Fp32, Shard> acc(
      accel::AcceleratorOptions{.prefetch_parameters = prefetch});
  auto& counting = dynamic_cast<accel::runtime::CountingCommunicator&>(acc.communicator());
  torch::manual_seed(1);
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(hidden, hidden));
    if (l + 1 < layers) model->push_back(torch::nn::ReLU());
  }
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-4));
  auto [m, opt] = acc.prepare(model, adam);
  torch::manual_seed(2 + acc.process_index());
  auto x = torch::randn({batch, hidden});
  auto y = torch::randn({batch, hidden});
  double seconds = 0;
  int64_t grad_bytes = 0, sent_bytes = 0;
  auto* zero = dynamic_cast<accel::shard::detail::ZeroReducer*>(&m.gradient_sync());
  for (int s = 0; s <= steps; ++s) {  // step 0 warms up (allocates the state)
    acc.wait_for_everyone();
    counting.reset();
    auto t0 = std::chrono::steady_clock::now();
    auto loss = torch::mse_loss(m(x), y);
    acc.backward(loss);
    m.gradient_sync().finalize();
    if (s == steps) {
      if (auto* z = dynamic_cast<accel::shard::detail::ZeroReducer*>(&m.gradient_sync()))
        grad_bytes = z->gradient_bytes();
      else
        for (auto& p : model->parameters()) grad_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    opt.step();
    opt.zero_grad();
    auto t1 = std::chrono::steady_clock::now();
    if (s > 0) seconds += std::chrono::duration<double>(t1 - t0).count();
    if (s > 0) sent_bytes += counting.bytes();
    if (s == 0 && zero) zero->reset_peak_parameter_bytes();  // past prepare()'s whole model
  }
  int64_t param_bytes = 0, peak_param_bytes = 0;
  if (zero) {
    param_bytes = zero->parameter_bytes();
    peak_param_bytes = zero->peak_parameter_bytes();
  } else {
    for (auto& p : model->parameters()) param_bytes += static_cast<int64_t>(p.nbytes());
    peak_param_bytes = param_bytes;
  }
  int64_t state_bytes = 0;
  for (auto& [key, st] : opt->state()) {
    auto& a = static_cast<torch::optim::AdamParamState&>(*st);
    state_bytes += static_cast<int64_t>(a.exp_avg().nbytes() + a.exp_avg_sq().nbytes());
  }
  int64_t params = 0;
  for (auto& p : model->parameters()) params += p.numel();
  const double rss = peak_rss_mb() - entry_rss;  // before save_model
  if (zero) zero->reset_peak_parameter_bytes();
  const std::string save_dir = out + "_model";
  acc.wait_for_everyone();
  const auto s0 = std::chrono::steady_clock::now();
  acc.save_model(m, save_dir);
  const double save_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
  const int64_t save_peak = zero ? zero->peak_parameter_bytes() : param_bytes;
  if (acc.is_main_process()) std::filesystem::remove_all(save_dir);
  std::ofstream f(out + "_" + std::to_string(acc.process_index()) + ".txt");
  f << params << ' ' << rss << ' ' << seconds / steps << ' '
    << state_bytes / 1e6 << ' ' << grad_bytes / 1e6 << ' ' << param_bytes / 1e6 << ' '
    << peak_param_bytes / 1e6 << ' ' << sent_bytes / steps / 1e6 << ' ' << save_peak / 1e6 << ' '
    << save_seconds << '\n';
}

std::string only;  ///< argv[6]: run the policies whose name starts so

template <class Shard>
void run(const char* name, int64_t hidden, int layers, int steps, int64_t batch, int processes,
         bool prefetch = false) {
  if (std::string(name).rfind(only, 0) != 0) return;
  const std::string out = "/tmp/zero_memory_" + std::to_string(::getpid());
  accel::LaunchOptions lo;
  lo.num_processes = processes;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(1800);
  accel::notebook_launcher(worker<Shard>, std::make_tuple(out, hidden, layers, steps, batch, prefetch), lo);
  for (int r = 0; r < processes; ++r) {
    std::ifstream f(out + "_" + std::to_string(r) + ".txt");
    double params = 0, peak = 0, step = 0, state = 0, grads = 0, held = 0, held_peak = 0, sent = 0;
    double save_peak = 0, save_seconds = 0;
    f >> params >> peak >> step >> state >> grads >> held >> held_peak >> sent >> save_peak >> save_seconds;
    std::printf("| %s | %d/%d | %.1fM | %.0f | %.0f | %.0f | %.0f / %.0f | %.0f | %.3f | %.0f / %.1f |\n", name, r,
                processes, params / 1e6, peak, state, grads, held, held_peak, sent, step, save_peak, save_seconds);
    std::remove((out + "_" + std::to_string(r) + ".txt").c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t hidden = argc > 1 ? std::stoll(argv[1]) : 4096;
  const int layers = argc > 2 ? std::stoi(argv[2]) : 6;
  const int steps = argc > 3 ? std::stoi(argv[3]) : 5;
  const int64_t batch = argc > 4 ? std::stoll(argv[4]) : 16;
  const int processes = argc > 5 ? std::stoi(argv[5]) : 2;
  only = argc > 6 ? argv[6] : "";
  at::set_num_threads(1);
  std::printf("| policy | rank | params | peak RSS (MB) | Adam state (MB) | grads (MB) | params held / peak (MB) | sent per step (MB) | step (s) | save_model: params peak (MB) / s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  run<accel::shard::Replicate>("Replicate", hidden, layers, steps, batch, processes);
  run<accel::shard::ShardOptimizer>("ShardOptimizer", hidden, layers, steps, batch, processes);
  run<accel::shard::ShardGradients>("ShardGradients", hidden, layers, steps, batch, processes);
  run<accel::shard::ShardParameters>("ShardParameters", hidden, layers, steps, batch, processes);
  run<accel::shard::ShardParameters>("ShardParameters, prefetch", hidden, layers, steps, batch, processes, true);
}
