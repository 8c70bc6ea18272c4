// The checks that need a CUDA device (issue 20), run by tests/gpu/run.sh on the
// GPU machine: backend::Nccl at world size 1 and with 2 processes sharing the
// one GPU, prepare() placing everything on CUDA, Bf16 and Fp16 autocast inside
// the prepared model, the loss scaler on a real float16 overflow, backend::Gloo
// with CUDA tensors, and notebook_launcher refusing to fork after CUDA was
// initialised. On a CPU machine it is only compiled (ctest gpu.compile): a
// check that cannot run is not reported as passed.
//
// Multi-process cases re-execute this program (posix_spawn) with
// ACCEL_GPU_CHILD=<case> and the rank variables set, so that no process forks
// after CUDA was initialised.
#include <accel/accel.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#if ACCEL_TEST_CATCH2_V3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#endif
#include "catch.hpp"

extern char** environ;

namespace {

/// A Linear whose forward records the dtype of its matmul: what autocast made of it.
struct RecordingNetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::ScalarType inner = at::kFloat;
  RecordingNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1->forward(x);
    inner = h.scalar_type();
    return fc2->forward(torch::relu(h));
  }
};
TORCH_MODULE(RecordingNet);

std::string free_port() { return std::to_string(accel::detail::launch::pick_free_port()); }

void set_world(int rank, int size, const std::string& port) {
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(size).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
}

/// Runs this program again as `size` processes of case `name`; returns each exit status.
std::vector<int> run_children(const std::string& name, int size, const std::string& log_prefix) {
  const auto port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> env_strings = {"ACCEL_GPU_CHILD=" + name, "RANK=" + std::to_string(r),
                                            "LOCAL_RANK=" + std::to_string(r),
                                            "WORLD_SIZE=" + std::to_string(size),
                                            "LOCAL_WORLD_SIZE=" + std::to_string(size),
                                            "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port};
    for (char** e = environ; *e; ++e) {
      std::string s(*e);
      if (s.rfind("RANK=", 0) && s.rfind("LOCAL_RANK=", 0) && s.rfind("WORLD_SIZE=", 0) &&
          s.rfind("LOCAL_WORLD_SIZE=", 0) && s.rfind("MASTER_", 0) && s.rfind("ACCEL_GPU_CHILD=", 0))
        env_strings.push_back(s);
    }
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string self = "/proc/self/exe";
    std::string log = log_prefix + "_rank" + std::to_string(r) + ".log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    char* argv[] = {self.data(), nullptr};
    pid_t pid = 0;
    REQUIRE(posix_spawn(&pid, self.c_str(), &actions, nullptr, argv, envp.data()) == 0);
    posix_spawn_file_actions_destroy(&actions);
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (auto pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  for (int r = 0; r < size; ++r) {
    std::ifstream in(log_prefix + "_rank" + std::to_string(r) + ".log");
    std::string text((std::istreambuf_iterator<char>(in)), {});
    UNSCOPED_INFO("rank " << r << " (exit " << codes[static_cast<size_t>(r)] << "):\n" << text);
  }
  return codes;
}

std::string out_dir() {
  const char* out = std::getenv("OUT");
  return out ? out : "/tmp";
}

/// One data-parallel step of a small model on NCCL; every rank checks that
/// its replica equals the one-process step on the global batch (within
/// `tolerance`: 1e-5 uncompressed; the 16-bit hooks round each averaged
/// gradient to 11 or 8 significant bits, NCCL summing float16 / bfloat16).
int nccl_child(accel::CommHook hook = accel::CommHook::None, double tolerance = 1e-5) {
  accel::AcceleratorOptions options;
  options.comm_hook = hook;
  accel::Accelerator<accel::backend::Nccl> acc(options);
  const int rank = acc.process_index(), size = acc.num_processes();
  torch::manual_seed(5);
  torch::nn::Linear ref(8, 2), net(8, 2);
  net->weight.data().copy_(ref->weight.data());
  net->bias.data().copy_(ref->bias.data());
  auto x = torch::randn({4 * size, 8}), y = torch::randn({4 * size, 2});
  torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(net->parameters(), 0.1);
  torch::mse_loss(ref->forward(x), y).backward();
  ref_opt.step();
  auto [m, o] = acc.prepare(net, opt);
  if (!m->weight.is_cuda()) return 10;
  auto xs = x.narrow(0, 4 * rank, 4).to(acc.device()), ys = y.narrow(0, 4 * rank, 4).to(acc.device());
  o.zero_grad();
  acc.backward(torch::mse_loss(m(xs), ys));
  o.step();
  auto diff = (m->weight.cpu() - ref->weight).abs().max().item<double>();
  std::cout << "rank " << rank << " of " << size << ": max |w - reference| = " << diff << std::endl;
  return diff < tolerance ? 0 : 11;
}

}  // namespace

TEST_CASE("a CUDA device is visible", "[gpu]") {
  REQUIRE(torch::cuda::is_available());
  REQUIRE(torch::cuda::device_count() >= 1);
}

TEST_CASE("backend::Nccl at world size 1: prepare() places everything on CUDA", "[gpu][nccl]") {
  REQUIRE(run_children("nccl", 1, out_dir() + "/nccl_world1") == std::vector<int>{0});
}

TEST_CASE("backend::Nccl with 2 processes on the one GPU", "[gpu][nccl][.shared]") {
  // NCCL may refuse two ranks on one device ("Duplicate GPU detected"); the
  // logs say which, and run.sh reports this case separately.
  CHECK(run_children("nccl", 2, out_dir() + "/nccl_world2") == std::vector<int>{0, 0});
  // Communication hooks on NCCL, which sums 16-bit floats natively.
  CHECK(run_children("nccl_fp16", 2, out_dir() + "/nccl_fp16") == std::vector<int>{0, 0});
  CHECK(run_children("nccl_bf16", 2, out_dir() + "/nccl_bf16") == std::vector<int>{0, 0});
}

TEST_CASE("SingleDevice prepares model, optimizer state and batches on CUDA", "[gpu]") {
  accel::Accelerator<> acc;
  REQUIRE(acc.device().is_cuda());
  torch::nn::Linear net(8, 2);
  torch::optim::Adam adam(net->parameters());
  auto [m, o] = acc.prepare(net, adam);
  CHECK(m->weight.is_cuda());
  o.zero_grad();
  acc.backward(m(torch::randn({4, 8}, acc.device())).sum());
  o.step();
  for (auto& [key, state] : adam.state()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*state);
    CHECK(s.exp_avg().is_cuda());
  }
}

TEST_CASE("Bf16 and Fp16 autocast: the matmul inside the prepared model runs in lower precision", "[gpu]") {
  auto inner_dtype = [](auto acc_tag) {
    using Acc = typename decltype(acc_tag)::type;
    Acc acc;
    RecordingNet net;
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [m, o] = acc.prepare(net, sgd);
    auto out = m(torch::randn({4, 16}, acc.device()));
    (void)out;
    return net->inner;
  };
  CHECK(inner_dtype(std::type_identity<accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16>>{}) ==
        at::kBFloat16);
  CHECK(inner_dtype(std::type_identity<accel::Accelerator<accel::backend::SingleDevice, accel::precision::Fp16>>{}) ==
        at::kHalf);
  // Without a prepared model no autocast is on: the reference is float32.
  RecordingNet plain;
  plain->to(torch::kCUDA);
  plain->forward(torch::randn({4, 16}, torch::kCUDA));
  CHECK(plain->inner == at::kFloat);
}

TEST_CASE("Fp16: a real float16 overflow skips the step and halves the scale", "[gpu][fp16]") {
  accel::AcceleratorOptions opts;
  opts.grad_scaler.init_scale = 65536;
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Fp16> acc(opts);
  torch::nn::Linear net(16, 16);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [m, o] = acc.prepare(net, sgd);
  auto before = m->weight.detach().clone();
  // 60000 is finite in float16 (max 65504); its square in the loss, times the
  // scale, overflows the float16 gradients of the autocast matmul.
  auto x = torch::full({4, 16}, 60000.0, acc.device());
  o.zero_grad();
  acc.backward(m(x).pow(2).mean());
  o.step();
  CHECK(acc.optimizer_step_was_skipped());
  CHECK(acc.loss_scaler()->scale() == 32768);
  CHECK(torch::equal(m->weight.detach(), before));
  // A normal batch then steps.
  o.zero_grad();
  acc.backward(m(torch::randn({4, 16}, acc.device())).pow(2).mean());
  o.step();
  CHECK_FALSE(acc.optimizer_step_was_skipped());
  CHECK_FALSE(torch::equal(m->weight.detach(), before));
}

TEST_CASE("backend::Gloo all-reduces CUDA tensors", "[gpu][gloo]") {
  set_world(0, 1, free_port());
  accel::AcceleratorOptions opts;
  opts.file_store = out_dir() + "/gloo_cuda_store";
  std::filesystem::remove(*opts.file_store);
  accel::Accelerator<accel::backend::Gloo> acc(opts);
  auto t = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  acc.communicator().all_reduce(t)->wait();
  CHECK(t.is_cuda());
  CHECK(torch::equal(t.cpu(), torch::arange(6).to(torch::kFloat)));
  auto g = acc.gather(t);
  CHECK(g.is_cuda());
}

TEST_CASE("notebook_launcher refuses to fork after CUDA was initialised", "[gpu][launch]") {
  auto touch = torch::ones({1}, torch::kCUDA);
  (void)touch;
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  try {
    accel::notebook_launcher([] {}, std::tuple<>{}, lo);
    FAIL("notebook_launcher forked after CUDA was initialised");
  } catch (const accel::Error& e) {
    CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring("CUDA has already been initialised in this process"));
    CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring("create them inside the launched function"));
  }
}

int main(int argc, char** argv) {
  if (const char* child = std::getenv("ACCEL_GPU_CHILD")) {
    try {
      if (std::string(child) == "nccl") return nccl_child();
      if (std::string(child) == "nccl_fp16") return nccl_child(accel::CommHook::Fp16, 1e-4);
      if (std::string(child) == "nccl_bf16") return nccl_child(accel::CommHook::Bf16, 1e-3);
      std::cerr << "unknown ACCEL_GPU_CHILD " << child << "\n";
      return 2;
    } catch (const std::exception& e) {
      std::cerr << "rank " << std::getenv("RANK") << ": " << e.what() << std::endl;
      return 3;
    }
  }
  return Catch::Session().run(argc, argv);
}
