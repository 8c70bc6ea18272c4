// SPDX-License-Identifier: Apache-2.0
/// @file Defines what any accel launcher decides before starting workers: the
/// option checks, each worker's rank variables, its thread count, free ports,
/// the CUDA-before-fork check and the ACCEL_DEBUG_MODE worker check. Free of
/// LibTorch so that the `accel` command can use it too.
#ifndef ACCEL_LAUNCH_DETAIL_RANK_ENV_HPP
#define ACCEL_LAUNCH_DETAIL_RANK_ENV_HPP

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>

#include <accel/errors.hpp>
#include <accel/launch/detail/posix.hpp>
#include <accel/launch/launch_options.hpp>
#include <accel/runtime/detail/tcp_probe.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::detail::launch {

/// More processes on one machine than this is a typo (num_processes: 100000),
/// not a plan: 4 per core, at least 8; ACCEL_MAX_LOCAL_PROCESSES raises it.
inline int max_local_processes() {
  if (const auto n = positive_env_int("ACCEL_MAX_LOCAL_PROCESSES")) return *n;
  return std::max(8, 4 * available_cores());
}

inline void check_local_process_count(int n) {
  const int limit = max_local_processes();
  ACCEL_CHECK(n <= limit, "accel: ", n, " processes on this machine is more than ", limit,
              " (4 per CPU core, ", available_cores(), " cores): each would get a sliver of a "
              "core and its own copy of the model. Launch fewer, or set "
              "ACCEL_MAX_LOCAL_PROCESSES=", n, " if you mean it.");
}

/// Throws accel::Error when the options cannot describe a launch.
inline void validate(const LaunchOptions& o) {
  ACCEL_CHECK(o.num_processes >= 1, "accel: num_processes is ", o.num_processes,
              ". Launch at least 1 process.");
  check_local_process_count(o.num_processes);
  ACCEL_CHECK(o.num_nodes >= 1, "accel: num_nodes is ", o.num_nodes, ". Use at least 1 node.");
  ACCEL_CHECK(o.node_rank >= 0 && o.node_rank < o.num_nodes, "accel: node_rank ", o.node_rank,
              " is outside 0..", o.num_nodes - 1, " (num_nodes = ", o.num_nodes,
              "). Give every node a distinct node_rank below num_nodes.");
  ACCEL_CHECK(o.master_port >= 0 && o.master_port <= 65535, "accel: master_port ", o.master_port,
              " is not a TCP port. Use 1..65535, or 0 to pick a free port.");
  ACCEL_CHECK(o.master_port != 0 || o.num_nodes == 1 || o.rendezvous_file, "accel: master_port 0 "
              "(pick a free port) with num_nodes = ", o.num_nodes, " needs a rendezvous_file "
              "through which node 0 tells the others the port. Pass the same fixed master_port on "
              "every node, or the same rendezvous_file on a filesystem all nodes share.");
  ACCEL_CHECK(!o.master_addr.empty(), "accel: master_addr is empty. Give the host name or IP "
              "address of node 0 (\"127.0.0.1\" on one machine).");
  ACCEL_CHECK(o.timeout.count() > 0, "accel: the launch timeout is ", o.timeout.count(),
              " s. Give a positive timeout.");
  ACCEL_CHECK(o.max_restarts >= 0, "accel: max_restarts is ", o.max_restarts,
              ". Give 0 (a failure ends the launch) or the number of restarts allowed.");
  ACCEL_CHECK(!o.monitor_interval || o.monitor_interval->count() > 0,
              "accel: monitor_interval is ", o.monitor_interval ? o.monitor_interval->count() : 0,
              " s. Give a positive number of seconds, or leave it unset (no hang detection).");
  if (o.mixed_precision) {
    const auto& m = *o.mixed_precision;
    ACCEL_CHECK(m == "no" || m == "fp16" || m == "bf16", "accel: mixed_precision '", m,
                "' is unknown. Use \"no\", \"fp16\" or \"bf16\".");
  }
}

/// The torchrun-style variables of the worker `local_rank` on this node.
/// RANK = node_rank * num_processes + local_rank; WORLD_SIZE = num_nodes * num_processes.
/// job_id (ACCEL_JOB_ID): shared by the workers of one launch, so that a
/// worker reaching another job's store leaves (runtime/store.hpp).
/// restart: the attempt (TORCHELASTIC_RESTART_COUNT, 0 first), as torchrun sets
/// it together with TORCHELASTIC_MAX_RESTARTS.
inline EnvList rank_environment(const LaunchOptions& o, int local_rank, const std::string& job_id = {},
                                int restart = 0) {
  EnvList env{
      {"RANK", std::to_string(o.node_rank * o.num_processes + local_rank)},
      {"WORLD_SIZE", std::to_string(o.num_nodes * o.num_processes)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.num_processes)},
      {"NODE_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
  };
  if (o.mixed_precision) env.emplace_back("ACCEL_MIXED_PRECISION", *o.mixed_precision);
  if (!job_id.empty()) env.emplace_back("ACCEL_JOB_ID", job_id);
  return env;
}

/// A fresh random id for the workers of one launch (ACCEL_JOB_ID).
inline std::string random_job_id() {
  std::random_device rd;
  const auto v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id(16, '0');
  for (int i = 0; i < 16; ++i) id[static_cast<std::size_t>(i)] = kDigits[(v >> (4 * i)) & 0xF];
  return id;
}

/// The job id of a launch whose workers all start here (one node); a launch
/// over several nodes without restarts has none, as each node's launcher would
/// draw its own (with restarts machine 0's agent draws it for all).
inline std::string new_job_id(const LaunchOptions& o) { return o.num_nodes == 1 ? random_job_id() : ""; }

/// Intra-op threads per worker: OMP_NUM_THREADS when set to a positive number
/// (the user's choice wins), else max(1, cores / local workers).
inline int threads_per_worker(int local_workers, int cores = available_cores()) {
  if (auto n = positive_env_int("OMP_NUM_THREADS")) return *n;
  return std::max(1, cores / std::max(1, local_workers));
}

/// Resolves host to an IPv4 address (the rendezvous store listens on IPv4).
inline sockaddr_in resolve_ipv4(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  ACCEL_CHECK(rc == 0 && res != nullptr, "accel: cannot resolve master_addr '", host, "' (",
              ::gai_strerror(rc), "). Give an IP address or a host name this machine can resolve.");
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

/// --debug's check of another machine's rendezvous address: resolves it and
/// tries one TCP connection. A refusal passes (machine 0's launch may simply
/// not have started yet); no route, or no answer within `timeout` (a firewall,
/// the wrong address), is an accel::Error saying so.
inline void check_reachable(const std::string& host, int port, std::chrono::milliseconds timeout) {
  (void)resolve_ipv4(host, port);  // a clear error when it does not resolve
  const int err = runtime::detail::try_connect(host, port, timeout);
  if (err == 0 || err == ECONNREFUSED) return;
  throw Error(concat("accel: debug launch: the rendezvous address ", host, ":", port,
                     " cannot be reached from this machine (",
                     err == ETIMEDOUT ? "no answer within " + std::to_string(timeout.count() / 1000) + " s"
                                      : std::string(std::strerror(err)),
                     "). Check --main_process_ip (MASTER_ADDR) and that no firewall sits between "
                     "the machines."));
}

/// True when /proc/self/maps text shows the CUDA driver (libcuda.so) loaded:
/// the CUDA runtime loads it on its first call, and a forked child can then no
/// longer use CUDA. Reading the maps never initialises CUDA itself, which no
/// LibTorch 1.13/2.x C++ query guarantees (device_count() calls cuInit).
inline bool cuda_driver_loaded(std::string_view maps) {
  for (std::size_t pos = 0; (pos = maps.find("libcuda.so", pos)) != std::string_view::npos; ++pos)
    if (pos == 0 || maps[pos - 1] == '/') return true;
  return false;
}

inline bool cuda_driver_loaded_in_this_process() {
  std::ifstream in("/proc/self/maps");
  std::stringstream ss;
  ss << in.rdbuf();
  return cuda_driver_loaded(ss.str());
}

/// Accelerate's most reported notebook failure, refused before forking.
inline void refuse_fork_after_cuda() {
  ACCEL_CHECK(!cuda_driver_loaded_in_this_process(),
              "accel: CUDA has already been initialised in this process, and forked workers "
              "cannot use it (\"Cannot re-initialize CUDA in forked subprocess\"). Do not touch "
              "CUDA (tensors, models or devices on the GPU, torch::cuda calls) before "
              "notebook_launcher: create them inside the launched function.");
}

/// ACCEL_DEBUG_MODE worker check: the variables this worker sees are the ones
/// the launcher meant to give it, and form a consistent world.
inline void check_worker_environment(const LaunchOptions& o, int local_rank) {
  const auto env = runtime::ProcessEnv::discover();
  const int rank = o.node_rank * o.num_processes + local_rank;
  ACCEL_CHECK(env.source == "torchrun", "accel: debug launch: worker ", rank,
              " found no RANK/WORLD_SIZE variables (source: ", env.source,
              "). Do not clear the environment before the launched function runs.");
  ACCEL_CHECK(env.rank == rank && env.world_size == o.num_nodes * o.num_processes &&
                  env.local_rank == local_rank && env.local_world_size == o.num_processes,
              "accel: debug launch: worker ", rank, " sees RANK=", env.rank, " WORLD_SIZE=",
              env.world_size, " LOCAL_RANK=", env.local_rank, " LOCAL_WORLD_SIZE=",
              env.local_world_size, ", expected ", rank, "/", o.num_nodes * o.num_processes, "/",
              local_rank, "/", o.num_processes, ". Check what overrides these variables.");
  ACCEL_CHECK(env.master_addr == o.master_addr && env.master_port == o.master_port,
              "accel: debug launch: worker ", rank, " sees MASTER_ADDR:MASTER_PORT ",
              env.master_addr, ":", env.master_port, ", expected ", o.master_addr, ":",
              o.master_port, ". Check what overrides these variables.");
  resolve_ipv4(env.master_addr, env.master_port);  // throws a clear error when unresolvable
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_RANK_ENV_HPP
