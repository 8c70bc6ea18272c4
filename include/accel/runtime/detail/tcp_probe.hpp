// SPDX-License-Identifier: Apache-2.0
/// @file Defines connect_tcp and try_connect (one TCP connection attempt with a
/// timeout: does a rendezvous address answer before c10d is asked to use it;
/// the launchers of several machines) and bind_tcp (a listening socket on the
/// address given, not on every interface).
#ifndef ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP
#define ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>

namespace accel::runtime::detail {

/// Connects to host:port (each address it resolves to, in order) within
/// `timeout`. Returns the connected non-blocking, close-on-exec descriptor,
/// or -1 with `err` set to the errno of the last attempt: ECONNREFUSED (the
/// host answered, nobody listens there), ETIMEDOUT (no answer within
/// `timeout`), EHOSTUNREACH ..., or EADDRNOTAVAIL when the host does not resolve.
inline int connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout, int& err) {
  ::addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  ::addrinfo* found = nullptr;
  err = EADDRNOTAVAIL;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int connected = -1;
  for (const ::addrinfo* a = found; a != nullptr && connected < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      ::pollfd p{fd, POLLOUT, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
      socklen_t len = sizeof err;
      if (ready == 0) err = ETIMEDOUT;
      else if (ready < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
    if (err == 0) connected = fd;
    else ::close(fd);
  }
  ::freeaddrinfo(found);
  return connected;
}

/// Connects to host:port and closes again: 0 when something accepted, else
/// connect_tcp's errno.
inline int try_connect(const std::string& host, int port, std::chrono::milliseconds timeout) {
  int err = 0;
  const int fd = connect_tcp(host, port, timeout, err);
  if (fd >= 0) ::close(fd);
  return err;
}

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

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP
