// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::LaunchOptions, what notebook_launcher (and the `accel
/// launch` command) needs to know to start the processes of one node.
#ifndef ACCEL_LAUNCH_LAUNCH_OPTIONS_HPP
#define ACCEL_LAUNCH_LAUNCH_OPTIONS_HPP

#include <chrono>
#include <optional>
#include <string>

namespace accel {

/// Where and how many workers to start. The first six fields are the API.md
/// contract; the ones after them are accel extensions with neutral defaults.
struct LaunchOptions {
  int num_processes = 1;  ///< workers on this node
  int num_nodes = 1;      ///< nodes taking part (each runs its own launcher)
  int node_rank = 0;      ///< this node's index, 0 .. num_nodes-1
  std::string master_addr = "127.0.0.1";  ///< rendezvous host (node 0)
  int master_port = 29500;  ///< rendezvous port; 0: pick a free one (several nodes: see rendezvous_file)
  std::chrono::seconds timeout{1800};  ///< bound on the whole launch

  /// Exported as ACCEL_MIXED_PRECISION ("no", "fp16", "bf16") when set.
  std::optional<std::string> mixed_precision = std::nullopt;
  /// Prefix each worker's output lines with "[rank N] " (captured through pipes).
  bool prefix_output = false;
  /// Between SIGTERM and SIGKILL when the other workers are stopped.
  std::chrono::milliseconds stop_grace{std::chrono::seconds{5}};
  /// With several nodes and master_port 0: a file path every node can read
  /// (a shared filesystem). Node 0 picks a free port and writes it there;
  /// the other nodes wait for it. Node 0 removes the file when its launch ends.
  std::optional<std::string> rendezvous_file = std::nullopt;

  // --- elastic restarts (API.md section 7; docs/launching.md "Fault tolerance") ---
  /// When a worker fails (throws, exits non-zero, dies by a signal, or hangs:
  /// monitor_interval), every worker is stopped and the whole group started
  /// again, up to this many times; each attempt sees TORCHELASTIC_RESTART_COUNT
  /// (accel::restart_count()). Several nodes: every node's launcher restarts
  /// together (node 0's coordinates on master_port; docs/launching.md).
  int max_restarts = 0;
  /// Hang detection: a worker that made progress (runtime::heartbeat(): each
  /// batch of a prepared loader, each completed collective) and then makes
  /// none for this long is killed and counts as failed. Unset: none.
  std::optional<std::chrono::seconds> monitor_interval = std::nullopt;
};

}  // namespace accel

#endif  // ACCEL_LAUNCH_LAUNCH_OPTIONS_HPP
