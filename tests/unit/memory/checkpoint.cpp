// accel::checkpoint: gradients with checkpointing are bit-identical to those
// without (dropout, fp32 and bf16 autocast, several inputs and outputs,
// nesting), and the activations kept by forward take less memory.
#include <accel/memory.hpp>
#include <accel/precision/autocast.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <c10/core/CPUAllocator.h>

#include "catch.hpp"

namespace {

using torch::Tensor;

/// Runs `step` (forward + backward) from the same seed and returns every
/// gradient it produced (parameters first, then the extra tensors), plus a
/// number drawn after it: the random state the rest of the program sees.
std::vector<Tensor> grads_of(torch::nn::Module& model, const std::vector<Tensor>& extra,
                             const std::function<Tensor()>& step) {
  model.zero_grad();
  for (auto t : extra) t.mutable_grad() = Tensor();
  torch::manual_seed(7);
  auto loss = step();
  loss.backward();
  std::vector<Tensor> out{loss.detach().clone()};
  for (const auto& p : model.parameters()) {
    REQUIRE(p.grad().defined());
    out.push_back(p.grad().clone());
  }
  for (const auto& t : extra) out.push_back(t.grad().defined() ? t.grad().clone() : Tensor());
  out.push_back(torch::rand({4}));
  return out;
}

void require_identical(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("tensor " << i << " of " << a.size());
    REQUIRE(a[i].defined() == b[i].defined());
    if (!a[i].defined()) continue;
    REQUIRE(a[i].scalar_type() == b[i].scalar_type());
    CHECK(torch::equal(a[i], b[i]));  // bit-identical, not close
  }
}

torch::nn::Sequential make_mlp() {
  torch::manual_seed(1);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(16, 32));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Dropout(0.3));
  seq->push_back(torch::nn::Linear(32, 32));
  seq->push_back(torch::nn::GELU());
  seq->push_back(torch::nn::Dropout(0.3));
  seq->push_back(torch::nn::Linear(32, 4));
  return seq;
}

/// Pre-norm transformer block: attention (with dropout) and an MLP, each
/// with a residual connection. Input (sequence, batch, embedding).
struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  explicit BlockImpl(int64_t e) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({e})));
    attn = register_module("attn", torch::nn::MultiheadAttention(
                                       torch::nn::MultiheadAttentionOptions(e, 2).dropout(0.2)));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({e})));
    fc1 = register_module("fc1", torch::nn::Linear(e, 4 * e));
    fc2 = register_module("fc2", torch::nn::Linear(4 * e, e));
  }
  Tensor forward(const Tensor& x) {
    auto h = ln1(x);
    auto y = x + std::get<0>(attn(h, h, h));
    return y + torch::dropout(fc2(torch::gelu(fc1(ln2(y)))), 0.1, is_training());
  }
};
TORCH_MODULE(Block);

struct TransformerImpl : torch::nn::Module {
  Block b1{nullptr}, b2{nullptr};
  TransformerImpl() {
    torch::manual_seed(2);
    b1 = register_module("b1", Block(16));
    b2 = register_module("b2", Block(16));
  }
};
TORCH_MODULE(Transformer);

/// The counting allocator: bytes of CPU tensor storage alive now and at
/// most since reset(). Installed for its lifetime in place of LibTorch's.
class CountingAllocator final : public c10::Allocator {
 public:
  CountingAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~CountingAllocator() { c10::SetCPUAllocator(inner_, kPriority); }
  CountingAllocator(const CountingAllocator&) = delete;
  CountingAllocator& operator=(const CountingAllocator&) = delete;

  // LibTorch 1.13 declares allocate() const, 2.x not; copy_data() exists
  // from 2.3. Both forms are defined: one overrides, the other is unused
  // (so no member says `override`: it would be wrong for one version).
  c10::DataPtr allocate(std::size_t n) const { return counted(n); }
  c10::DataPtr allocate(std::size_t n) { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }

  c10::DeleterFnPtr raw_deleter() const { return &release; }
  bool installed() const { return c10::GetCPUAllocator() == this; }
  void reset() { peak_ = live_.load(); }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }

 private:
  static constexpr uint8_t kPriority = 0;  // LibTorch registers its own with 0
  // Storage may outlive the allocator (gradients made during backward):
  // the counters are global. The context must be the data pointer
  // (Allocator::raw_allocate checks it), so blocks are found by address.
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<void*, Block>& blocks() {
    static std::unordered_map<void*, Block> b;
    return b;
  }
  static void release(void* data) {
    Block b;
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto it = blocks().find(data);
      if (it == blocks().end()) return;
      b = std::move(it->second);
      blocks().erase(it);
    }
    live_ -= b.bytes;  // b.inner frees the memory when it goes
  }
  c10::DataPtr counted(std::size_t n) const {
    auto inner = inner_->allocate(n);
    void* data = inner.get();
    auto device = inner.device();
    if (data == nullptr) return inner;
    const auto bytes = static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(mutex());
      blocks()[data] = Block{std::move(inner), bytes};
    }
    const int64_t now = live_ += bytes;
    int64_t seen = peak_;
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return {data, data, &release, device};
  }

  c10::Allocator* inner_;
  static inline std::atomic<int64_t> live_{0};
  static inline std::atomic<int64_t> peak_{0};
};

/// One residual MLP block: what it keeps for backward (fc1's output for GELU,
/// GELU's output for fc2) is 8x its input.
struct ResidualImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  explicit ResidualImpl(int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  Tensor forward(const Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
};
TORCH_MODULE(Residual);

}  // namespace

TEST_CASE("checkpoint: an MLP with dropout gets bit-identical gradients", "[memory][checkpoint]") {
  auto mlp = make_mlp();
  auto x = torch::randn({8, 16});
  auto y = torch::randn({8, 4});
  auto plain = grads_of(*mlp, {}, [&] { return torch::mse_loss(mlp->forward(x), y); });
  SECTION("checkpoint of the whole model") {
    auto got = grads_of(*mlp, {}, [&] {
      return torch::mse_loss(accel::checkpoint([&](const Tensor& in) { return mlp->forward(in); }, x), y);
    });
    require_identical(plain, got);
  }
  SECTION("checkpoint_sequential: each child on its own") {
    auto got = grads_of(*mlp, {}, [&] { return torch::mse_loss(accel::checkpoint_sequential(mlp, x), y); });
    require_identical(plain, got);
  }
  SECTION("the input requires a gradient too") {
    auto xg = x.clone().requires_grad_(true);
    auto ref = grads_of(*mlp, {xg}, [&] { return torch::mse_loss(mlp->forward(xg), y); });
    auto got = grads_of(*mlp, {xg}, [&] { return torch::mse_loss(accel::checkpoint_sequential(mlp, xg), y); });
    REQUIRE(ref[ref.size() - 2].defined());
    require_identical(ref, got);
  }
}

TEST_CASE("checkpoint: a transformer block, fp32 and bf16 autocast", "[memory][checkpoint][bf16]") {
  Transformer net;
  auto x = torch::randn({5, 3, 16});  // (sequence, batch, embedding)
  auto run = [&](bool checkpointed, bool bf16) {
    return grads_of(*net, {}, [&] {
      Tensor out;
      {
        accel::precision::AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16, bf16);
        auto block = [](Block& b) { return [&b](const Tensor& in) { return b->forward(in); }; };
        out = checkpointed ? accel::checkpoint(block(net->b2), accel::checkpoint(block(net->b1), x))
                           : net->b2->forward(net->b1->forward(x));
      }
      return out.to(torch::kFloat).pow(2).mean();  // backward outside the autocast region
    });
  };
  SECTION("fp32") { require_identical(run(false, false), run(true, false)); }
  SECTION("bf16 autocast") {
    auto plain = run(false, true);
    require_identical(plain, run(true, true));
    CHECK_FALSE(torch::equal(plain[1], run(false, false)[1]));  // autocast did compute in bf16
  }
}

TEST_CASE("checkpoint: several inputs and outputs, non-tensor arguments", "[memory][checkpoint]") {
  torch::manual_seed(3);
  torch::nn::Linear lin(6, 6);
  auto a = torch::randn({4, 6}).requires_grad_(true);
  auto b = torch::randn({4, 6}).requires_grad_(true);
  auto c = torch::randn({4, 6});  // no gradient
  auto fn = [&](const Tensor& p, const Tensor& q, const Tensor& r, double scale, int64_t power) {
    auto h = lin(p * q) * scale + r;
    return std::make_tuple(torch::dropout(h, 0.5, true), (p + q).pow(power), h.argmax(1));
  };
  auto loss_of = [](const std::tuple<Tensor, Tensor, Tensor>& o, bool second) {
    auto l = std::get<0>(o).pow(2).sum();
    return second ? l + std::get<1>(o).sum() : l;
  };
  for (bool second : {true, false}) {  // false: one output gets no gradient at all
    INFO("second output in the loss: " << second);
    auto plain = grads_of(*lin, {a, b, c}, [&] { return loss_of(fn(a, b, c, 0.5, 3), second); });
    std::tuple<Tensor, Tensor, Tensor> outs;
    auto got = grads_of(*lin, {a, b, c}, [&] {
      outs = accel::checkpoint(fn, a, b, c, 0.5, int64_t{3});
      return loss_of(outs, second);
    });
    require_identical(plain, got);
    CHECK_FALSE(c.grad().defined());
    CHECK(std::get<2>(outs).scalar_type() == torch::kLong);
    CHECK_FALSE(std::get<2>(outs).requires_grad());
  }
  SECTION("a std::vector of outputs") {
    auto vec_fn = [&](const Tensor& p, const Tensor& q) {
      return std::vector<Tensor>{lin(p).relu(), p * q};
    };
    auto plain = grads_of(*lin, {a, b}, [&] {
      auto o = vec_fn(a, b);
      return o[0].sum() + o[1].pow(2).sum();
    });
    auto got = grads_of(*lin, {a, b}, [&] {
      auto o = accel::checkpoint(vec_fn, a, b);
      REQUIRE(o.size() == 2);
      return o[0].sum() + o[1].pow(2).sum();
    });
    require_identical(plain, got);
  }
}

TEST_CASE("checkpoint: nested checkpoints", "[memory][checkpoint]") {
  auto mlp = make_mlp();
  auto x = torch::randn({8, 16}).requires_grad_(true);
  // Children [from, to) of the MLP, each under a checkpoint of its own.
  auto part = [&mlp](std::size_t from, std::size_t to) {
    return [&mlp, from, to](const Tensor& in) {
      auto h = in;
      for (std::size_t i = from; i < to; ++i)
        h = accel::checkpoint([m = *(mlp->begin() + static_cast<std::ptrdiff_t>(i))](
                                  const Tensor& t) mutable { return m.forward(t); },
                              h);
      return h;
    };
  };
  auto plain = grads_of(*mlp, {x}, [&] { return mlp->forward(x).sum(); });
  // Three levels: the whole model, its two halves, each child.
  auto got = grads_of(*mlp, {x}, [&] {
    auto whole = [&](const Tensor& in) { return accel::checkpoint(part(3, 7), accel::checkpoint(part(0, 3), in)); };
    return accel::checkpoint(whole, x).sum();
  });
  require_identical(plain, got);
}

TEST_CASE("checkpoint: without gradients it only runs the function", "[memory][checkpoint]") {
  auto mlp = make_mlp();
  mlp->eval();
  auto x = torch::randn({8, 16});
  torch::NoGradGuard no_grad;
  auto out = accel::checkpoint_sequential(mlp, x);
  CHECK_FALSE(out.requires_grad());
  CHECK(torch::equal(out, mlp->forward(x)));
}

TEST_CASE("checkpoint: an undefined tensor argument is an error", "[memory][checkpoint][errors]") {
  auto x = torch::randn({2});
  CHECK_THROWS_WITH(accel::checkpoint([](const Tensor& a, const Tensor&) { return a * 2; }, x, Tensor()),
                    Catch::Matchers::ContainsSubstring("accel: checkpoint() got an undefined tensor argument"));
}

TEST_CASE("checkpoint: 24 layers keep at least 3x less activation memory", "[memory][checkpoint][peak]") {
  constexpr int64_t kLayers = 24, kWidth = 64, kBatch = 256;
  torch::manual_seed(4);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < kLayers; ++i) net->push_back(Residual(kWidth));
  auto x = torch::randn({kBatch, kWidth});

  struct Use {
    int64_t kept;  ///< bytes alive after forward, held for backward
    int64_t peak;  ///< most bytes alive during forward
    Tensor grad;   ///< of the first layer's weight
  };
  auto measure = [&](bool checkpointed) {
    net->zero_grad();
    Use u{};
    {
      CountingAllocator counter;
      REQUIRE(counter.installed());
      const int64_t before = counter.live();
      counter.reset();
      auto out = checkpointed ? accel::checkpoint_sequential(net, x) : net->forward(x);
      u.kept = counter.live() - before;
      u.peak = counter.peak() - before;
      out.pow(2).mean().backward();
    }
    u.grad = net->parameters()[0].grad().clone();
    return u;
  };
  auto plain = measure(false);
  auto ckpt = measure(true);
  const int64_t per_activation = kBatch * kWidth * 4;
  INFO("kept after forward: " << plain.kept << " B without checkpointing, " << ckpt.kept
       << " B with; peak during forward: " << plain.peak << " B, " << ckpt.peak << " B");
  // Without: fc1's and GELU's outputs (4x the width each) and the residual
  // sum per layer, 9 activations; with: each layer's input and the output.
  CHECK(plain.kept >= 9 * kLayers * per_activation);
  // (plus each checkpoint's copy of the CPU generator's state, 5 KB)
  CHECK(ckpt.kept <= (kLayers + 1) * per_activation + kLayers * 8192);
  CHECK(plain.kept >= 3 * ckpt.kept);
  CHECK(plain.peak >= 3 * ckpt.peak);
  CHECK(torch::equal(plain.grad, ckpt.grad));
}
