// 070 — elastic restarts: a process dies in the middle of training (here it
// kills itself with SIGKILL, as the out-of-memory killer or a preemption
// would), the launcher stops the other one and starts both again, and the
// new processes resume from the newest complete checkpoint by themselves.
// The training code only adds two calls: load_latest_state() before the loop
// and save_state() every few steps (automatic naming under project_dir).
// Two launches of 2 processes each (Accelerator<backend::Gloo>): an
// uninterrupted run, and a run with LaunchOptions::max_restarts = 2 whose
// rank 1 dies at step 50 on the first attempt. Both end with the same weights.
// Run: ./build/examples/070-elastic [work_dir]   (default ./070-elastic.data)
// Expected output (the loss may differ a little on another machine; the
// launcher's line about the failure goes to stderr):
//   uninterrupted: attempt 0 starts from scratch
//   uninterrupted: 64 steps, final loss 0.0889829
//   elastic: attempt 0 starts from scratch
//   accel: process 1 failed on attempt 1 of 3: killed by signal SIGKILL; process 0 failed because of it. Restarting all 2 processes (restart 1 of 2).
//   elastic: attempt 1 resumes from checkpoint_2 (step 48, epoch 2)
//   elastic: 64 steps, final loss 0.0889829
//   largest weight difference between uninterrupted and elastic: 0
// Exit status 0 when the weights are identical.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

// 4 classes of points in 8 dimensions: the label is the nearest of 4 fixed centres.
struct Blobs : torch::data::datasets::Dataset<Blobs> {
  torch::Tensor x, y;
  Blobs() {
    auto gen = at::detail::createCPUGenerator(7);
    auto centres = torch::randn({4, 8}, gen) * 3;
    y = torch::randint(0, 4, {256}, gen, torch::kLong);
    x = centres.index_select(0, y) + torch::randn({256, 8}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x[i], y[i]}; }
  torch::optional<size_t> size() const override { return 256; }
};

struct StepCounter {
  int64_t step = 0;
  torch::Tensor state_dict() const { return torch::tensor({step}); }
  void load_state_dict(const torch::Tensor& t) { step = t.item<int64_t>(); }
};

constexpr int64_t kSteps = 64;  // 4 epochs of 16 steps (2 processes x 8 samples per step)

void train(std::string work, std::string mode) {
  accel::Accelerator<accel::backend::Gloo> accelerator(
      {.project_dir = (fs::path(work) / mode).string(), .automatic_checkpoint_naming = true});
  accel::set_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Dropout(0.2),
                              torch::nn::Linear(32, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto loader = accel::data::make_data_loader(Blobs(), {.batch_size = 8, .shuffle = true});
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);
  StepCounter counter;
  accelerator.register_for_checkpointing(counter);

  // The first attempt finds nothing; a restarted one finds what the failed one saved.
  if (const auto latest = accelerator.load_latest_state())
    accelerator.print(mode, ": attempt ", accel::restart_count(), " resumes from ",
                      latest->filename().string(), " (step ", counter.step, ", epoch ", dl.epoch(), ")");
  else
    accelerator.print(mode, ": attempt ", accel::restart_count(), " starts from scratch");

  double loss_value = 0;
  while (counter.step < kSteps) {
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      loss_value = loss.item<double>();
      if (++counter.step % 16 == 0) accelerator.save_state();
      if (mode == "elastic" && counter.step == 50 && accel::restart_count() == 0 &&
          accelerator.process_index() == 1)
        std::raise(SIGKILL);  // dies without a word, between two checkpoints
      if (counter.step == kSteps) break;
    }
  }
  accelerator.print(mode, ": ", counter.step, " steps, final loss ", loss_value);
  if (accelerator.is_main_process()) {
    std::vector<torch::Tensor> weights;
    for (auto& p : model->parameters()) weights.push_back(p.detach().clone());
    torch::save(weights, (fs::path(work) / (mode + ".pt")).string());
  }
}

int main(int argc, char** argv) {
  const fs::path work = argc > 1 ? argv[1] : "070-elastic.data";
  fs::remove_all(work);
  fs::create_directories(work);
  accel::LaunchOptions options{.num_processes = 2, .master_port = 0, .timeout = std::chrono::seconds(300)};
  try {
    accel::notebook_launcher(train, std::make_tuple(work.string(), std::string("uninterrupted")), options);
    options.max_restarts = 2;  // survive up to two failures
    accel::notebook_launcher(train, std::make_tuple(work.string(), std::string("elastic")), options);
  } catch (const accel::Error& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  std::vector<torch::Tensor> a, b;
  torch::load(a, (work / "uninterrupted.pt").string());
  torch::load(b, (work / "elastic.pt").string());
  double difference = a.size() == b.size() ? 0.0 : 1.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    difference = std::max(difference, (a[i] - b[i]).abs().max().item<double>());
  std::cout << "largest weight difference between uninterrupted and elastic: " << difference << std::endl;
  return difference == 0 ? 0 : 1;
}
