// All-reduce bus bandwidth through accel's Communicator vs the raw engines it
// wraps: MPI_Allreduce (vs accel MPI) and c10d::ProcessGroupGloo (vs accel
// Gloo), float32 sums of 1, 16 and 64 MiB. Buffers are allocated once and
// reused; raw and accel iterations alternate so both see the same machine
// load; each iteration starts after an MPI_Barrier; the median is reported.
//
//   mpirun --allow-run-as-root -np 2 -x MASTER_PORT=29531 build/bench/allreduce_bandwidth [iters]
//
// accel MPI is measured in both progress modes (thread: blocking collectives
// on accel's progress thread; test*, the default: MPI_Iallreduce polled by
// MPI_Test).
// Bus bandwidth = 2 (n - 1) / n * bytes / time (the NCCL-tests convention).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <accel/runtime/gloo_communicator.hpp>
#include <accel/runtime/mpi_communicator.hpp>
#include <accel/runtime/store.hpp>

using namespace accel::runtime;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Times the variants round-robin (so they see the same machine load),
/// rotating which goes first (the first after MPI calls pays for the peers'
/// spinning MPI threads);
/// returns the median seconds of each.
std::vector<double> time_all(int iters, const std::vector<std::function<void()>>& variants) {
  std::vector<std::vector<double>> t(variants.size());
  for (int i = 0; i < iters + 2; ++i) {  // the first two of each are warm-up
    for (std::size_t j = 0; j < variants.size(); ++j) {
      const std::size_t v = (i + j) % variants.size();  // rotate who goes first
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = Clock::now();
      variants[v]();
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      // The slowest rank defines the collective's time.
      MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (i >= 2) t[v].push_back(s);
    }
  }
  std::vector<double> out;
  for (auto& x : t) out.push_back(median(x));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 15;
  at::set_num_threads(1);
  auto env = ProcessEnv::discover();
  // accel's MPI communicator initialises MPI (the raw calls below reuse it).
  auto mpi = make_mpi_communicator(
      env, MpiOptions{std::chrono::minutes(5), std::nullopt, MpiProgress::Thread});
  auto mpi_nbc = make_mpi_communicator(
      env, MpiOptions{std::chrono::minutes(5), std::nullopt, MpiProgress::Test});
  auto store = make_store(env, StoreOptions{std::chrono::minutes(5), std::nullopt});
  auto gloo = make_gloo_communicator(env, store, GlooOptions{std::chrono::minutes(5), std::nullopt});
  // Raw Gloo: its own process group, same device kind and thread count.
  auto raw_opts = c10d::ProcessGroupGloo::Options::create(std::chrono::minutes(5));
  raw_opts->devices.push_back(accel::runtime::detail::make_gloo_device(env));
  raw_opts->threads = 2;
  auto raw_pg = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("raw", store), env.rank, env.world_size, raw_opts);
  MPI_Comm raw_comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw_comm);

  const int n = env.world_size;
  if (env.rank == 0)
    std::printf("all-reduce bus bandwidth, %d ranks, float32 sum, median of %d (GB/s)\n"
                "%8s | %8s %8s %6s %8s %6s | %8s %8s %6s\n",
                n, iters, "size", "raw MPI", "thread", "ratio", "test*", "ratio", "raw Gloo",
                "accel", "ratio");
  for (int mib : {1, 16, 64}) {
    const int64_t numel = int64_t{mib} * 1024 * 1024 / 4;
    auto raw_buf = torch::zeros({numel});
    auto acc_buf = torch::zeros({numel});
    auto nbc_buf = torch::zeros({numel});
    std::vector<at::Tensor> raw_vec{raw_buf};
    const int it = mib >= 64 ? std::max(5, iters / 2) : iters;
    auto raw_mpi = [&] {
      MPI_Allreduce(MPI_IN_PLACE, raw_buf.data_ptr(), static_cast<int>(numel), MPI_FLOAT, MPI_SUM,
                    raw_comm);
    };
    // Each accel mode against raw in its own phase (modes do not share a phase).
    auto m = time_all(it, {raw_mpi, [&] { mpi->all_reduce(acc_buf)->wait(); }});
    auto m2 = time_all(it, {raw_mpi, [&] { mpi_nbc->all_reduce(nbc_buf)->wait(); }});
    m.push_back(m2[1]);
    m[0] = std::min(m[0], m2[0]);
    auto g = time_all(it, {[&] { raw_pg->allreduce(raw_vec)->wait(); },
                           [&] { gloo->all_reduce(acc_buf)->wait(); }});
    const double bus = 2.0 * (n - 1) / n * static_cast<double>(numel * 4) / 1e9;
    if (env.rank == 0)
      std::printf("%5d MiB | %8.2f %8.2f %5.2fx %8.2f %5.2fx | %8.2f %8.2f %5.2fx\n", mib,
                  bus / m[0], bus / m[1], m[0] / m[1], bus / m[2], m[0] / m[2], bus / g[0],
                  bus / g[1], g[0] / g[1]);
  }
  // Correctness gate: the buffers were zeros, so a sum of ones must give n.
  auto ones = torch::ones({1024});
  mpi->all_reduce(ones)->wait();
  mpi_nbc->all_reduce(ones)->wait();
  gloo->all_reduce(ones)->wait();
  const bool ok = torch::allclose(ones, torch::full({1024}, float(n * n * n)));
  if (env.rank == 0) std::printf("check: %s\n", ok ? "ok" : "WRONG RESULT");
  MPI_Comm_free(&raw_comm);
  gloo->barrier();
  return ok ? 0 : 1;
}
