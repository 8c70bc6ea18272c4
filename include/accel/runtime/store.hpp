// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::make_store: the rendezvous key-value store
/// (c10d TCPStore on MASTER_ADDR:MASTER_PORT, or a c10d FileStore).
#ifndef ACCEL_RUNTIME_STORE_HPP
#define ACCEL_RUNTIME_STORE_HPP

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <accel/detail/torch_version.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/detail/tcp_probe.hpp>
#include <accel/runtime/detail/wait_reports.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/restart_count.hpp>

namespace accel::runtime {

struct StoreOptions {
  /// How long a rank waits for the master (and rank 0 for every rank to join).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// When set, a c10d FileStore at this path (shared file system) replaces
  /// the TCP store; the file must not be left over from another job. After
  /// a restart (restart_count() N > 0) the path gets ".restart<N>" appended.
  std::optional<std::string> file_path;
};

namespace detail {

inline bool contains(const std::string& text, const char* what) {
  return text.find(what) != std::string::npos;
}

/// c10d reports failures as c10::Error with free text; turn them into
/// accel's errors that say what to do.
[[noreturn]] inline void rethrow_store_error(const std::exception& e, const ProcessEnv& env,
                                             std::chrono::milliseconds timeout) {
  const std::string msg = e.what();
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  if (env.rank == 0 && (contains(msg, "ddress already in use") || contains(msg, "failed to listen") ||
                        contains(msg, "failed to bind")))
    throw Error("accel: rank 0 cannot listen on " + where + ": port " +
                std::to_string(env.master_port) +
                " is already in use (another job, or a previous run still exiting). Choose "
                "another --main_process_port (MASTER_PORT), or 0 to let accel pick a free one.");
  if (contains(msg, "timed out") || contains(msg, "Timed out") || contains(msg, "timeout"))
    throw TimeoutError("accel: rank " + std::to_string(env.rank) + " could not rendezvous with " +
                       where + " within " + std::to_string(timeout.count()) +
                       " ms (" + msg.substr(0, msg.find('\n')) +
                       "). Check that rank 0 is running and MASTER_ADDR/MASTER_PORT are the same "
                       "on every rank, or raise the timeout.");
  throw Error("accel: rendezvous through " + where + " failed on rank " + std::to_string(env.rank) +
              ": " + msg.substr(0, msg.find('\n')) +
              ". Check MASTER_ADDR/MASTER_PORT and that every rank can reach rank 0.");
}

/// Rank 0's store listens on MASTER_ADDR only, not on every interface, where
/// LibTorch lets accel hand it the listening socket (TCPStoreOptions::
/// masterListenFd, LibTorch 2.x; 1.13 has none and listens everywhere). Only
/// for an IPv4 literal: a host name may resolve to IPv6 first, which the
/// clients would then try. An address that is not this machine's (behind
/// NAT) falls back to every interface, as before; a busy port is left to
/// c10d, whose error says so.
template <class Options>
void listen_on_given_address(Options& opts, const ProcessEnv& env) {
  if constexpr (requires { opts.masterListenFd = 0; }) {
    in_addr literal{};
    if (env.master_port == 0 || ::inet_pton(AF_INET, env.master_addr.c_str(), &literal) != 1) return;
    const int fd = bind_tcp(env.master_addr, env.master_port);
    if (fd < 0) return;
    ::listen(fd, 2048);  // every rank connects at once
    opts.masterListenFd = fd;  // the store owns it from here
  }
}

/// Text from the environment as messages quote it: at most 80 characters.
inline std::string shown(const std::string& text) {
  return "'" + (text.size() <= 80 ? text : text.substr(0, 80) + "...") + "'" +
         (text.size() <= 80 ? "" : " (" + std::to_string(text.size()) + " characters)");
}

/// An address that does not resolve is an error now, not a retry loop (c10d
/// retries it until the timeout, logging every second).
inline void check_resolves(const ProcessEnv& env) {
  const std::string& host = env.master_addr;
  const auto fail = [&](const std::string& why) {
    throw Error("accel: rank " + std::to_string(env.rank) + " cannot use MASTER_ADDR " +
                shown(host) + ": " + why + ". Give the host name or IP address of the machine "
                "running rank 0 (accel launch --main_process_ip).");
  };
  if (host.empty() || host.size() > 253) fail("it is not a host name");
  ::addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  ::addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc == 0) {
    ::freeaddrinfo(found);
    return;
  }
  fail(std::string(rc == EAI_AGAIN ? "it cannot be resolved now (" : "it does not resolve (") +
       ::gai_strerror(rc) + ")");
}

// Keys of accel's own join protocol (c10d's ProcessGroups use others).
inline constexpr const char* kJoinedKey = "accel/rendezvous/joined";
inline constexpr const char* kJobKey = "accel/rendezvous/job";
inline std::string joined_key(int rank) {
  std::string key(kJoinedKey);  // appended piecewise: GCC 12 at -O3 warns falsely on temporaries
  key += '/';
  key += std::to_string(rank);
  return key;
}

/// The ranks that have not joined yet, as "ranks 2, 3 (machine 1)".
inline std::string missing_ranks(c10d::Store& store, const ProcessEnv& env) {
  std::vector<int> missing;
  for (int r = 0; r < env.world_size && missing.size() < 16; ++r)
    if (!store.check({joined_key(r)})) missing.push_back(r);
  if (missing.empty()) return "none";
  std::string ranks, machines;
  int last_machine = -1;
  for (int r : missing) {
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    const int machine = r / std::max(1, env.local_world_size);
    if (machine != last_machine) machines += (machines.empty() ? "" : ", ") + std::to_string(machine);
    last_machine = machine;
  }
  return (missing.size() == 1 ? "rank " : "ranks ") + ranks + (missing.size() == 16 ? ", ..." : "") +
         " (machine " + machines + ")";
}

/// Rank 0: every rank has joined, or a TimeoutError saying who has not.
inline void wait_for_ranks(c10d::Store& store, const ProcessEnv& env, std::chrono::milliseconds timeout,
                           const std::string& where, std::ostream& log) {
  WaitReports reports(WaitReports::Clock::now());
  const auto deadline = WaitReports::Clock::now() + timeout;
  while (true) {
    const auto joined = store.add(kJoinedKey, 0);
    if (joined >= env.world_size) return;
    if (WaitReports::Clock::now() >= deadline)
      throw TimeoutError("accel: rank 0 waited " + std::to_string(reports.seconds()) + " s at " +
                         where + " and " + std::to_string(joined) + " of " +
                         std::to_string(env.world_size) + " processes joined; missing: " +
                         missing_ranks(store, env) + ". Start every machine's launch with the "
                         "same --main_process_ip and --main_process_port (MASTER_ADDR/MASTER_PORT), "
                         "check that they can reach this one, or raise --rdzv_timeout.");
    if (reports.due())
      log << "accel: rank 0 waiting at " << where << " for the other processes (" << joined
          << " of " << env.world_size << " joined, missing " << missing_ranks(store, env) << ", "
          << reports.seconds() << " s of " << timeout.count() / 1000 << " s)" << std::endl;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

/// This launch's job id (ACCEL_JOB_ID, set by accel's launchers), if any.
inline std::optional<std::string> job_id() { return getenv_str("ACCEL_JOB_ID"); }

/// A rank that reached another job's store (two launches on one port) leaves
/// before it touches anything there.
inline void check_same_job(c10d::Store& store, const ProcessEnv& env, const std::string& where) {
  const auto mine = job_id();
  if (!mine) return;
  // Rank 0 sets the key right after it starts serving; a store without it
  // after a while belongs to a launch that does not set job ids.
  const auto until = WaitReports::Clock::now() + std::chrono::seconds(10);
  while (!store.check({kJobKey}) && WaitReports::Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::string theirs = "(none)";
  if (store.check({kJobKey})) {
    const auto bytes = store.get(kJobKey);
    theirs.assign(bytes.begin(), bytes.end());
  }
  if (theirs != *mine)
    throw Error("accel: rank " + std::to_string(env.rank) + " reached the store of another job at " +
                where + " (job " + shown(theirs) + "; this is job " + shown(*mine) +
                "): two launches use port " + std::to_string(env.master_port) +
                ". Give each job its own --main_process_port (MASTER_PORT), or 0 to let accel pick.");
}

}  // namespace detail

/// The store every rank of `env` meets in. Rank 0 serves a TCPStore on
/// env.master_port and waits (up to the timeout) for all ranks to connect;
/// the others connect to env.master_addr:env.master_port. With
/// options.file_path, a FileStore instead (no network).
inline c10::intrusive_ptr<c10d::Store> make_store(const ProcessEnv& env, StoreOptions options = {}) {
  if (options.file_path) {
    // A restarted group (elastic launch) must not meet in the file of the
    // attempt that failed: its counters and keys are stale.
    if (const int n = restart_count(); n > 0) *options.file_path += ".restart" + std::to_string(n);
    try {
      auto store = c10::make_intrusive<c10d::FileStore>(*options.file_path, env.world_size);
      store->setTimeout(options.timeout);
      return store;
    } catch (const std::exception& e) {
      throw Error("accel: cannot open the file store '" + *options.file_path + "': " + e.what() +
                  ". Give a path in a writable directory shared by all ranks.");
    }
  }
  ACCEL_CHECK(env.master_port >= 0 && env.master_port <= 65535, "accel: MASTER_PORT ",
              env.master_port, " is not a TCP port. Give a port between 1 and 65535.");
  if (const auto t = detail::getenv_int("ACCEL_RDZV_TIMEOUT")) {
    ACCEL_CHECK(*t > 0, "accel: ACCEL_RDZV_TIMEOUT=", *t, " is not a number of seconds. Give a "
                "positive timeout (accel launch --rdzv_timeout).");
    options.timeout = std::chrono::seconds(*t);
  }
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  detail::check_resolves(env);
  // TCPStore(host, TCPStoreOptions) exists from LibTorch 1.13 through 2.x; the
  // positional constructor is deprecated in 1.13 and gone later.
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0;
  opts.numWorkers = static_cast<std::size_t>(env.world_size);
  // accel waits for the ranks itself (below), saying who is missing; c10d's
  // own wait is silent for the whole timeout.
  opts.waitWorkers = false;
  opts.timeout = options.timeout;
#if ACCEL_TORCH_AT_LEAST(2, 4)
  // From 2.4 TCPStore defaults to a libuv server, which Debian's and other
  // source builds of LibTorch lack ("use_libuv was requested but PyTorch was
  // build without libuv support"); the classic server is in every build.
  opts.useLibUV = false;
#endif
  if (opts.isServer) detail::listen_on_given_address(opts, env);
  std::ostream& log = std::cerr;
  detail::WaitReports reports(detail::WaitReports::Clock::now());
  const auto deadline = detail::WaitReports::Clock::now() + options.timeout;
  if (!opts.isServer) {
    // Until rank 0's port answers, say what we wait for (c10d's own connect
    // retries are silent, and differ between LibTorch versions).
    while (true) {
      const int err = detail::try_connect(env.master_addr, env.master_port, std::chrono::seconds(1));
      if (err == 0) break;
      if (detail::WaitReports::Clock::now() >= deadline)
        throw TimeoutError("accel: rank " + std::to_string(env.rank) + " could not rendezvous with " +
                           where + " within " + std::to_string(options.timeout.count()) +
                           " ms (nothing accepted a connection there: " + std::strerror(err) +
                           "). Check that rank 0 is running and MASTER_ADDR/MASTER_PORT are the "
                           "same on every rank, or raise the timeout (--rdzv_timeout).");
      if (reports.due())
        log << "accel: rank " << env.rank << " waiting for rank 0 at " << where << " ("
            << reports.seconds() << " s of " << options.timeout.count() / 1000
            << " s): is rank 0 started, and is this its address?" << std::endl;
      if (err == ECONNREFUSED) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    opts.timeout = std::max(std::chrono::milliseconds(1000),
                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                deadline - detail::WaitReports::Clock::now()));
  }
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    detail::rethrow_store_error(e, env, options.timeout);
  }
  store->setTimeout(options.timeout);
  try {
    if (env.rank == 0) {
      if (const auto job = detail::job_id()) store->set(detail::kJobKey, std::vector<uint8_t>(job->begin(), job->end()));
    } else {
      detail::check_same_job(*store, env, where);
    }
    store->set(detail::joined_key(env.rank), std::vector<uint8_t>{1});
    store->add(detail::kJoinedKey, 1);
    if (env.rank == 0) detail::wait_for_ranks(*store, env, options.timeout, where, log);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    detail::rethrow_store_error(e, env, options.timeout);
  }
  return store;
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_STORE_HPP
