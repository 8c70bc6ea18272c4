// accel::PreparedModel (include/accel/prepared/model.hpp): the forward runs
// under the precision policy's autocast, and what leaves it is float32.
#include <accel/accelerator.hpp>

#include "catch.hpp"

namespace {
// Records the dtype of its intermediate result: what autocast made of it.
struct Probe : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  at::ScalarType seen = at::kDouble;
  Probe() { lin = register_module("lin", torch::nn::Linear(8, 8)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = lin->forward(x);
    seen = h.scalar_type();
    return h.to(torch::kFloat);
  }
};
}  // namespace

TEST_CASE("bf16 autocast is on inside the prepared model's forward, and only there", "[prepared][model]") {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16> acc;
  torch::manual_seed(0);
  auto probe = std::make_shared<Probe>();
  auto [model] = acc.prepare(probe);
  const auto x = torch::randn({4, 8});
  const auto through_accel = model(x);
  CHECK(probe->seen == torch::kBFloat16);
  const auto plain = probe->forward(x);
  CHECK(probe->seen == torch::kFloat);
  CHECK_FALSE(torch::equal(through_accel, plain));  // rounded through bfloat16
  CHECK(torch::allclose(through_accel, plain, 2e-2, 2e-2));
}

namespace {
// Outputs of several kinds: a tuple, a vector, and an integer tensor.
struct Heads : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  Heads() { lin = register_module("lin", torch::nn::Linear(4, 3)); }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto h = lin->forward(x);
    return {h, h.argmax(1)};
  }
};
struct Layers : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  Layers() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  std::vector<torch::Tensor> forward(const torch::Tensor& x) {
    auto a = lin->forward(x);
    return {a, lin->forward(a)};
  }
};
}  // namespace

TEST_CASE("under Bf16 the floating outputs in a tuple or vector come back float32, indices stay integers",
          "[prepared][model]") {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16> acc;
  torch::manual_seed(0);
  auto heads = std::make_shared<Heads>();
  auto layers = std::make_shared<Layers>();
  auto [h, l] = acc.prepare(heads, layers);
  const auto x = torch::randn({5, 4});
  auto [scores, best] = h(x);
  CHECK(scores.scalar_type() == torch::kFloat);
  CHECK(best.scalar_type() == torch::kLong);
  // The values are the bfloat16 computation's, widened: within bfloat16's
  // 8 bits of mantissa of the float32 ones.
  auto [plain_scores, plain_best] = heads->forward(x);
  CHECK(torch::allclose(scores, plain_scores, 2e-2, 2e-2));
  auto out = l(x);
  REQUIRE(out.size() == 2);
  for (const auto& t : out) CHECK(t.scalar_type() == torch::kFloat);
  CHECK(torch::allclose(out[1], layers->forward(x)[1], 5e-2, 5e-2));
}

TEST_CASE("under Fp32 the prepared model returns what the module returns", "[prepared][model]") {
  accel::Accelerator<> acc;
  auto layers = std::make_shared<Layers>();
  auto [l] = acc.prepare(layers);
  CHECK(l.get() == layers.get());
  CHECK(&*l == layers.get());
  CHECK(l->lin.get() == layers->lin.get());
  const auto x = torch::randn({2, 4}, torch::kDouble);
  layers->to(torch::kDouble);
  auto out = l(x);
  CHECK(out[0].scalar_type() == torch::kDouble);  // not narrowed to float32
  CHECK(torch::equal(out[1], layers->forward(x)[1]));
}
