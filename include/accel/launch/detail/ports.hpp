// SPDX-License-Identifier: Apache-2.0
/// @file Defines free-port selection and the "is this port taken" check used
/// before a rendezvous is hosted on main_process_port.
#ifndef ACCEL_LAUNCH_DETAIL_PORTS_HPP
#define ACCEL_LAUNCH_DETAIL_PORTS_HPP

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>

#include <accel/errors.hpp>
#include <accel/runtime/detail/tcp_probe.hpp>

namespace accel::detail::launch {

using runtime::detail::bind_tcp;

/// A port that is free on addr now (the kernel's choice for port 0). Another
/// process may take it before we use it; the window is short, and the
/// rendezvous then fails with the port in its message.
inline int pick_free_port(const std::string& addr = "127.0.0.1") {
  const int fd = bind_tcp(addr, 0);
  if (fd < 0)
    throw Error("accel: cannot find a free port on " + addr + " (" + std::strerror(-fd) +
                "). Pass a fixed --main_process_port.");
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  const int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  if (rc != 0)
    throw Error("accel: cannot read back the free port chosen on " + addr +
                ". Pass a fixed --main_process_port.");
  return ntohs(sa.sin_port);
}

/// 0 when addr:port can be listened on now (bound and released at once),
/// else -errno: -EADDRINUSE when something holds it.
inline int bind_error(const std::string& addr, int port) {
  const int fd = bind_tcp(addr, port);
  if (fd < 0) return fd;
  ::close(fd);
  return 0;
}

/// Throws when addr:port cannot be listened on because something holds it.
inline void ensure_port_free(const std::string& addr, int port) {
  const int err = bind_error(addr, port);
  if (err == -EADDRINUSE)
    throw Error("accel: port " + std::to_string(port) + " on " + addr +
                " is already in use. Pick another --main_process_port, or pass "
                "--main_process_port 0 to let accel choose a free one.");
  if (err == -EACCES)
    throw Error("accel: port " + std::to_string(port) + " needs privileges to listen on. Pick " +
                "a --main_process_port above 1023, or 0 to let accel choose.");
}

/// Removes a file on scope exit (node 0's rendezvous file, once its launch ends).
class RemoveAtExit {
 public:
  explicit RemoveAtExit(std::string path) : path_(std::move(path)) {}
  RemoveAtExit(const RemoveAtExit&) = delete;
  RemoveAtExit& operator=(const RemoveAtExit&) = delete;
  ~RemoveAtExit() { std::remove(path_.c_str()); }

 private:
  std::string path_;
};

/// Several nodes: node 0 takes `preferred` if it is free on addr (0: none),
/// else a free port, and publishes it in `file` (written beside it, then
/// renamed: readers see all of it or nothing); every other node waits for the
/// file until `deadline`. A file left by an earlier launch is replaced.
inline int agree_on_free_port(const std::string& file, int node_rank, const std::string& addr,
                              std::chrono::steady_clock::time_point deadline, int preferred = 0) {
  namespace fs = std::filesystem;
  constexpr const char* kTag = "accel-rendezvous-port";
  if (node_rank == 0) {
    int port = preferred;
    if (port != 0 && bind_error(addr, port) != 0) port = 0;
    if (port == 0) port = pick_free_port(addr);
    const fs::path tmp = file + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << kTag << ' ' << port << '\n';
      out.flush();
      if (!out)
        throw Error("accel: cannot write the rendezvous file '" + tmp.string() +
                    "'. Give a rendezvous_file in a writable directory that all nodes share.");
    }
    std::error_code ec;
    fs::rename(tmp, file, ec);
    if (ec)
      throw Error("accel: cannot create the rendezvous file '" + file + "' (" + ec.message() +
                  "). Give a rendezvous_file in a writable directory that all nodes share.");
    return port;
  }
  for (;;) {
    std::ifstream in(file);
    std::string tag;
    int port = 0;
    if (in >> tag >> port) {
      if (tag != kTag || port < 1 || port > 65535)
        throw Error("accel: '" + file + "' is not an accel rendezvous file (read '" + tag + " " +
                    std::to_string(port) + "'). Give a path that only accel launches use.");
      return port;
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw TimeoutError("accel: node " + std::to_string(node_rank) +
                         " waited for node 0 to write the port it chose to '" + file +
                         "' until the launch timeout. Start node 0 with the same rendezvous_file "
                         "(a path all nodes see), or pass the same fixed master_port everywhere.");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_PORTS_HPP
