// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::make_store: the rendezvous key-value store
/// (c10d TCPStore on MASTER_ADDR:MASTER_PORT, or a c10d FileStore).
#ifndef ACCEL_RUNTIME_STORE_HPP
#define ACCEL_RUNTIME_STORE_HPP

#include <chrono>
#include <exception>
#include <optional>
#include <string>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <accel/detail/torch_version.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::runtime {

struct StoreOptions {
  /// How long a rank waits for the master (and rank 0 for every rank to join).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// When set, a c10d FileStore at this path (shared file system) replaces
  /// the TCP store; the file must not be left over from another job.
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

}  // namespace detail

/// The store every rank of `env` meets in. Rank 0 serves a TCPStore on
/// env.master_port and waits (up to the timeout) for all ranks to connect;
/// the others connect to env.master_addr:env.master_port. With
/// options.file_path, a FileStore instead (no network).
inline c10::intrusive_ptr<c10d::Store> make_store(const ProcessEnv& env, StoreOptions options = {}) {
  if (options.file_path) {
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
  // TCPStore(host, TCPStoreOptions) exists from LibTorch 1.13 through 2.x; the
  // positional constructor is deprecated in 1.13 and gone later.
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0;
  opts.numWorkers = static_cast<std::size_t>(env.world_size);
  opts.waitWorkers = true;
  opts.timeout = options.timeout;
#if ACCEL_TORCH_AT_LEAST(2, 4)
  // From 2.4 TCPStore defaults to a libuv server, which Debian's and other
  // source builds of LibTorch lack ("use_libuv was requested but PyTorch was
  // build without libuv support"); the classic server is in every build.
  opts.useLibUV = false;
#endif
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    detail::rethrow_store_error(e, env, options.timeout);
  }
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_STORE_HPP
