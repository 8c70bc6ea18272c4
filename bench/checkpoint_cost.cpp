// Cost of save_state()/load_state() for a ~100M-parameter model with Adam
// (model 403 MB + optimizer state 806 MB in float32), one process, against a
// plain copy of the same bytes (read each file of the checkpoint, write it to
// a new file, fsync: what any checkpoint must at least do).
//
//   build-bench/bench/checkpoint_cost [dir=/tmp/accel_checkpoint_cost] [rounds=3] [hidden=4096] [layers=6]
//
// Each round: save_state(dir/ckpt) (atomic: staged, fsynced, renamed), then a
// fresh Accelerator + model + optimizer load_state(dir/ckpt), then the plain
// copy of dir/ckpt to dir/copy. Seconds: min and median over rounds; MB/s =
// checkpoint bytes / seconds. The files are in the page cache when loaded and
// copied (just written), as they are when a job resumes on the same machine
// right away; save includes fsync, so it pays the disk.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

torch::nn::Sequential make_model(int64_t hidden, int layers) {
  torch::manual_seed(1);
  torch::nn::Sequential m;
  for (int i = 0; i < layers; ++i) {
    m->push_back(torch::nn::Linear(hidden, hidden));
    if (i + 1 < layers) m->push_back(torch::nn::ReLU());
  }
  return m;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t dir_bytes(const fs::path& d) {
  uint64_t n = 0;
  for (auto& e : fs::recursive_directory_iterator(d))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

/// read + write + fsync of every file, 8 MiB at a time.
void plain_copy(const fs::path& from, const fs::path& to) {
  fs::remove_all(to);
  fs::create_directories(to);
  std::vector<char> buf(8 << 20);
  for (auto& e : fs::directory_iterator(from)) {
    if (!e.is_regular_file()) continue;
    int in = ::open(e.path().c_str(), O_RDONLY);
    int out = ::open((to / e.path().filename()).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (in < 0 || out < 0) throw std::runtime_error("plain_copy: cannot open " + e.path().string());
    for (ssize_t n; (n = ::read(in, buf.data(), buf.size())) > 0;)
      for (ssize_t w = 0; w < n;) {
        ssize_t k = ::write(out, buf.data() + w, static_cast<size_t>(n - w));
        if (k <= 0) throw std::runtime_error("plain_copy: write failed");
        w += k;
      }
    ::fsync(out);
    ::close(in);
    ::close(out);
  }
  int d = ::open(to.c_str(), O_RDONLY | O_DIRECTORY);
  ::fsync(d);
  ::close(d);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Trained {
  std::unique_ptr<accel::Accelerator<>> acc;
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Adam> adam;
};

/// A prepared model and Adam with state (one step taken).
Trained make_trained(int64_t hidden, int layers) {
  Trained t;
  t.acc = std::make_unique<accel::Accelerator<>>();
  t.model = make_model(hidden, layers);
  t.adam = std::make_unique<torch::optim::Adam>(t.model->parameters(), torch::optim::AdamOptions(1e-4));
  auto [m, opt] = t.acc->prepare(t.model, *t.adam);
  opt.zero_grad();
  t.acc->backward(m(torch::randn({4, hidden})).pow(2).mean());
  opt.step();
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const fs::path dir = argc > 1 ? argv[1] : "/tmp/accel_checkpoint_cost";
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const int64_t hidden = argc > 3 ? std::atoll(argv[3]) : 4096;
  const int layers = argc > 4 ? std::atoi(argv[4]) : 6;
  at::set_num_threads(1);
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path ckpt = dir / "ckpt", copy = dir / "copy";

  auto saver = make_trained(hidden, layers);
  int64_t params = 0;
  for (auto& p : saver.model->parameters()) params += p.numel();

  std::vector<double> save_s, load_s, copy_s;
  uint64_t bytes = 0;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    saver.acc->save_state(ckpt);
    save_s.push_back(seconds_since(t0));
    bytes = dir_bytes(ckpt);

    auto loader = make_trained(hidden, layers);
    t0 = Clock::now();
    loader.acc->load_state(ckpt);
    load_s.push_back(seconds_since(t0));
    // The load really happened: parameters equal the saved ones.
    auto a = saver.model->parameters(), b = loader.model->parameters();
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!torch::equal(a[i], b[i])) {
        std::fprintf(stderr, "checkpoint_cost: parameter %zu differs after load_state\n", i);
        return 1;
      }

    t0 = Clock::now();
    plain_copy(ckpt, copy);
    copy_s.push_back(seconds_since(t0));
  }
  const double mb = static_cast<double>(bytes) / 1e6;
  std::printf("%lld parameters (%d x Linear(%lld, %lld)), Adam; checkpoint %.1f MB in %zu files; %d rounds\n",
              static_cast<long long>(params), layers, static_cast<long long>(hidden),
              static_cast<long long>(hidden), mb,
              static_cast<std::size_t>(std::distance(fs::directory_iterator(ckpt), fs::directory_iterator())),
              rounds);
  std::printf("| operation | s (min) | s (median) | MB/s (median) | median / plain copy |\n|---|---|---|---|---|\n");
  const double c = median(copy_s);
  auto row = [&](const char* name, const std::vector<double>& s) {
    std::printf("| %s | %.3f | %.3f | %.0f | %.2fx |\n", name, *std::min_element(s.begin(), s.end()),
                median(s), mb / median(s), median(s) / c);
  };
  row("save_state", save_s);
  row("load_state", load_s);
  row("plain copy (read + write + fsync)", copy_s);
  fs::remove_all(dir);
  return 0;
}
