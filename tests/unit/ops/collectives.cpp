// The Accelerator's collectives and data sharding on real processes (Gloo),
// 2 and 3 ranks, each forked by accel's own launcher.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/runtime/counting_communicator.hpp>

#include <memory>
#include <string>
#include <thread>

#include <unistd.h>

#include "catch.hpp"

#include "paths.hpp"
#include "workers.hpp"

namespace {

// A dataset whose items are their own index: gathered values name the items.
struct Indices : torch::data::datasets::Dataset<Indices> {
  int64_t n;
  explicit Indices(int64_t size) : n(size) {}
  torch::data::Example<> get(size_t i) override {
    auto t = torch::tensor({static_cast<int64_t>(i)});
    return {t, t};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n); }
};

using accel_test::expect;

void collectives_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  const int r = acc.process_index(), n = acc.num_processes();
  auto mine = torch::full({2}, static_cast<float>(r + 1));
  auto sum = acc.reduce(mine);
  expect(torch::equal(sum, torch::full({2}, n * (n + 1) / 2.0f)), "reduce sum");
  auto mean = acc.reduce(mine, accel::Reduction::Mean);
  expect(torch::allclose(mean, torch::full({2}, (n + 1) / 2.0f)), "reduce mean");
  auto g = acc.gather(torch::full({1, 3}, static_cast<float>(r)));
  expect(g.sizes() == torch::IntArrayRef{n, 3}, "gather shape");
  for (int k = 0; k < n; ++k) expect(g[k].eq(k).all().item<bool>(), "gather rank order");
  auto b = acc.broadcast(torch::full({3}, static_cast<float>(r)), n - 1);
  expect(b.eq(n - 1).all().item<bool>(), "broadcast from the last rank");
  // Rank r holds r+1 rows: padded to n rows with -1, at the end or the front.
  auto ragged = torch::full({r + 1, 2}, static_cast<float>(r));
  auto padded = acc.pad_across_processes(ragged, 0, -1);
  expect(padded.size(0) == n && padded[r].eq(r).all().item<bool>(), "pad at the end");
  if (r + 1 < n) expect(padded[n - 1].eq(-1).all().item<bool>(), "pad value");
  auto front = acc.pad_across_processes(ragged, 0, -1, true);
  expect(front[n - 1].eq(r).all().item<bool>(), "pad at the front");
  {
    // The others enter the block only after the main process left it
    // (steady_clock is the same clock in every process of this machine).
    const auto now = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
    double entered = 0, left = 0;
    {
      auto first = acc.main_process_first();
      entered = now();
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      left = now();
    }
    auto times = acc.gather(torch::tensor({entered, left}, torch::kDouble).reshape({1, 2}));
    for (int k = 1; k < n; ++k)
      expect(times[k][0].item<double>() >= times[0][1].item<double>(),
             "rank " + std::to_string(k) + " entered main_process_first's block before the main process left it");
  }
  acc.wait_for_everyone();
}

// gather_for_metrics over a whole epoch returns every item exactly once,
// even though even_batches wrapped the tail around on the last batch.
void metrics_body(int64_t dataset_size, int64_t batch, bool drop_last) {
  accel::Accelerator<accel::backend::Gloo> acc;
  auto loader = accel::data::make_data_loader(
      Indices(dataset_size), accel::data::LoaderOptions{.batch_size = batch, .drop_last = drop_last});
  auto [dl] = acc.prepare(loader);
  std::vector<int64_t> seen;
  for (auto& b : dl) {
    auto all = acc.gather_for_metrics(b.data.view(-1));
    for (int64_t k = 0; k < all.size(0); ++k) seen.push_back(all[k].item<int64_t>());
  }
  std::vector<int64_t> expected;
  const int64_t global = batch * acc.num_processes();
  const int64_t kept = drop_last ? dataset_size / global * global : dataset_size;
  for (int64_t i = 0; i < kept; ++i) expected.push_back(i);
  expect(seen == expected, "gather_for_metrics saw " + std::to_string(seen.size()) +
                               " items, expected " + std::to_string(expected.size()));
}

// A parameter that gets no gradient on some steps must not hang the step.
void unused_parameter_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  torch::manual_seed(0);
  auto used = torch::nn::Linear(4, 4);
  auto unused = torch::nn::Linear(4, 4);
  torch::nn::Sequential holder;
  holder->push_back(used);
  holder->push_back(unused);
  torch::optim::SGD sgd(holder->parameters(), torch::optim::SGDOptions(0.1));
  auto [m, opt] = acc.prepare(holder, sgd);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    // Only rank 0 uses the second layer on odd steps: ranks differ in which
    // parameters got gradients, and still agree on the collectives.
    auto x = torch::ones({2, 4}) * (acc.process_index() + 1);
    // The expected gradient of the unused layer: rank 0's, computed on copies,
    // averaged with nothing from the ranks that did not use it (issue 13, C18).
    torch::Tensor expected = torch::zeros({4, 4});
    if (step % 2 == 1) {
      auto w0 = used->weight.detach().clone(), b0 = used->bias.detach().clone();
      auto wu = unused->weight.detach().clone().requires_grad_(true), bu = unused->bias.detach().clone();
      auto x0 = torch::ones({2, 4});
      torch::nn::functional::linear(torch::nn::functional::linear(x0, w0, b0), wu, bu).sum().backward();
      expected = wu.grad() / acc.num_processes();
    }
    auto y = used(x);
    if (step % 2 == 1 && acc.is_main_process()) y = unused(y);
    acc.backward(y.sum());
    opt.step();  // waits for the reduction; the gradients stay until zero_grad()
    auto g = unused->weight.grad();
    const auto got = g.defined() ? g.detach().clone() : torch::zeros({4, 4});
    expect(torch::allclose(got, expected, 1e-6, 1e-6),
           "step " + std::to_string(step) + ": unused layer's gradient differs from the average (max diff " +
               std::to_string((got - expected).abs().max().item<double>()) + ")");
  }
  auto w = acc.gather(unused->weight.detach().reshape({1, -1}));
  expect(torch::allclose(w[0], w[w.size(0) - 1]), "replicas diverged");
}

/// The user loads weights into the model after prepare() with LibTorch's own
/// Module::load (Tensor::set_ on every parameter): gradients must still be
/// averaged (replicas stay equal) and land in the parameters the optimizer steps.
template <class Shard>
void load_after_prepare_body(std::string file) {
  accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32, Shard> acc;
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [m, opt] = acc.prepare(net, sgd);
  if (acc.is_main_process()) {
    torch::manual_seed(5);
    torch::nn::Sequential other(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    torch::save(other, file);
  }
  acc.wait_for_everyone();
  torch::load(net, file);
  std::vector<torch::Tensor> loaded;
  for (auto& p : net->parameters()) loaded.push_back(p.detach().clone());
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto x = torch::ones({2, 4}) * (acc.process_index() + 1) * (step + 1);
    acc.backward(m(x).pow(2).sum());
    opt.step();
  }
  bool moved = false;
  const auto params = net->parameters();
  for (std::size_t i = 0; i < loaded.size(); ++i) {
    const auto& p = params[i];
    moved = moved || !torch::equal(p, loaded[i]);
    auto all = acc.gather(p.detach().reshape({1, -1}));
    expect(torch::allclose(all[0], all[all.size(0) - 1], 0, 0), "replicas diverged after Module::load");
  }
  expect(moved, "the optimizer did not update the loaded parameters");
}


// Two backward passes before one step, with the first pass's all-reduce still
// running (64 MB, started from backward): the second pass must not add into
// the bucket under it. Rank r's passes give r+1 and 10(r+1): the step sees
// the mean over ranks of their sum.
template <class Shard>
void two_backwards_body() {
  accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32, Shard> acc(
      accel::AcceleratorOptions{.bucket_cap_mb = 100.0, .overlap_gradient_sync = true});
  const int64_t n = int64_t{16} << 20;
  struct Scale : torch::nn::Module {
    torch::Tensor w;
    Scale(int64_t size) { w = register_parameter("w", torch::ones({size})); }
    torch::Tensor forward(const torch::Tensor& x) { return (x * w).sum(); }
  };
  auto model = std::make_shared<Scale>(n);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
  auto [m, opt] = acc.prepare(model, sgd);
  const float r = static_cast<float>(acc.process_index() + 1);
  const float mean = 11.0f * static_cast<float>(acc.num_processes() + 1) / 2.0f;
  for (int step = 1; step <= 4; ++step) {  // a race: each step is another chance to lose it
    opt.zero_grad();
    acc.backward(m(torch::full({n}, r)));
    acc.backward(m(torch::full({n}, 10 * r)));
    opt.step();
    const auto wrong =
        model->w.detach().ne(1.0f - static_cast<float>(step) * mean).sum().template item<int64_t>();
    expect(wrong == 0, "step " + std::to_string(step) + ": " + std::to_string(wrong) + " of " +
                           std::to_string(n) +
                           " parameters were not stepped by the mean of both passes' gradients");
  }
}


// Rank 1 is gone; the main process's block throws: its own error must come
// out, not std::terminate from a barrier that fails during unwinding.
void main_first_throws_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  // Both joined first: exiting earlier can cut rank 0's Gloo connection
  // set-up, and rank 0 then rightly fails because of rank 1 (seen on 2.6).
  acc.wait_for_everyone();
  if (acc.process_index() == 1) ::_exit(3);
  auto first = acc.main_process_first();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  throw std::runtime_error("the download failed");
}


// Gloo, with every collective counted: what accumulate() sends is observable.
struct CountingGloo : accel::backend::Gloo {
  static std::shared_ptr<accel::runtime::Communicator> make_communicator(const accel::runtime::ProcessEnv& env,
                                                                         const accel::AcceleratorOptions& o) {
    return std::make_shared<accel::runtime::CountingCommunicator>(accel::backend::Gloo::make_communicator(env, o));
  }
};

// 8 micro-steps with gradient_accumulation_steps = 4: collectives only in the
// 4th and 8th (the gradient all-reduce and the step's), none in the others.
template <class Shard>
void accumulate_counts_body() {
  accel::Accelerator<CountingGloo, accel::precision::Fp32, Shard> acc(
      accel::AcceleratorOptions{.gradient_accumulation_steps = 4});
  torch::manual_seed(0);
  auto net = torch::nn::Linear(8, 2);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [m, opt] = acc.prepare(net, sgd);
  auto& counting = dynamic_cast<accel::runtime::CountingCommunicator&>(acc.communicator());
  std::vector<int64_t> sent;
  for (int i = 0; i < 8; ++i) {
    const int64_t before = counting.collectives();
    {
      auto guard = acc.accumulate(m);
      acc.backward(m(torch::randn({4, 8})).sum());
      opt.step();
      opt.zero_grad();
    }
    sent.push_back(counting.collectives() - before);
  }
  std::string text;
  for (int64_t n : sent) text += std::to_string(n) + " ";
  for (int i : {0, 1, 2, 4, 5, 6}) expect(sent[static_cast<std::size_t>(i)] == 0, "collectives per micro-step: " + text);
  expect(sent[3] > 0 && sent[7] > 0, "no collective on the sync steps: " + text);
}

}  // namespace

TEST_CASE("Module::load after prepare() keeps gradients synchronised", "[parallel][gloo][load]") {
  const std::string file = accel_test::scratch("parallel", "load_after_prepare").string() + ".pt";
  REQUIRE_NOTHROW(accel::notebook_launcher(load_after_prepare_body<accel::shard::Replicate>,
                                           std::make_tuple(file), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(load_after_prepare_body<accel::shard::ShardOptimizer>,
                                           std::make_tuple(file), accel_test::local_processes(2)));
}

TEST_CASE("collectives on 2 and 3 Gloo processes", "[parallel][gloo][collectives]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(collectives_body, std::make_tuple(), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(collectives_body, std::make_tuple(), accel_test::local_processes(3)));
}

TEST_CASE("gather_for_metrics drops the wrap-around duplicates", "[parallel][gloo][metrics]") {
  // 10 items, batch 3, 2 ranks: the last round is [6,7,8] [9,0,1] -> keep 6..9.
  REQUIRE_NOTHROW(accel::notebook_launcher(metrics_body, std::make_tuple(int64_t{10}, int64_t{3}, false), accel_test::local_processes(2)));
  // 3 ranks, 11 items, batch 2: the tail wraps around across ranks.
  REQUIRE_NOTHROW(accel::notebook_launcher(metrics_body, std::make_tuple(int64_t{11}, int64_t{2}, false), accel_test::local_processes(3)));
  // drop_last: the incomplete round is dropped, nothing to trim.
  REQUIRE_NOTHROW(accel::notebook_launcher(metrics_body, std::make_tuple(int64_t{10}, int64_t{3}, true), accel_test::local_processes(2)));
  // Divisible: nothing duplicated, nothing dropped.
  REQUIRE_NOTHROW(accel::notebook_launcher(metrics_body, std::make_tuple(int64_t{12}, int64_t{3}, false), accel_test::local_processes(2)));
}

TEST_CASE("a second backward while the first one's all-reduce runs adds after it", "[parallel][gloo][overlap]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(two_backwards_body<accel::shard::Replicate>, std::make_tuple(), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(two_backwards_body<accel::shard::ShardOptimizer>, std::make_tuple(), accel_test::local_processes(2)));
}

TEST_CASE("main_process_first: a block that throws on the main process reports its error", "[parallel][gloo][main_first]") {
  try {
    accel::notebook_launcher(main_first_throws_body, std::make_tuple(), accel_test::local_processes(2));
    FAIL("the launch succeeded");
  } catch (const accel::LaunchError& e) {
    CHECK(e.rank() == 1);
    CHECK_THAT(std::string(e.what()), Catch::Matchers::ContainsSubstring("process 0 failed too: the download failed"));
  }
}

TEST_CASE("accumulate(): the non-sync micro-steps send nothing", "[parallel][gloo][accumulate]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(accumulate_counts_body<accel::shard::Replicate>, std::make_tuple(), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(accumulate_counts_body<accel::shard::ShardOptimizer>, std::make_tuple(), accel_test::local_processes(2)));
}

TEST_CASE("parameters without gradient do not hang the step", "[parallel][gloo][unused]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(unused_parameter_body, std::make_tuple(), accel_test::local_processes(2)));
}

namespace {
// A communicator on a device other than the CPU (the meta device: shapes, no
// data). It refuses tensors that are not on its device, as NCCL does with
// CPU tensors, and otherwise stops the operation with a known message: the
// helper tensors accel builds for a collective must be made on device().
class OffCpuCommunicator final : public accel::runtime::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string_view backend_name() const override { return "OffCpu"; }
  torch::Device device() const override { return torch::kMeta; }
  std::shared_ptr<accel::runtime::Work> all_reduce(torch::Tensor& t, accel::runtime::ReduceOp) override {
    return reached(t, t);
  }
  std::shared_ptr<accel::runtime::Work> all_gather(torch::Tensor& out, const torch::Tensor& in) override {
    return reached(out, in);
  }
  std::shared_ptr<accel::runtime::Work> reduce_scatter(torch::Tensor& out, const torch::Tensor& in,
                                                       accel::runtime::ReduceOp) override {
    return reached(out, in);
  }
  std::shared_ptr<accel::runtime::Work> broadcast(torch::Tensor& t, int) override { return reached(t, t); }
  void barrier() override {}

 private:
  std::shared_ptr<accel::runtime::Work> reached(const torch::Tensor& a, const torch::Tensor& b) {
    if (a.device() != device() || b.device() != device())
      throw std::runtime_error("collective got a tensor on " + a.device().str() + "/" + b.device().str());
    throw std::runtime_error("collective reached on the communicator's device");
  }
};
}  // namespace

TEST_CASE("helper tensors of collectives are made on the communicator's device", "[parallel][collectives][device]") {
  OffCpuCommunicator comm;
  const auto reached = Catch::Matchers::ContainsSubstring("reached on the communicator's device");
  CHECK_THROWS_WITH(accel::ops::pad_across_processes(comm, torch::ones({3, 2}).to(torch::kMeta)), reached);
  CHECK_THROWS_WITH(accel::ops::gather(comm, torch::ones({3}).to(torch::kMeta), /*check_shapes=*/true),
                    reached);
}
