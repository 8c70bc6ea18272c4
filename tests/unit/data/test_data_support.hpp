// Shared helpers of the data tests: a dataset whose samples are their own
// indices, and conversions of batches to plain vectors.
#ifndef ACCEL_TESTS_UNIT_DATA_SUPPORT_HPP
#define ACCEL_TESTS_UNIT_DATA_SUPPORT_HPP

#include <accel/data.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace accel_test {

// Sample i: data = i (int64 scalar), target = 10 * i.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  explicit IndexDataset(size_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::tensor(static_cast<int64_t>(i)), torch::tensor(static_cast<int64_t>(10 * i))};
  }
  torch::optional<size_t> size() const override { return n; }
  size_t n;
};

inline std::vector<int64_t> to_vec(const torch::Tensor& t) {
  auto c = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

using Batches = std::vector<std::vector<int64_t>>;

template <class Loader>
Batches collect(Loader& loader) {
  Batches out;
  for (auto& batch : loader) out.push_back(to_vec(batch.data));
  return out;
}

}  // namespace accel_test

#endif
