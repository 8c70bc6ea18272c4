// 060 — checkpoint and resume: a run interrupted in the middle of an epoch and
// resumed with load_state() ends with exactly the weights of a run that was
// never interrupted. save_state() writes the model, the optimizer (Adam's
// moments), the OneCycleLR position, each loader's place in its shuffled
// epoch, every process's random generators (dropout) and registered objects
// (here a step counter); load_state() puts them all back.
// Three launches of 2 processes each (Accelerator<backend::Gloo>): the
// uninterrupted run, a run that saves its state at step 40 (epoch 2, batch 8
// of 16) and stops, and a fresh run that loads that state and continues.
// Run: ./build/examples/060-checkpoint-resume [work_dir]   (default ./060-checkpoint-resume.data)
// Expected output (the loss may differ a little on another machine):
//   uninterrupted: 64 steps, final loss 0.004205
//   interrupted: state saved after step 40 (epoch 2, 8 of 16 batches)
//   resumed: continued from step 40 (epoch 2)
//   resumed: 64 steps, final loss 0.004205
//   largest weight difference between uninterrupted and resumed: 0
// Exit status 0 when the resumed weights equal the uninterrupted ones (within 1e-6).
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <stdexcept>
#include <string>

namespace fs = std::filesystem;

// 4 classes of points in 8 dimensions: the label is the nearest of 4 fixed centres.
struct Blobs : torch::data::datasets::Dataset<Blobs> {
  torch::Tensor x, y;
  Blobs() {
    auto gen = at::detail::createCPUGenerator(7);
    auto centres = torch::randn({4, 8}, gen) * 3;
    y = torch::randint(0, 4, {1024}, gen, torch::kLong);
    x = centres.index_select(0, y) + torch::randn({1024, 8}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x[i], y[i]}; }
  torch::optional<size_t> size() const override { return 1024; }
};

/// Anything with state_dict()/load_state_dict() can join the checkpoint.
struct StepCounter {
  int64_t step = 0;
  torch::Tensor state_dict() const { return torch::tensor({step}); }
  void load_state_dict(const torch::Tensor& t) { step = t.item<int64_t>(); }
};

constexpr int kEpochs = 4;

/// mode: "uninterrupted", "interrupted" (saves its state mid-epoch and stops)
/// or "resumed" (loads that state first).
void train(std::string work, std::string mode) {
  accel::Accelerator<accel::backend::Gloo> accelerator;
  accel::set_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Dropout(0.2),
                              torch::nn::Linear(32, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto loader = accel::data::make_data_loader(Blobs(), {.batch_size = 32, .shuffle = true});
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);
  accel::sched::OneCycleLR scheduler(optimizer, {.max_lr = 1e-2, .total_steps = kEpochs * dl.size()});
  auto [sched] = accelerator.prepare(scheduler);
  StepCounter counter;
  accelerator.register_for_checkpointing(counter);

  const fs::path checkpoint = fs::path(work) / "checkpoint";
  const int64_t stop_at = 2 * dl.size() + dl.size() / 2;  // in the middle of epoch 2
  if (mode == "resumed") {
    accelerator.load_state(checkpoint);  // also puts dl at epoch 2, batch 8
    accelerator.print("resumed: continued from step ", counter.step, " (epoch ", dl.epoch(), ")");
  }
  double loss_value = 0;
  while (dl.epoch() < kEpochs) {
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      sched.step();
      loss_value = loss.item<double>();
      if (++counter.step == stop_at && mode == "interrupted") {
        accelerator.save_state(checkpoint);
        accelerator.print("interrupted: state saved after step ", counter.step, " (epoch ", dl.epoch(),
                          ", ", counter.step - dl.epoch() * dl.size(), " of ", dl.size(), " batches)");
        return;  // as if the job had been stopped here
      }
    }
  }
  accelerator.print(mode, ": ", counter.step, " steps, final loss ", loss_value);
  accelerator.save_model(m, fs::path(work) / mode);
}

int main(int argc, char** argv) {
  const fs::path work = argc > 1 ? argv[1] : "060-checkpoint-resume.data";
  fs::remove_all(work);
  const accel::LaunchOptions two_processes{
      .num_processes = 2, .master_port = 0, .timeout = std::chrono::seconds(120)};
  try {
    for (std::string mode : {"uninterrupted", "interrupted", "resumed"})
      accel::notebook_launcher(train, std::make_tuple(work.string(), mode), two_processes);
  } catch (const accel::Error& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  std::map<std::string, torch::Tensor> uninterrupted;
  for (auto& [name, t] : accel::ckpt::load_checkpoint(work / "uninterrupted")) uninterrupted[name] = t;
  double difference = 0;
  for (auto& [name, t] : accel::ckpt::load_checkpoint(work / "resumed"))
    difference = std::max(difference, (t - uninterrupted.at(name)).abs().max().item<double>());
  std::cout << "largest weight difference between uninterrupted and resumed: " << difference << std::endl;
  return difference <= 1e-6 ? 0 : 1;
}
