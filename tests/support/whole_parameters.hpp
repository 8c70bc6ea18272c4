// The trained parameters of a prepared model, in named_parameters() order, on
// every rank. Under shard::ShardParameters no rank holds them whole outside
// forward and backward, so save_model() gathers them into a file first.
#pragma once

#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>

#include <filesystem>
#include <stdexcept>
#include <vector>

namespace accel_test {

template <class Acc, class Prepared>
std::vector<torch::Tensor> whole_parameters(Acc& acc, Prepared& prepared, const std::filesystem::path& scratch_dir) {
  std::vector<torch::Tensor> out;
  auto& module = *acc.unwrap_model(prepared);
  if (prepared.gradient_sync().parameter_gather() == nullptr) {
    for (auto& p : module.parameters()) out.push_back(p.detach().clone());
    return out;
  }
  acc.save_model(prepared, scratch_dir);
  const auto file = accel::ckpt::load_safetensors(scratch_dir / "model.safetensors");
  for (auto& item : module.named_parameters()) {
    const auto before = out.size();
    for (const auto& [key, t] : file)
      if (key == item.key()) out.push_back(t);
    if (out.size() == before) throw std::runtime_error("save_model() wrote no " + item.key());
  }
  return out;
}

}  // namespace accel_test
