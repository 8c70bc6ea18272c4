// 030 — notebook_launcher: a training function started from inside a running
// program (as in a notebook cell), with its arguments in a tuple. First on 2
// processes of this machine; then the multi-node form of the same call: two
// launchers with num_nodes = 2, node_rank 0 and 1, the same master_addr and
// master_port, form one world of 4 processes. Here both "nodes" are this
// machine (node 1's launcher runs in a forked child); on two machines, each
// runs the same call with its own node_rank and master_addr = node 0's address.
// Run: ./build/examples/030-notebook-launcher
// Expected output (the accuracy may be 0.99... on another machine):
//   one node: rank 0 of 2, 1024 predictions, accuracy 1
//   two nodes: rank 0 of 4, 1024 predictions, accuracy 1
//   both launches reached accuracy > 0.9
// Exit status 0 when every launch trained every rank to accuracy > 0.9.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <iostream>
#include <stdexcept>
#include <string>
#include <tuple>

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

/// The function every process runs: an ordinary accel training loop.
void train(int epochs, double lr, int expected_world, std::string label) {
  accel::Accelerator<accel::backend::Gloo> accelerator;
  if (accelerator.num_processes() != expected_world)
    throw std::runtime_error("expected a world of " + std::to_string(expected_world) + ", got " +
                             std::to_string(accelerator.num_processes()));
  accel::set_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(lr));
  auto loader = accel::data::make_data_loader(Blobs(), {.batch_size = 16, .shuffle = true});
  auto eval_loader = accel::data::make_data_loader(Blobs(), {.batch_size = 100});
  auto [m, opt, dl, eval_dl] = accelerator.prepare(model, optimizer, loader, eval_loader);

  for (int epoch = 0; epoch < epochs; ++epoch) {
    for (auto& batch : dl) {
      opt.zero_grad();
      accelerator.backward(torch::cross_entropy_loss(m(batch.data), batch.target));
      opt.step();
    }
  }
  int64_t correct = 0, seen = 0;
  for (auto& batch : eval_dl) {
    torch::NoGradGuard no_grad;
    auto predictions = accelerator.gather_for_metrics(m(batch.data).argmax(1));
    auto targets = accelerator.gather_for_metrics(batch.target);
    correct += predictions.eq(targets).sum().item<int64_t>();
    seen += predictions.size(0);
  }
  const double accuracy = static_cast<double>(correct) / static_cast<double>(seen);
  accelerator.print(label, ": rank ", accelerator.process_index(), " of ",
                    accelerator.num_processes(), ", ", seen, " predictions, accuracy ", accuracy);
  if (seen != 1024 || accuracy <= 0.9)
    throw std::runtime_error("rank " + std::to_string(accelerator.process_index()) + ": accuracy " +
                             std::to_string(accuracy) + " over " + std::to_string(seen) + " predictions");
}

/// A port nobody listens on now (the multi-node form needs one fixed port that
/// every node knows; a real cluster simply agrees on one).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error("cannot find a free port");
  ::close(fd);
  return ntohs(addr.sin_port);
}

int main() {
  using namespace std::chrono_literals;
  try {
    // One node, 2 processes: the arguments travel as a tuple.
    accel::notebook_launcher(train, std::make_tuple(20, 1e-2, 2, std::string("one node")),
                             {.num_processes = 2, .master_port = 0, .timeout = 120s});

    // Two nodes of 2 processes each: the same call on every node, only node_rank differs.
    accel::LaunchOptions node{.num_processes = 2, .num_nodes = 2, .node_rank = 0,
                              .master_addr = "127.0.0.1", .master_port = free_port(), .timeout = 120s};
    auto args = std::make_tuple(20, 1e-2, 4, std::string("two nodes"));
    std::cout.flush();
    const pid_t node1 = ::fork();
    if (node1 == 0) {  // "machine 1"
      int status = 0;
      try {
        node.node_rank = 1;
        accel::notebook_launcher(train, args, node);
      } catch (const std::exception& e) {
        std::cerr << "node 1: " << e.what() << std::endl;
        status = 1;
      }
      std::cout.flush();
      ::_exit(status);
    }
    try {
      accel::notebook_launcher(train, args, node);  // "machine 0"
    } catch (...) {
      ::kill(node1, SIGTERM);  // its launcher stops its workers
      ::waitpid(node1, nullptr, 0);
      throw;
    }
    int status = 0;
    if (::waitpid(node1, &status, 0) != node1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
      throw std::runtime_error("node 1's launcher failed");
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  std::cout << "both launches reached accuracy > 0.9" << std::endl;
  return 0;
}
