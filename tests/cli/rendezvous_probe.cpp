// A worker for the `accel launch` tests: it meets the other ranks in the c10d
// store at MASTER_ADDR:MASTER_PORT, as every accel backend does, publishes its
// NODE_RANK and prints what every rank published.
#include <chrono>
#include <thread>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <accel/runtime/store.hpp>

int main() try {
  const auto env = accel::runtime::ProcessEnv::discover();
  accel::runtime::StoreOptions options;
  options.timeout = std::chrono::seconds(60);
  auto store = accel::runtime::make_store(env, options);
  const char* node = std::getenv("NODE_RANK");
  const std::string mine = node ? node : "?";
  store->set("node_of_" + std::to_string(env.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back("node_of_" + std::to_string(r));
  store->wait(keys);
  std::string nodes;
  for (const auto& k : keys) {
    const auto v = store->get(k);
    if (!nodes.empty()) nodes.push_back(',');
    nodes.append(v.begin(), v.end());
  }
  // Rank 0 hosts the store: it leaves last, so that no rank loses it mid-get.
  store->add("done", 1);
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  if (env.rank == 0)
    while (store->add("done", 0) < env.world_size) {
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("ranks left early");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  std::cout << "rank " << env.rank << "/" << env.world_size << " met all ranks on port "
            << env.master_port << " nodes=" << nodes << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << std::endl;
  return 1;
}
