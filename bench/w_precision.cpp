// Workload W (shared/WORKLOAD.md) on one process in precision::Bf16 vs
// precision::Fp32: step time (ratio) and the loss curves of 200 steps side by
// side (bf16 must track fp32). A third contender, a plain LibTorch loop under
// LibTorch's own CPU autocast to bfloat16, tells what the bf16 kernels cost
// apart from accel.
//
//   build-bench/bench/w_precision [rounds=3] [curve.csv]
//
// Each round trains a fresh W (manual_seed(1)) for 200 steps with each
// contender (alternated, so all see the same machine load); batches are narrow() slices
// of X and Y, step i uses batch i % 100 (two epochs). Time: 10-step windows
// after 3 warm-up steps; min and median over all windows of all rounds. The
// losses of round 1 go to curve.csv (step, fp32, bf16). Printed: the timing
// table, the curves every 20 steps and averaged over 20-step windows, and a
// gate: every 20-step mean of bf16 within 2% of fp32's (exit status 1 if not).
#include <accel/accel.hpp>

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "../tests/support/workload.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kSteps = 200, kWarmup = 3, kWindow = 10, kCurveWindow = 20;
constexpr int64_t kBatch = 64;
constexpr double kGateRel = 0.02;

struct Run {
  std::vector<double> losses;     // every step
  std::vector<double> window_ms;  // ms/step of each 10-step window after warm-up
};

/// Runs step(i) (returns the loss of step i) kSteps times, timing windows.
Run timed(const std::function<torch::Tensor(int)>& step) {
  Run r;
  auto t0 = Clock::now();
  for (int i = 0; i < kSteps; ++i) {
    if (i >= kWarmup && (i - kWarmup) % kWindow == 0) t0 = Clock::now();
    r.losses.push_back(step(i).item<double>());
    if (i >= kWarmup && (i - kWarmup) % kWindow == kWindow - 1)
      r.window_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / kWindow);
  }
  return r;
}

template <class Precision>
Run train(const workload::Data& d) {
  accel::Accelerator<accel::backend::SingleDevice, Precision> acc;
  auto model = workload::make_model();
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  auto [m, opt] = acc.prepare(model, sgd);
  return timed([&](int i) {
    const int64_t b = i % 100;
    opt.zero_grad();
    torch::Tensor loss = torch::cross_entropy_loss(m(d.x.narrow(0, kBatch * b, kBatch)),
                                                   d.y.narrow(0, kBatch * b, kBatch));
    acc.backward(loss);
    opt.step();
    return loss;
  });
}

/// LibTorch's own CPU autocast switch, in each version's spelling (2.4
/// deprecated the CPU-specific calls).
void raw_cpu_autocast(bool on) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(at::kCPU, on);
  if (on) at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
#else
  at::autocast::set_cpu_enabled(on);
  if (on) at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
}

/// The same loop without accel: LibTorch's autocast set by hand around forward.
Run train_raw_autocast(const workload::Data& d) {
  auto model = workload::make_model();
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  return timed([&](int i) {
    const int64_t b = i % 100;
    sgd.zero_grad();
    raw_cpu_autocast(true);
    auto logits = model->forward(d.x.narrow(0, kBatch * b, kBatch)).to(torch::kFloat);
    at::autocast::clear_cache();
    raw_cpu_autocast(false);
    auto loss = torch::cross_entropy_loss(logits, d.y.narrow(0, kBatch * b, kBatch));
    loss.backward();
    sgd.step();
    return loss;
  });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v, int from, int to) {
  double s = 0;
  for (int i = from; i < to; ++i) s += v[i];
  return s / (to - from);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  const std::string csv = argc > 2 ? argv[2] : "w_precision_curve.csv";
  at::set_num_threads(1);
  const auto d = workload::make_data();
  std::vector<double> fp32_ms, bf16_ms, raw_ms;
  Run fp32_first, bf16_first;
  for (int round = 0; round < rounds; ++round) {
    auto a = train<accel::precision::Fp32>(d);
    auto b = train<accel::precision::Bf16>(d);
    auto c = train_raw_autocast(d);
    fp32_ms.insert(fp32_ms.end(), a.window_ms.begin(), a.window_ms.end());
    raw_ms.insert(raw_ms.end(), c.window_ms.begin(), c.window_ms.end());
    bf16_ms.insert(bf16_ms.end(), b.window_ms.begin(), b.window_ms.end());
    if (round == 0) {
      fp32_first = std::move(a);
      bf16_first = std::move(b);
    }
  }
  std::printf("W, 1 process, 1 thread, %d steps x %d rounds; ms/step over 10-step windows\n", kSteps, rounds);
  std::printf("| precision | min | median | min / fp32 | median / fp32 |\n|---|---|---|---|---|\n");
  const double f_min = *std::min_element(fp32_ms.begin(), fp32_ms.end()), f_med = median(fp32_ms);
  const double b_min = *std::min_element(bf16_ms.begin(), bf16_ms.end()), b_med = median(bf16_ms);
  std::printf("| Fp32 | %.2f | %.2f | 1.00x | 1.00x |\n", f_min, f_med);
  std::printf("| Bf16 | %.2f | %.2f | %.2fx | %.2fx |\n", b_min, b_med, b_min / f_min, b_med / f_med);
  const double r_min = *std::min_element(raw_ms.begin(), raw_ms.end()), r_med = median(raw_ms);
  std::printf("| raw LibTorch, CPU autocast bf16 (no accel) | %.2f | %.2f | %.2fx | %.2fx |\n\n", r_min,
              r_med, r_min / f_min, r_med / f_med);

  std::ofstream out(csv);
  out << "step,fp32,bf16\n";
  for (int i = 0; i < kSteps; ++i) out << i << ',' << fp32_first.losses[i] << ',' << bf16_first.losses[i] << '\n';

  std::printf("| steps | fp32 mean loss | bf16 mean loss | bf16 - fp32 | relative |\n|---|---|---|---|---|\n");
  bool ok = true;
  for (int w = 0; w < kSteps; w += kCurveWindow) {
    const double f = mean(fp32_first.losses, w, w + kCurveWindow);
    const double b = mean(bf16_first.losses, w, w + kCurveWindow);
    const double rel = std::abs(b - f) / f;
    ok = ok && rel <= kGateRel;
    std::printf("| %d-%d | %.6f | %.6f | %+.6f | %.4f |\n", w, w + kCurveWindow - 1, f, b, b - f, rel);
  }
  double max_step = 0;
  for (int i = 0; i < kSteps; ++i)
    max_step = std::max(max_step, std::abs(bf16_first.losses[i] - fp32_first.losses[i]));
  std::printf("\nstep 0: fp32 %.6f bf16 %.6f; step %d: fp32 %.6f bf16 %.6f; max per-step |diff| %.6f\n",
              fp32_first.losses[0], bf16_first.losses[0], kSteps - 1, fp32_first.losses[kSteps - 1],
              bf16_first.losses[kSteps - 1], max_step);
  std::printf("gate (every %d-step mean of bf16 within %.0f%% of fp32): %s; curves in %s\n", kCurveWindow,
              kGateRel * 100, ok ? "ok" : "FAIL", csv.c_str());
  return ok ? 0 : 1;
}
