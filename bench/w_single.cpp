// Workload W (shared/WORKLOAD.md) on one process: raw LibTorch vs
// accel::Accelerator<> (backend::SingleDevice), in the same process,
// alternated round by round so every contender sees the same machine load.
//
//   build-bench/bench/w_single [rounds=5]
//
// Contenders (each round runs each contender once, in this order):
//   raw         plain LibTorch loop, batches = narrow() slices of X and Y
//   accel       prepared model + optimizer, accelerator.backward(loss),
//               batches = the same narrow() slices (measures the Accelerator)
//   accel+dl    as accel, batches from accel's data loader over
//               accel::data::TensorDataset (batch 64, no shuffle; one
//               index_select per batch, which is a copy the slices avoid)
// Each run is W: 33 steps (3 warm-up, then 3 windows of 10 steps), a fresh
// model (manual_seed(1)) every time. Reported: ms/step, minimum and median over
// all windows of all rounds, and the ratio to raw. The loss gate (step 0 and
// step 32) is checked for every run.
#include <accel/accel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "../tests/support/workload.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWarmup = 3, kWindows = 3, kWindowSteps = 10;
constexpr int kSteps = kWarmup + kWindows * kWindowSteps;  // 33
constexpr int64_t kBatch = 64;
constexpr double kLoss0 = 2.298264, kLossLast = 2.311658;

struct RunResult {
  std::vector<double> window_ms;  // ms/step of each window
  double loss0 = 0, loss_last = 0;
};

/// Runs `step(i)` (which returns the loss of step i) kSteps times with W's timing protocol.
RunResult timed_run(const std::function<torch::Tensor(int)>& step) {
  RunResult r;
  int i = 0;
  auto one = [&] {
    auto loss = step(i);
    if (i == 0) r.loss0 = loss.item<double>();
    if (i == kSteps - 1) r.loss_last = loss.item<double>();
    ++i;
  };
  for (int w = 0; w < kWarmup; ++w) one();
  for (int w = 0; w < kWindows; ++w) {
    auto t0 = Clock::now();
    for (int s = 0; s < kWindowSteps; ++s) one();
    r.window_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() /
                          kWindowSteps);
  }
  return r;
}

RunResult run_raw(const workload::Data& d) {
  auto model = workload::make_model();
  torch::optim::SGD opt(model->parameters(), workload::sgd_options());
  return timed_run([&](int i) {
    const int64_t b = i % 100;
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(d.x.narrow(0, kBatch * b, kBatch)),
                                          d.y.narrow(0, kBatch * b, kBatch));
    loss.backward();
    opt.step();
    return loss;
  });
}

RunResult run_accel(const workload::Data& d) {
  accel::Accelerator<> acc;
  auto model = workload::make_model();
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  auto [m, opt] = acc.prepare(model, sgd);
  return timed_run([&](int i) {
    const int64_t b = i % 100;
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(m(d.x.narrow(0, kBatch * b, kBatch)),
                                          d.y.narrow(0, kBatch * b, kBatch));
    acc.backward(loss);
    opt.step();
    return loss;
  });
}

RunResult run_accel_loader(const workload::Data& d) {
  accel::Accelerator<> acc;
  auto model = workload::make_model();
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  auto loader = accel::data::make_data_loader(
      accel::data::TensorDataset(d.x, d.y),
      accel::data::LoaderOptions{.batch_size = kBatch, .shuffle = false});
  auto [m, opt, dl] = acc.prepare(model, sgd, loader);
  auto it = dl.begin();  // 100 batches per epoch: W's 33 steps fit in one
  return timed_run([&](int) {
    auto& batch = *it;
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
    acc.backward(loss);
    opt.step();
    ++it;
    return loss;
  });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

bool gate_ok(const RunResult& r) {
  return std::abs(r.loss0 - kLoss0) < 5e-6 && std::abs(r.loss_last - kLossLast) < 5e-6;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  at::set_num_threads(1);
  const auto data = workload::make_data();

  struct Contender {
    std::string name;
    RunResult (*run)(const workload::Data&);
    std::vector<double> windows;
    bool gate = true;
    double loss0 = 0, loss_last = 0;
  };
  std::vector<Contender> cs{{"raw LibTorch", run_raw, {}},
                            {"accel (slices)", run_accel, {}},
                            {"accel (accel loader)", run_accel_loader, {}}};

  for (int round = 0; round < rounds; ++round) {
    for (auto& c : cs) {
      auto r = c.run(data);
      c.windows.insert(c.windows.end(), r.window_ms.begin(), r.window_ms.end());
      c.gate = c.gate && gate_ok(r);
      c.loss0 = r.loss0;
      c.loss_last = r.loss_last;
      std::printf("round %d %-22s windows ms/step:", round, c.name.c_str());
      for (double w : r.window_ms) std::printf(" %7.2f", w);
      std::printf("  loss[0]=%.6f loss[32]=%.6f\n", r.loss0, r.loss_last);
      std::fflush(stdout);
    }
  }

  const double raw_min = *std::min_element(cs[0].windows.begin(), cs[0].windows.end());
  const double raw_med = median(cs[0].windows);
  std::printf("\nW, 1 process, batch 64, %d rounds x %d windows of %d steps (ms/step)\n", rounds,
              kWindows, kWindowSteps);
  std::printf("| contender | min | median | min / raw min | median / raw median | loss[0] | loss[32] | gate |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  bool all_ok = true;
  for (auto& c : cs) {
    const double mn = *std::min_element(c.windows.begin(), c.windows.end());
    const double md = median(c.windows);
    std::printf("| %s | %.2f | %.2f | %.3f | %.3f | %.6f | %.6f | %s |\n", c.name.c_str(), mn, md,
                mn / raw_min, md / raw_med, c.loss0, c.loss_last, c.gate ? "ok" : "FAIL");
    all_ok = all_ok && c.gate;
  }
  return all_ok ? 0 : 1;
}
