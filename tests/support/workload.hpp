// Workload W (shared/WORKLOAD.md): data, model and optimizer, built exactly
// as the benchmark defines them so raw LibTorch, accel and Python agree.
#ifndef ACCEL_TESTS_SUPPORT_WORKLOAD_HPP
#define ACCEL_TESTS_SUPPORT_WORKLOAD_HPP

#include <torch/torch.h>

namespace workload {

struct Data {
  torch::Tensor x, y;
};

inline Data make_data(int64_t rows = 6400) {
  torch::manual_seed(0);
  Data d;
  d.x = torch::randn({rows, 784});
  d.y = torch::randint(0, 10, {rows}, torch::kLong);
  return d;
}

/// Layers pushed one statement at a time: argument evaluation order would
/// otherwise change the initialisation.
inline torch::nn::Sequential make_model() {
  torch::manual_seed(1);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(784, 2048));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(2048, 2048));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(2048, 2048));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(2048, 10));
  return seq;
}

inline torch::optim::SGDOptions sgd_options() { return torch::optim::SGDOptions(0.01).momentum(0.9); }

/// A dataset over the rows of W, for accel's data loader.
struct Dataset : torch::data::datasets::Dataset<Dataset> {
  Data d;
  explicit Dataset(Data data) : d(std::move(data)) {}
  torch::data::Example<> get(size_t i) override {
    return {d.x[static_cast<int64_t>(i)], d.y[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(d.x.size(0)); }
};

/// One process, plain LibTorch: `steps` steps, step i on rows [64b, 64b+64), b = i % 100.
inline std::vector<torch::Tensor> reference_parameters(int steps, int64_t batch = 64) {
  auto data = make_data();
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), sgd_options());
  for (int i = 0; i < steps; ++i) {
    int64_t b = i % 100;
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(data.x.narrow(0, batch * b, batch)),
                                          data.y.narrow(0, batch * b, batch));
    loss.backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
}

}  // namespace workload

#endif  // ACCEL_TESTS_SUPPORT_WORKLOAD_HPP
