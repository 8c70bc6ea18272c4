// Replicas start from rank 0's weights and buffers and stay equal (issue 13,
// C15): every other test seeds all ranks alike, so the broadcasts at prepare()
// and before each training forward could break unnoticed. Here each rank
// builds its model from its own seed and BatchNorm statistics, and trains on
// its own data. Also accelerator.print on the main process only (C18).
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "catch.hpp"

#include "paths.hpp"

namespace {

std::filesystem::path scratch(const std::string& name) { return accel_test::scratch("parallel", name); }

/// Linear, BatchNorm1d, ReLU, Linear from `seed`; the BatchNorm running mean
/// set to `stats` so that ranks' buffers differ too.
torch::nn::Sequential make_bn_model(uint64_t seed, float stats) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(6, 8));
  seq->push_back(torch::nn::BatchNorm1d(8));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(8, 2));
  torch::NoGradGuard no_grad;
  seq[1]->as<torch::nn::BatchNorm1d>()->running_mean.fill_(stats);
  return seq;
}

std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

std::vector<torch::Tensor> load(const std::string& file) {
  std::vector<torch::Tensor> v;
  torch::load(v, file);
  return v;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

void train_own_seed(std::string out) {
  accel::Accelerator<accel::backend::Gloo> acc;
  const int r = acc.process_index();
  auto model = make_bn_model(100 + static_cast<uint64_t>(r), static_cast<float>(r + 1));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [m, opt] = acc.prepare(model, sgd);
  torch::save(snapshot(*model), out + "_init_" + std::to_string(r) + ".pt");

  torch::manual_seed(200 + static_cast<uint64_t>(r));  // each rank its own data
  for (int step = 0; step < 4; ++step) {
    auto x = torch::randn({5, 6}) * (r + 1), y = torch::randn({5, 2});
    opt.zero_grad();
    acc.backward(torch::mse_loss(m(x), y));
    opt.step();
  }
  // One more training forward on the same batch everywhere: the buffers are
  // rank 0's before it, so they are equal after it.
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(7);
    m(torch::randn({5, 6}));
  }
  torch::save(snapshot(*model), out + "_final_" + std::to_string(r) + ".pt");

  // print: the main process only. stdout goes to a per-rank file meanwhile.
  std::fflush(stdout);
  std::cout.flush();
  const int saved = ::dup(1);
  std::FILE* f = std::fopen((out + "_print_" + std::to_string(r) + ".txt").c_str(), "w");
  ::dup2(::fileno(f), 1);
  acc.print("printed by rank ", r);
  std::cout.flush();
  ::dup2(saved, 1);
  ::close(saved);
  std::fclose(f);
}

}  // namespace

TEST_CASE("replicas start from rank 0's weights and buffers and stay equal", "[parallel][gloo][broadcast]") {
  for (int world : {2, 3}) {
    INFO(world << " processes");
    auto out = scratch("own_seed_" + std::to_string(world)).string();
    accel::LaunchOptions lo;
    lo.num_processes = world;
    lo.master_port = 0;
    lo.timeout = std::chrono::seconds(120);
    accel::notebook_launcher(train_own_seed, std::make_tuple(out), lo);

    // Rank 0's model, built independently here: what every replica starts from.
    auto reference = snapshot(*make_bn_model(100, 1.0f));
    for (int r = 0; r < world; ++r) {
      INFO("rank " << r);
      CHECK(all_equal(load(out + "_init_" + std::to_string(r) + ".pt"), reference));
    }
    // Different data per rank, averaged gradients: the same parameters
    // everywhere, bit for bit, and BatchNorm statistics that follow rank 0.
    auto final0 = load(out + "_final_0.pt");
    CHECK_FALSE(all_equal(final0, reference));  // it trained
    for (int r = 1; r < world; ++r) {
      INFO("rank " << r);
      CHECK(all_equal(load(out + "_final_" + std::to_string(r) + ".pt"), final0));
    }
    for (int r = 0; r < world; ++r) {
      std::ifstream in(out + "_print_" + std::to_string(r) + ".txt");
      std::string text((std::istreambuf_iterator<char>(in)), {});
      INFO("rank " << r << " printed '" << text << "'");
      CHECK(text == (r == 0 ? "printed by rank 0\n" : ""));
    }
  }
}
