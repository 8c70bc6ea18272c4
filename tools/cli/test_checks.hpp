// SPDX-License-Identifier: Apache-2.0
/// @file The checks `accel test` runs inside its worker processes: rendezvous,
/// all_reduce, gradient sync against one process, and an exact resume from
/// save_state. Rank 0 prints one line per check that passed on every process;
/// a process that finds a check failing throws what it found.
#ifndef ACCEL_TOOLS_CLI_TEST_CHECKS_HPP
#define ACCEL_TOOLS_CLI_TEST_CHECKS_HPP

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/dispatch.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::cli::selftest {

// The checks in the order they run; a process's stage file names the one it is in.
inline constexpr std::string_view kRendezvous = "rendezvous";
inline constexpr std::string_view kAllReduce = "all_reduce";
inline constexpr std::string_view kGradientSync = "gradient sync";
inline constexpr std::string_view kCheckpoint = "save_state/load_state";

/// What every worker needs; copied into the forked processes.
struct Plan {
  std::string backend = "gloo";  ///< gloo | mpi | nccl
  std::string precision = "no";  ///< no | fp16 | bf16
  int num_processes = 2;
  std::chrono::seconds timeout{120};
  std::filesystem::path scratch;  ///< stage files, the checkpoint, the uninterrupted run
};

/// The backends `accel test` can check: the multi-process ones of this build.
using TestBackends = std::tuple<backend::Gloo
#if ACCEL_WITH_MPI
                                , backend::Mpi
#endif
#if ACCEL_WITH_NCCL
                                , backend::Nccl
#endif
                                >;

inline std::filesystem::path stage_file(const Plan& p, int rank) {
  return p.scratch / ("stage_" + std::to_string(rank));
}

/// ACCEL_TEST_INJECT=stall:<check> or wrong:<check> makes the last process hang
/// in, or give a wrong result to, that check: how tests/cli/test_command.sh
/// shows that a failure or a hang is reported, and bounded.
inline bool injected(std::string_view kind, std::string_view check, int rank, const Plan& p) {
  const char* v = std::getenv("ACCEL_TEST_INJECT");
  return v != nullptr && rank == p.num_processes - 1 &&
         std::string_view(v) == std::string(kind) + ":" + std::string(check);
}

/// Records the check this process is in, so that the command can name what a
/// failed or hung process was doing.
inline void enter(const Plan& p, int rank, std::string_view check) {
  std::ofstream(stage_file(p, rank), std::ios::trunc) << check;
  if (injected("stall", check, rank, p))
    for (;;) ::pause();  // until the launcher stops it
}

constexpr int kSteps = 3;              // steps compared with one process
constexpr int64_t kRowsPerProcess = 4;
constexpr int64_t kIn = 8, kHidden = 16, kOut = 4;
constexpr uint64_t kModelSeed = 1, kDataSeed = 2;

inline torch::nn::Sequential make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                               torch::nn::Linear(kHidden, kOut));
}
// Momentum, so that a resume must restore the optimizer state too.
inline torch::optim::SGDOptions sgd_options() {
  return torch::optim::SGDOptions(0.1).momentum(0.9);
}

/// kSteps + 1 global batches, the same on every process. Step s's global batch
/// is rows [s*W*B, (s+1)*W*B); process r takes the r-th B rows of it.
struct Data {
  torch::Tensor x, y;
  int world = 1;
  Data(int w, torch::Device d) : world(w) {
    torch::manual_seed(kDataSeed);
    const int64_t rows = (kSteps + 1) * w * kRowsPerProcess;
    x = torch::randn({rows, kIn}).to(d);
    y = torch::randn({rows, kOut}).to(d);
  }
  static torch::Tensor global(const torch::Tensor& t, int step, int w) {
    return t.narrow(0, step * w * kRowsPerProcess, w * kRowsPerProcess);
  }
  torch::Tensor local(const torch::Tensor& t, int step, int rank) const {
    return t.narrow(0, (static_cast<int64_t>(step) * world + rank) * kRowsPerProcess,
                    kRowsPerProcess);
  }
};

inline std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> v;
  for (const auto& p : m.parameters()) v.push_back(p.detach().to(torch::kCPU).clone());
  return v;
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a,
                           const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d = std::max(d, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  return d;
}

/// 16-bit autocast rounds differently on a half batch than on the whole one.
inline double tolerance(std::string_view precision) {
  // Measured: ~5e-4 for bf16 on 2-5 processes; training without gradient sync is off by ~0.1.
  return precision == "bf16" ? 1e-2 : precision == "fp16" ? 2e-3 : 1e-5;
}

inline std::string precision_label(std::string_view p) {
  return p == "no" ? "fp32" : std::string(p);
}

/// Every process learns whether the check passed everywhere. One that failed
/// throws its finding; the others leave with a message the launcher knows
/// means "another process failed" (so the report names the real cause).
template <class Acc>
void agree(Acc& acc, bool ok, const std::string& finding) {
  const auto failed = acc.gather(torch::tensor({ok ? 0.0f : 1.0f}, acc.device())).cpu();
  if (!ok) throw Error(finding);
  std::string ranks;
  for (int64_t r = 0; r < failed.numel(); ++r)
    if (failed[r].template item<float>() != 0)
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (!ranks.empty())
    throw Error("process(es) " + ranks + " failed this check " +
                std::string(accel::detail::kFailedElsewhere));
}

template <class Acc>
void say(Acc& acc, const std::string& line) {
  if (acc.is_main_process()) std::cout << line << std::endl;
}

/// One optimizer step on this process's rows of global batch `step`.
template <class Acc, class M, class O>
void train_step(Acc& acc, M& model, O& opt, const Data& d, int step) {
  const int r = acc.process_index();
  acc.backward(torch::mse_loss(model(d.local(d.x, step, r)), d.local(d.y, step, r)));
  opt.step();
  opt.zero_grad();
}

/// The same kSteps in one process on whole global batches, under the same autocast.
template <class Acc>
std::vector<torch::Tensor> one_process_reference(Acc& acc, const Data& d) {
  auto model = make_model(kModelSeed);
  model->to(acc.device());
  torch::optim::SGD sgd(model->parameters(), sgd_options());
  for (int s = 0; s < kSteps; ++s) {
    torch::Tensor out;
    {
      auto autocast = acc.autocast();
      out = model->forward(Data::global(d.x, s, d.world)).to(torch::kFloat);
    }
    torch::mse_loss(out, Data::global(d.y, s, d.world)).backward();
    sgd.step();
    sgd.zero_grad();
  }
  return snapshot(*model);
}

template <class Acc>
void check_rendezvous(Acc& acc, const Plan& p) {
  const int n = acc.num_processes(), r = acc.process_index();
  const auto ranks = acc.gather(torch::tensor({static_cast<float>(r)}, acc.device())).cpu();
  const bool ok = n == p.num_processes &&
                  ranks.equal(torch::arange(p.num_processes, torch::kFloat));
  std::ostringstream why;
  why << "it sees " << n << " processes with ranks " << ranks.flatten() << ", expected "
      << p.num_processes << " with ranks 0.." << p.num_processes - 1;
  agree(acc, ok, why.str());
  const auto env = runtime::ProcessEnv::discover();
  say(acc, "rendezvous: " + std::to_string(n) + " processes joined (" + p.backend + ", " +
               env.master_addr + ":" + std::to_string(env.master_port) + ")");
}

template <class Acc>
void check_all_reduce(Acc& acc, const Plan& p) {
  const int r = acc.process_index(), n = p.num_processes;
  const int expected = n * (n + 1) / 2;
  const float value = static_cast<float>(r + 1 + (injected("wrong", kAllReduce, r, p) ? 1 : 0));
  const float got =
      acc.reduce(torch::tensor({value}, acc.device())).cpu()[0].template item<float>();
  std::ostringstream why;
  why << "the sum of the values 1.." << n << " arrived as " << got << ", expected " << expected;
  agree(acc, got == static_cast<float>(expected), why.str());
  std::string values;
  for (int i = 1; i <= n; ++i) values += (i > 1 ? ", " : "") + std::to_string(i);
  say(acc, "all_reduce: sum of ranks' values [" + values + "] = " + std::to_string(expected) +
               " on every rank (expected " + std::to_string(expected) + ")");
}

/// Calls fn(accelerator) with the Accelerator<B, P, Replicate> the plan names
/// (its construction is the rendezvous).
template <class F>
void with_accelerator(const Plan& p, F&& fn) {
  AcceleratorOptions options;
  options.timeout = p.timeout;
  dispatch_accelerator<TestBackends, all_precisions, std::tuple<shard::Replicate>>(
      PolicyChoice{p.backend, p.precision, "replicate"}, std::forward<F>(fn), options);
}

inline std::string uninterrupted_file(const Plan& p, int rank) {
  return (p.scratch / ("uninterrupted_" + std::to_string(rank) + ".pt")).string();
}

inline void perturb_first_parameter(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  m.parameters()[0].add_(1e-2);
}

/// First launch: rendezvous, all_reduce, kSteps of training compared with one
/// process, then save_state and one more step (the uninterrupted run).
inline void first_run(const Plan& p) {
  const int rank = runtime::ProcessEnv::discover().rank;
  enter(p, rank, kRendezvous);
  with_accelerator(p, [&](auto& acc) {
    check_rendezvous(acc, p);
    enter(p, rank, kAllReduce);
    check_all_reduce(acc, p);

    enter(p, rank, kGradientSync);
    const Data d(p.num_processes, acc.device());
    auto model = make_model(kModelSeed);
    torch::optim::SGD sgd(model->parameters(), sgd_options());
    auto [m, opt] = acc.prepare(model, sgd);
    for (int s = 0; s < kSteps; ++s) train_step(acc, m, opt, d, s);
    if (injected("wrong", kGradientSync, rank, p)) perturb_first_parameter(*model);
    const double diff = max_abs_diff(snapshot(*model), one_process_reference(acc, d));
    const double tol = tolerance(p.precision);
    std::ostringstream why;
    why << "its parameters after " << kSteps << " steps differ from one process's training on "
        << "the whole batch by " << diff << " (tolerance " << tol << ")";
    agree(acc, diff <= tol, why.str());
    const auto diffs = acc.gather(torch::tensor({static_cast<float>(diff)}, acc.device()));
    std::ostringstream line;
    line << std::setprecision(2) << "gradient sync: parameters after " << kSteps
         << " steps equal one process's training on the whole batch (max diff "
         << diffs.max().template item<float>() << " <= " << tol << ")";
    say(acc, line.str());

    enter(p, rank, kCheckpoint);
    acc.save_state(p.scratch / "checkpoint");
    train_step(acc, m, opt, d, kSteps);
    torch::save(snapshot(*model), uninterrupted_file(p, rank));
    acc.wait_for_everyone();
  });
}

/// Second launch, fresh processes: a model initialised differently, then
/// load_state and the step after the checkpoint, which must equal the first
/// run's bit for bit (parameters and optimizer momentum both restored).
inline void resumed_run(const Plan& p) {
  const int rank = runtime::ProcessEnv::discover().rank;
  enter(p, rank, kCheckpoint);
  with_accelerator(p, [&](auto& acc) {
    const Data d(p.num_processes, acc.device());
    auto model = make_model(kModelSeed + 1);
    torch::optim::SGD sgd(model->parameters(), sgd_options());
    auto [m, opt] = acc.prepare(model, sgd);
    acc.load_state(p.scratch / "checkpoint");
    if (injected("wrong", kCheckpoint, rank, p)) perturb_first_parameter(*model);
    train_step(acc, m, opt, d, kSteps);
    std::vector<torch::Tensor> uninterrupted;
    torch::load(uninterrupted, uninterrupted_file(p, rank));
    const auto resumed = snapshot(*model);
    bool same = resumed.size() == uninterrupted.size();
    for (std::size_t i = 0; same && i < resumed.size(); ++i)
      same = resumed[i].equal(uninterrupted[i]);
    std::ostringstream why;
    why << "the step after load_state differs from the uninterrupted run's by up to "
        << max_abs_diff(resumed, uninterrupted) << " (expected bit-exact)";
    agree(acc, same, why.str());
    say(acc, "save_state/load_state: a resumed run's next step equals the uninterrupted one "
             "(bit-exact)");
  });
}

}  // namespace accel::cli::selftest

#endif  // ACCEL_TOOLS_CLI_TEST_CHECKS_HPP
