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
#include <cstring>
#include <string>

#include <accel/errors.hpp>

namespace accel::detail {

/// An IPv4 TCP socket bound to addr:port (SO_REUSEADDR, as c10d's TCPStore
/// sets it, so sockets in TIME_WAIT do not count as taken). Returns the fd
/// or -errno.
inline int bind_tcp(const std::string& addr, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  // An address of this machine we cannot bind to (a hostname, another host's
  // address) still tells us whether the port is free on all interfaces.
  if (addr.empty() || ::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1)
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  if (rc != 0 && errno == EADDRNOTAVAIL) {  // not one of our addresses: try all of them
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  }
  if (rc != 0 || ::listen(fd, 1) != 0) {
    const int err = errno;
    ::close(fd);
    return -err;
  }
  return fd;
}

/// A port that is free on addr now (the kernel's choice for port 0). Another
/// process may take it before we use it; the window is short.
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

/// Throws when addr:port cannot be listened on because something holds it.
inline void ensure_port_free(const std::string& addr, int port) {
  const int fd = bind_tcp(addr, port);
  if (fd >= 0) {
    ::close(fd);
    return;
  }
  if (fd == -EADDRINUSE)
    throw Error("accel: port " + std::to_string(port) + " on " + addr +
                " is already in use. Pick another --main_process_port, or pass "
                "--main_process_port 0 to let accel choose a free one.");
  if (fd == -EACCES)
    throw Error("accel: port " + std::to_string(port) + " needs privileges to listen on. Pick " +
                "a --main_process_port above 1023, or 0 to let accel choose.");
}

}  // namespace accel::detail

#endif  // ACCEL_LAUNCH_DETAIL_PORTS_HPP
