// 080 — profiling a 2-process run that uses activation checkpointing: each
// rank trains a deep residual MLP whose blocks run under
// accel::checkpoint_sequential, inside Accelerator::profile(); rank 0 merges
// the ranks' Chrome traces into one (open it in chrome://tracing or
// ui.perfetto.dev) and the program prints where the ranks waited for
// gradient communication.
// Run: ./build/examples/080-profile-and-checkpoint [work_dir]
// Expected output (the times differ on another machine):
//   replicas equal after 10 steps: yes
//   trace: /tmp/accel-080/trace.json (2 ranks, 5213 events, 60 bucket reductions)
//   top communication waits:
//     rank 1  optimizer.step waits for gradients       2.41 ms
//     rank 1    wait for bucket 0                      2.40 ms
//     ...
//   time in optimizer.step waiting for gradients: rank 0 9.80 ms, rank 1 12.30 ms (10 steps)
// Exit status 0 when the trace is valid (every event has the Chrome trace
// fields, every bucket span begins and ends, events of both ranks) and the
// replicas ended equal.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

// x + fc2(dropout(gelu(fc1(x)))): keeps 8x its input for backward, unless checkpointed.
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
  NetImpl() {
    for (int i = 0; i < 8; ++i) blocks->push_back(Block(64));
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(64, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(accel::checkpoint_sequential(blocks, x)); }
};
TORCH_MODULE(Net);

struct Data : torch::data::datasets::Dataset<Data> {
  torch::Tensor x = torch::randn({640, 64}, at::detail::createCPUGenerator(5));
  torch::Tensor y = x.narrow(1, 0, 8).sum(1, true).tanh();
  torch::data::Example<> get(size_t i) override { return {x[i], y[i]}; }
  torch::optional<size_t> size() const override { return 640; }
};

void train(std::string dir) {
  // 256 kB buckets: several reductions per step, so the trace shows their overlap.
  accel::Accelerator<accel::backend::Gloo> acc(accel::AcceleratorOptions{.bucket_cap_mb = 0.25});
  accel::set_seed(0);
  Net model;
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto loader = accel::data::make_data_loader(Data(), {.batch_size = 32, .shuffle = true});
  auto [m, opt, dl] = acc.prepare(model, adamw, loader);
  {
    auto trace = acc.profile(dir);
    int steps = 0;
    for (auto& batch : dl) {
      opt.zero_grad();
      acc.backward(torch::mse_loss(m(batch.data), batch.target));
      opt.step();
      if (++steps == 10) break;
    }
  }
  // Replicas stay equal: the buckets were reduced once per step although
  // backward ran every block's forward a second time.
  auto flat = torch::cat([&] {
    std::vector<torch::Tensor> ps;
    for (const auto& p : model->parameters()) ps.push_back(p.detach().reshape(-1));
    return ps;
  }());
  // The sum of equal values is exactly num_processes times each.
  if (!acc.reduce(flat).equal(flat * acc.num_processes()))
    throw std::runtime_error("the replicas differ after training");
  acc.wait_for_everyone();
  if (acc.is_main_process()) accel::profiling::merge_traces(dir, acc.num_processes());
}

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const fs::path dir = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "accel-080";
  fs::remove_all(dir);
  try {
    accel::notebook_launcher(train, std::make_tuple(dir.string()), {.num_processes = 2, .master_port = 0});
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  std::cout << "replicas equal after 10 steps: yes\n";

  std::ifstream in(dir / "trace.json");
  const auto events = nlohmann::json::parse(in)["traceEvents"];  // throws on invalid JSON
  std::set<int> ranks;
  std::map<std::tuple<int, std::string, int64_t>, int> spans;  // +1 at "b", -1 at "e"
  struct Wait {
    double ms;
    int rank;
    std::string what;
  };
  std::vector<Wait> waits;
  std::map<int, double> waited_ms;
  int reductions = 0;
  for (const auto& e : events) {
    for (const char* field : {"name", "ph", "pid", "tid"})
      if (!e.contains(field)) {
        std::cerr << "trace event without \"" << field << "\": " << e.dump() << "\n";
        return 1;
      }
    const int rank = e["pid"].get<int>();
    ranks.insert(rank);
    const auto ph = e["ph"].get<std::string>();
    const auto name = e["name"].get<std::string>();
    if (ph == "b" || ph == "e") {
      spans[{rank, e["cat"].get<std::string>(), e["id"].get<int64_t>()}] += ph == "b" ? 1 : -1;
      reductions += ph == "b";
    }
    if (ph != "X") continue;
    const double ms = e["dur"].get<double>() / 1000.0;
    if (name == "accel: optimizer.step waits for gradients") {
      waited_ms[rank] += ms;
      waits.push_back({ms, rank, "optimizer.step waits for gradients"});
    } else if (name == "accel: wait for bucket reduction") {
      waits.push_back({ms, rank, "  wait for bucket " + std::to_string(e["args"]["bucket"].get<int>())});
    }
  }
  for (const auto& [key, open] : spans)
    if (open != 0) {
      std::cerr << "bucket span " << std::get<2>(key) << " of rank " << std::get<0>(key)
                << " does not begin and end once\n";
      return 1;
    }
  if (ranks != std::set<int>{0, 1} || reductions == 0 || waits.empty()) {
    std::cerr << "the trace lacks events of both ranks or any communication event\n";
    return 1;
  }
  std::cout << "trace: " << (dir / "trace.json").string() << " (" << ranks.size() << " ranks, "
            << events.size() << " events, " << reductions << " bucket reductions)\n";
  std::sort(waits.begin(), waits.end(), [](const Wait& a, const Wait& b) { return a.ms > b.ms; });
  std::cout << "top communication waits:\n" << std::fixed << std::setprecision(2);
  for (std::size_t i = 0; i < std::min<std::size_t>(5, waits.size()); ++i)
    std::cout << "  rank " << waits[i].rank << "  " << std::left << std::setw(36) << waits[i].what
              << std::right << std::setw(8) << waits[i].ms << " ms\n";
  std::cout << "time in optimizer.step waiting for gradients: rank 0 " << waited_ms[0] << " ms, rank 1 "
            << waited_ms[1] << " ms (10 steps)\n";
  return 0;
}
