// A worker for tests/cli/launch_netns.sh: 20 SGD steps of a 3-layer MLP with
// Accelerator<backend::Gloo> and the communication hook named by argv[1]
// (none, fp16, powersgd), each process on its own rows of every global batch.
// Rank 0 then writes the parameters' raw bytes to argv[2] (the script compares
// runs over different networks bit for bit) and prints how far they are from
// the same 20 steps in one process on the whole batches, with LibTorch alone.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <string>

namespace {

constexpr int kSteps = 20, kGlobalBatch = 32, kIn = 64, kHidden = 512, kClasses = 10;

torch::nn::Sequential make_model() {
  torch::manual_seed(0);  // the same initial weights in every process and in the reference
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kClasses));
}

struct Batches {
  torch::Tensor x, y;  // kSteps global batches of kGlobalBatch rows
  Batches() {
    auto gen = at::detail::createCPUGenerator(7);
    x = torch::randn({kSteps, kGlobalBatch, kIn}, gen);
    y = torch::randint(0, kClasses, {kSteps, kGlobalBatch}, gen, torch::kLong);
  }
};

torch::Tensor flat(const torch::nn::Module& m) {
  std::vector<torch::Tensor> ps;
  for (const auto& p : m.parameters()) ps.push_back(p.detach().flatten());
  return torch::cat(ps);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::cerr << "usage: netns_train none|fp16|powersgd OUT_FILE\n";
    return 2;
  }
  const std::string hook = argv[1];
  accel::AcceleratorOptions options;
  options.overlap_gradient_sync = false;  // the same schedule on every machine shape
  if (hook == "fp16") {
    options.comm_hook = accel::CommHook::Fp16;
  } else if (hook == "powersgd") {
    options.comm_hook = accel::CommHook::PowerSGD;
    options.powersgd.start_powerSGD_iter = 2;
  } else if (hook != "none") {
    std::cerr << "netns_train: unknown hook '" << hook << "'\n";
    return 2;
  }
  accel::Accelerator<accel::backend::Gloo> accelerator(options);
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05));
  auto [m, opt] = accelerator.prepare(model, sgd);

  const Batches data;
  const int n = accelerator.num_processes(), r = accelerator.process_index();
  const int rows = kGlobalBatch / n;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto x = data.x[s].narrow(0, r * rows, rows), y = data.y[s].narrow(0, r * rows, rows);
    accelerator.backward(torch::cross_entropy_loss(m(x), y));
    opt.step();
  }
  if (!accelerator.is_main_process()) return 0;

  const auto trained = flat(*model).contiguous();
  std::ofstream(argv[2], std::ios::binary)
      .write(static_cast<const char*>(trained.data_ptr()), static_cast<std::streamsize>(trained.nbytes()));

  auto reference = make_model();
  torch::optim::SGD ref_sgd(reference->parameters(), torch::optim::SGDOptions(0.05));
  for (int s = 0; s < kSteps; ++s) {
    ref_sgd.zero_grad();
    torch::cross_entropy_loss(reference->forward(data.x[s]), data.y[s]).backward();
    ref_sgd.step();
  }
  std::cout << "processes " << n << " hook " << hook << " parameters " << trained.numel()
            << " max_abs_diff_vs_one_process " << (trained - flat(*reference)).abs().max().item<double>()
            << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << std::endl;
  return 1;
}
