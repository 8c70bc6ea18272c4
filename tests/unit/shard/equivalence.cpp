// The key property of data parallelism: N processes on a global batch end
// with the same parameters as one process on that batch (WORKLOAD.md, W).
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "catch.hpp"

#include "paths.hpp"
#include "workload.hpp"

namespace {

std::filesystem::path scratch(const std::string& name) { return accel_test::scratch("parallel", name); }

/// W through accel: `micro_steps` loader batches of `per_rank_batch` rows per
/// rank; rank r writes its final parameters to out_r.pt. overlap: -1 lets
/// accel decide, 0/1 sets overlap_gradient_sync (and checks it happened).
template <class Backend>
void train_w(std::string out, int micro_steps, int64_t per_rank_batch, int accumulation,
             int overlap = -1) {
  accel::AcceleratorOptions opts{.gradient_accumulation_steps = accumulation};
  if (overlap >= 0) opts.overlap_gradient_sync = overlap == 1;
  accel::Accelerator<Backend> acc(opts);
  auto model = workload::make_model();
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  auto loader = accel::data::make_data_loader(
      workload::Dataset(workload::make_data()),
      accel::data::LoaderOptions{.batch_size = per_rank_batch, .shuffle = false});
  auto [m, opt, dl] = acc.prepare(model, sgd, loader);
  int step = 0;
  for (auto& batch : dl) {
    if (step++ == micro_steps) break;
    auto guard = acc.accumulate(m);
    auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
  }
  if (overlap >= 0) {
    // W has 2 buckets of 25 MiB: both start from backward hooks when overlapping.
    auto& reducer = dynamic_cast<accel::shard::detail::BucketReducer&>(m.gradient_sync());
    if (reducer.overlaps() != (overlap == 1) ||
        (reducer.launched_during_backward() > 0) != (overlap == 1))
      throw std::runtime_error("overlap " + std::to_string(overlap) + ": " +
                               std::to_string(reducer.launched_during_backward()) +
                               " all-reduces started during backward");
  }
  std::vector<torch::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  torch::save(params, out + "_" + std::to_string(acc.process_index()) + ".pt");
}

std::vector<torch::Tensor> load(const std::string& file) {
  std::vector<torch::Tensor> v;
  torch::load(v, file);
  return v;
}

void check_equivalent(const std::string& out, int world, int steps) {
  auto reference = workload::reference_parameters(steps);
  for (int r = 0; r < world; ++r) {
    auto got = load(out + "_" + std::to_string(r) + ".pt");
    double diff = workload::max_abs_diff(got, reference);
    INFO("rank " << r << " max |accel - single process| = " << diff);
    CHECK(diff <= 1e-5);
  }
}

}  // namespace

TEST_CASE("W on 2 Gloo processes equals one process at batch 64", "[parallel][gloo]") {
  auto out = scratch("gloo").string();
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(300);
  // 20 steps of global batch 64: each rank takes 32 rows (whole batches in turn).
  // Buckets all-reduced from backward hooks, and all after backward.
  // Both launches before the reference: it runs backward() in this process.
  for (int overlap : {1, 0})
    accel::notebook_launcher(train_w<accel::backend::Gloo>,
                             std::make_tuple(out + "_overlap" + std::to_string(overlap), 20,
                                             int64_t{32}, 1, overlap),
                             lo);
  for (int overlap : {1, 0}) {
    INFO("overlap_gradient_sync = " << overlap);
    check_equivalent(out + "_overlap" + std::to_string(overlap), 2, 20);
  }
}

TEST_CASE("W on 2 Gloo processes with gradient accumulation", "[parallel][gloo][accumulate]") {
  auto out = scratch("gloo_accum").string();
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(300);
  // 20 micro-steps of 16 rows per rank, 2 per optimizer step: 10 steps of 64 rows.
  accel::notebook_launcher(train_w<accel::backend::Gloo>, std::make_tuple(out, 20, int64_t{16}, 2, -1), lo);
  check_equivalent(out, 2, 10);
}

#if ACCEL_WITH_MPI
// Run by ctest under `mpirun -np 2` (tests/cmake_tests/parallel.cmake).
TEST_CASE("W under mpirun equals one process at batch 64", "[.mpi][parallel]") {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  REQUIRE(rank != nullptr);
  // Both ranks must agree on the path: no pid in it.
  auto out = accel_test::tmp_root() / "parallel" / "mpi";
  std::filesystem::create_directories(out.parent_path());
  for (int accumulation : {1, 2}) {
    int64_t per_rank = accumulation == 1 ? 32 : 16;
    auto name = out.string() + "_acc" + std::to_string(accumulation);
    train_w<accel::backend::Mpi>(name, 20, per_rank, accumulation);
    accel::Accelerator<accel::backend::Mpi> acc;
    acc.wait_for_everyone();
    if (acc.is_main_process()) check_equivalent(name, 2, 20 / accumulation);
    acc.wait_for_everyone();
  }
}
#endif

// Two "machines" on loopback: two launchers (node_rank 0 and 1) with two
// workers each rendezvous through one TCPStore into a world of 4.
TEST_CASE("W on two nodes of two processes equals one process", "[parallel][gloo][multinode]") {
  auto out = scratch("two_nodes").string();
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.num_nodes = 2;
  lo.master_port = accel::detail::launch::pick_free_port("127.0.0.1");
  lo.timeout = std::chrono::seconds(300);
  // Global batch 64 over 4 ranks: 16 rows each.
  auto args = std::make_tuple(out, 20, int64_t{16}, 1, -1);
  pid_t node1 = ::fork();
  if (node1 == 0) {
    int rc = 0;
    try {
      auto o = lo;
      o.node_rank = 1;
      accel::notebook_launcher(train_w<accel::backend::Gloo>, args, o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "node 1: %s\n", e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  REQUIRE(node1 > 0);
  REQUIRE_NOTHROW(accel::notebook_launcher(train_w<accel::backend::Gloo>, args, lo));
  int status = 0;
  REQUIRE(::waitpid(node1, &status, 0) == node1);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  check_equivalent(out, 4, 20);
}
