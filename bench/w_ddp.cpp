// Workload W (shared/WORKLOAD.md) on 2 processes through accel's
// data-parallel Accelerator (shard::Replicate), Gloo or MPI backend.
//
//   build-bench/bench/w_ddp gloo [flat | cap=MB] [overlap | defer] [loader]   (forks 2 workers with accel::notebook_launcher)
//   mpirun --allow-run-as-root -np 2 build-bench/bench/w_ddp mpi [flat | cap=MB] [overlap | defer] [loader]
//   RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. build-bench/bench/w_ddp env [...]
//         (one process per machine, Gloo: bench/comm_hooks_net.sh)
//
// default: 25 MiB buckets; AcceleratorOptions::overlap_gradient_sync unset,
//         so accel decides (overlap when each process has a spare core: not on
//         this 2-core machine with 2 processes, where buckets are all-reduced
//         right after backward).
// overlap / defer: overlap_gradient_sync = true / false (each bucket's
//         all-reduce starts from autograd hooks during backward / after it).
// flat:   AcceleratorOptions::bucket_cap_mb = 1e6, i.e. ONE bucket holding all
//         40 MB of gradients, all-reduced after backward ends (no overlap).
// cap=X:  bucket_cap_mb = X (a sweep of the bucket size; default 25).
// hook=fp16|bf16|powersgd: AcceleratorOptions::comm_hook (PowerSGD: rank 1,
//         compressing from step 2, as PyTorch allows). With a hook only the
//         step-0 loss is gated (compression changes the later steps).
// loader: batches from accel's sharded data loader over TensorDataset (batch
//         32 per rank, no shuffle); default: narrow() slices of X and Y, as the
//         Python DDP contender (bench/w_ddp.py) does.
// Step i, rank r: rows [64b + 32r, 64b + 32r + 32), b = i % 100. One intra-op
// thread per process. Timing: 3 warm-up steps, then 3 windows of 10 steps,
// with a barrier before and after each window; a window's time is the slowest
// rank's. Rank 0 prints one line:
//   RESULT <name> <min ms/step> <median ms/step> <loss0> <loss32> <gate ok|FAIL> <buckets> <launched in backward> <w1> <w2> <w3>
// where the losses are the mean over ranks (the gate: 2.298264 and 2.311658).
#include <accel/accel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../tests/support/workload.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWarmup = 3, kWindows = 3, kWindowSteps = 10;
constexpr int kSteps = kWarmup + kWindows * kWindowSteps;  // 33
constexpr int64_t kGlobalBatch = 64;
constexpr double kLoss0 = 2.298264, kLossLast = 2.311658;

template <class Backend>
void run(std::string name, double cap_mb, bool use_loader, int overlap, accel::CommHook hook) {
  at::set_num_threads(1);
  accel::AcceleratorOptions opts;
  opts.bucket_cap_mb = cap_mb;
  opts.comm_hook = hook;
  opts.powersgd = accel::PowerSGDOptions{.matrix_approximation_rank = 1, .start_powerSGD_iter = 2};
  if (overlap >= 0) opts.overlap_gradient_sync = overlap == 1;
  accel::Accelerator<Backend> acc(opts);
  const int rank = acc.process_index();
  const int world = acc.num_processes();
  const int64_t per_rank = kGlobalBatch / world;

  const auto d = workload::make_data();
  auto model = workload::make_model();
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  auto loader = accel::data::make_data_loader(
      accel::data::TensorDataset(d.x, d.y),
      accel::data::LoaderOptions{.batch_size = per_rank, .shuffle = false});
  auto [m, opt, dl] = acc.prepare(model, sgd, loader);
  // Rank r gets loader batches r, r + world, ...: W's rows (only started when used).
  std::optional<decltype(dl.begin())> it;
  if (use_loader) it = dl.begin();

  double loss0 = 0, loss_last = 0;
  auto step = [&](int i) {
    torch::Tensor x, y;
    if (use_loader) {
      auto& batch = **it;
      x = batch.data;
      y = batch.target;
      ++*it;
    } else {
      const int64_t row = kGlobalBatch * (i % 100) + per_rank * rank;
      x = d.x.narrow(0, row, per_rank);
      y = d.y.narrow(0, row, per_rank);
    }
    opt.zero_grad();
    torch::Tensor loss = torch::cross_entropy_loss(m(x), y);
    acc.backward(loss);
    opt.step();
    if (i == 0) loss0 = loss.item<double>();
    if (i == kSteps - 1) loss_last = loss.item<double>();
  };

  int i = 0;
  for (; i < kWarmup; ++i) step(i);
  std::vector<double> windows;
  for (int w = 0; w < kWindows; ++w) {
    acc.wait_for_everyone();
    auto t0 = Clock::now();
    for (int s = 0; s < kWindowSteps; ++s, ++i) step(i);
    acc.wait_for_everyone();
    auto t = torch::tensor(
        {std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / kWindowSteps});
    acc.communicator().all_reduce(t, accel::runtime::ReduceOp::Max)->wait();
    windows.push_back(t.item<double>());
  }
  auto losses = torch::tensor({loss0, loss_last});
  losses = acc.reduce(losses, accel::Reduction::Mean);

  std::size_t buckets = 1, launched = 0;
  if (auto* br = dynamic_cast<accel::shard::detail::BucketReducer*>(&m.gradient_sync())) {
    buckets = br->num_buckets();
    launched = br->launched_during_backward();
  }
  if (rank == 0) {
    auto sorted = windows;
    std::sort(sorted.begin(), sorted.end());
    const double l0 = losses[0].item<double>(), l1 = losses[1].item<double>();
    const bool ok = std::abs(l0 - kLoss0) < 5e-6 &&
                    (hook != accel::CommHook::None || std::abs(l1 - kLossLast) < 5e-6);
    std::printf("RESULT %s %.2f %.2f %.6f %.6f %s %zu %zu %.2f %.2f %.2f\n", name.c_str(),
                sorted.front(), sorted[sorted.size() / 2], l0, l1, ok ? "ok" : "FAIL", buckets,
                launched, windows[0], windows[1], windows[2]);
    std::fflush(stdout);
    if (!ok) throw std::runtime_error("accel: " + name + " did not reproduce W's losses");
  }
  acc.wait_for_everyone();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::strcmp(argv[1], "gloo") != 0 && std::strcmp(argv[1], "mpi") != 0 &&
                    std::strcmp(argv[1], "env") != 0)) {
    std::fprintf(stderr, "usage: w_ddp gloo|mpi|env [flat | cap=MB] [overlap | defer] [hook=fp16|bf16|powersgd] [loader]\n");
    return 2;
  }
  const std::string backend = argv[1];
  bool use_loader = false;
  double cap_mb = 25.0;
  int overlap = -1;  // unset: accel decides
  auto hook = accel::CommHook::None;
  std::string tag;
  for (int a = 2; a < argc; ++a) {
    if (std::strcmp(argv[a], "flat") == 0) {
      cap_mb = 1e6;
      tag += "_flat";
    } else if (std::strncmp(argv[a], "cap=", 4) == 0) {
      cap_mb = std::atof(argv[a] + 4);
      tag += std::string("_cap") + (argv[a] + 4);
    } else if (std::strcmp(argv[a], "overlap") == 0 || std::strcmp(argv[a], "defer") == 0) {
      overlap = argv[a][0] == 'o' ? 1 : 0;
      tag += std::string("_") + argv[a];
    } else if (std::strncmp(argv[a], "hook=", 5) == 0) {
      const std::string h = argv[a] + 5;
      if (h == "fp16") hook = accel::CommHook::Fp16;
      else if (h == "bf16") hook = accel::CommHook::Bf16;
      else if (h == "powersgd") hook = accel::CommHook::PowerSGD;
      else {
        std::fprintf(stderr, "w_ddp: unknown hook %s (fp16, bf16 or powersgd)\n", h.c_str());
        return 2;
      }
      tag += "_" + h;
    } else if (std::strcmp(argv[a], "loader") == 0) {
      use_loader = true;
      tag += "_loader";
    } else {
      std::fprintf(stderr, "w_ddp: unknown argument %s\n", argv[a]);
      return 2;
    }
  }
  const std::string name = "accel_" + backend + tag;
  try {
    if (backend == "gloo") {
      accel::LaunchOptions lo;
      lo.num_processes = 2;
      lo.master_port = 0;  // a free port
      lo.timeout = std::chrono::seconds(300);
      accel::notebook_launcher(run<accel::backend::Gloo>, std::make_tuple(name, cap_mb, use_loader, overlap, hook), lo);
    } else if (backend == "env") {
      run<accel::backend::Gloo>(name, cap_mb, use_loader, overlap, hook);
    } else {
#if ACCEL_WITH_MPI
      run<accel::backend::Mpi>(name, cap_mb, use_loader, overlap, hook);
#else
      std::fprintf(stderr, "w_ddp: this build has no MPI\n");
      return 2;
#endif
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "w_ddp %s failed: %s\n", name.c_str(), e.what());
    return 1;
  }
  return 0;
}
