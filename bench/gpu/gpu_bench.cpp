// Workload W and a transformer workload on one GPU through
// accel::Accelerator<backend::Nccl, precision::Bf16> (world size 1), the C++
// half of the comparison with Hugging Face Accelerate (accelerate_bench.py,
// the same model, data and settings). Run by tests/gpu/run.sh; prints one JSON
// line per workload: median and minimum ms/step and peak GPU memory.
// Usage: gpu_bench w|transformer [timed_steps]   (rank variables: world size 1; one
// workload per process, so that each Accelerator has its own rendezvous)
#include <accel/accel.hpp>

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "../../tests/support/workload.hpp"

namespace {

struct Result {
  std::vector<double> ms;
  double loss = 0;
};

double peak_mb() {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);
}

void print(const char* workload, const Result& r, const char* detail) {
  auto ms = r.ms;
  std::sort(ms.begin(), ms.end());
  std::printf(
      "{\"impl\": \"accel\", \"workload\": \"%s\", \"median_ms\": %.3f, \"min_ms\": %.3f, "
      "\"peak_mb\": %.1f, \"final_loss\": %.6f, \"steps\": %zu, \"detail\": \"%s\"}\n",
      workload, ms[ms.size() / 2], ms.front(), peak_mb(), r.loss, ms.size(), detail);
  std::fflush(stdout);
}

template <class Step>
Result time_steps(int warmup, int timed, Step&& step) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  Result r;
  for (int i = 0; i < warmup + timed; ++i) {
    torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    r.loss = step(i);
    torch::cuda::synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) r.ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return r;
}

/// Workload W (shared/WORKLOAD.md) at batch 64, SGD with momentum.
void bench_w(int timed) {
  accel::Accelerator<accel::backend::Nccl, accel::precision::Bf16> acc;
  auto data = workload::make_data();
  auto seq = workload::make_model();
  torch::optim::SGD sgd(seq->parameters(), workload::sgd_options());
  auto [m, o] = acc.prepare(seq, sgd);
  auto x = data.x.to(acc.device()), y = data.y.to(acc.device());
  auto r = time_steps(3, timed, [&](int i) {
    const int64_t b = i % 100;
    o.zero_grad();
    auto loss = torch::cross_entropy_loss(m(x.narrow(0, 64 * b, 64)), y.narrow(0, 64 * b, 64));
    acc.backward(loss);
    o.step();
    return loss.item<double>();
  });
  print("W", r, "MLP 784-2048-2048-2048-10, batch 64, SGD");
}

/// 12 encoder layers, width 1024, 16 heads, feed-forward 4096, batch 32,
/// sequence 512 (S, N, E layout), AdamW, MSE to a fixed random target.
void bench_transformer(int timed) {
  accel::Accelerator<accel::backend::Nccl, accel::precision::Bf16> acc;
  torch::manual_seed(0);
  auto layer = torch::nn::TransformerEncoderLayer(
      torch::nn::TransformerEncoderLayerOptions(1024, 16).dim_feedforward(4096).dropout(0.0));
  torch::nn::TransformerEncoder model(torch::nn::TransformerEncoderOptions(layer, 12));
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-4));
  auto [m, o] = acc.prepare(model, adamw);
  torch::manual_seed(1);
  auto x = torch::randn({512, 32, 1024}).to(acc.device());
  auto target = torch::randn({512, 32, 1024}).to(acc.device());
  auto r = time_steps(3, timed, [&](int) {
    o.zero_grad();
    auto loss = torch::mse_loss(m(x), target);
    acc.backward(loss);
    o.step();
    return loss.item<double>();
  });
  print("transformer", r, "12 x TransformerEncoderLayer(1024, 16, ff 4096), batch 32, seq 512, AdamW");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "";
  const int timed = argc > 2 ? std::stoi(argv[2]) : 20;
  if (which == "w") {
    bench_w(timed * 5);
  } else if (which == "transformer") {
    bench_transformer(timed);
  } else {
    std::fprintf(stderr, "usage: gpu_bench w|transformer [timed_steps]\n");
    return 2;
  }
}
