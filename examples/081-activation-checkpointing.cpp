// 081 — activation checkpointing: a deep residual MLP trained with each block
// under accel::checkpoint (through checkpoint_sequential) follows exactly the
// same trajectory as without, with dropout and bf16 autocast: backward
// recomputes each block with the random state and the precision of its
// forward. The price is one more forward per step.
// Run: ./build/examples/081-activation-checkpointing
// Expected output (the times differ on another machine):
//   step 0: loss 1.38249 (checkpointed) vs 1.38249 (plain)
//   ...
//   step 19: loss 0.0562557 (checkpointed) vs 0.0562557 (plain)
//   20 steps each; losses and weights bit-identical; 52 ms/step checkpointed, 29 ms/step plain
// Exit status 0 when every loss and the final weights are bit-identical.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <vector>

// x + fc2(dropout(gelu(fc1(x)))): keeps 8x its input for backward.
struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  explicit BlockImpl(int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + fc2(torch::dropout(torch::gelu(fc1(x)), 0.1, is_training()));
  }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  torch::nn::Sequential blocks;
  torch::nn::Linear head{nullptr};
  bool checkpointed;
  explicit NetImpl(bool ckpt) : checkpointed(ckpt) {
    torch::manual_seed(1);
    for (int i = 0; i < 8; ++i) blocks->push_back(Block(32));
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(checkpointed ? accel::checkpoint_sequential(blocks, x) : blocks->forward(x));
  }
};
TORCH_MODULE(Net);

struct Run {
  std::vector<torch::Tensor> losses;
  torch::Tensor weights;
  double ms_per_step;
};

Run train(bool checkpointed) {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16> acc;
  Net net(checkpointed);
  torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-3));
  auto [model, opt] = acc.prepare(net, adamw);
  torch::manual_seed(2);  // data and dropout
  auto x = torch::randn({64, 32});
  auto y = torch::randint(0, 4, {64}, torch::kLong);
  Run run;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < 20; ++step) {
    auto loss = torch::cross_entropy_loss(model(x), y);
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
    run.losses.push_back(loss.detach().clone());
  }
  run.ms_per_step = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / 20;
  std::vector<torch::Tensor> flat;
  for (const auto& p : net->parameters()) flat.push_back(p.detach().flatten());
  run.weights = torch::cat(flat);
  return run;
}

int main() {
  const auto plain = train(false);
  const auto ckpt = train(true);
  bool same = torch::equal(plain.weights, ckpt.weights);
  for (std::size_t i = 0; i < plain.losses.size(); ++i) {
    same = same && torch::equal(plain.losses[i], ckpt.losses[i]);
    if (i % 5 == 0 || i + 1 == plain.losses.size())
      std::cout << "step " << i << ": loss " << ckpt.losses[i].item<float>() << " (checkpointed) vs "
                << plain.losses[i].item<float>() << " (plain)\n";
  }
  std::cout << plain.losses.size() << " steps each; losses and weights "
            << (same ? "bit-identical" : "DIFFER") << "; " << static_cast<int>(ckpt.ms_per_step)
            << " ms/step checkpointed, " << static_cast<int>(plain.ms_per_step) << " ms/step plain\n";
  return same ? 0 : 1;
}
