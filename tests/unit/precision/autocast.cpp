// The precision policies' autocast on one process (include/accel/precision/):
// Bf16 computes in bfloat16 inside the guard only; Fp16 needs CUDA.
#include <accel/accelerator.hpp>

#include "catch.hpp"

TEST_CASE("bf16 autocast: forward in bfloat16, outputs back in float32", "[precision][autocast]") {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16> acc;
  auto lin = torch::nn::Linear(4, 4);
  auto [model] = acc.prepare(lin);
  auto x = torch::randn({2, 4});
  auto y = model(x);
  CHECK(y.scalar_type() == torch::kFloat);
  auto expected = lin->forward(x.to(torch::kBFloat16).to(torch::kFloat)).to(torch::kFloat);
  {
    auto guard = acc.autocast();
    CHECK(lin->forward(x).scalar_type() == torch::kBFloat16);
  }
  CHECK(lin->forward(x).scalar_type() == torch::kFloat);  // guard restored the state
  CHECK(torch::allclose(y, expected, 2e-2, 2e-2));
}

TEST_CASE("Fp16 runs on CUDA, and without CUDA is a clear error that suggests Bf16", "[precision][autocast]") {
  using Fp16Acc = accel::Accelerator<accel::backend::SingleDevice, accel::precision::Fp16>;
  if (torch::cuda::is_available()) {
    Fp16Acc acc;
    CHECK(acc.device().is_cuda());
    return;
  }
  CHECK_THROWS_WITH(Fp16Acc(), Catch::Matchers::ContainsSubstring("precision::Fp16 needs a CUDA device") &&
                                   Catch::Matchers::ContainsSubstring("precision::Bf16"));
}
