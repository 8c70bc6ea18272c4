// SPDX-License-Identifier: Apache-2.0
/// @file Defines try_connect: one TCP connection attempt with a timeout, to
/// learn whether a rendezvous address answers before c10d is asked to use it.
#ifndef ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP
#define ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>

namespace accel::runtime::detail {

/// Connects to host:port (each address it resolves to, in order) and closes
/// again. Returns 0 when something accepted, else the errno of the last
/// attempt: ECONNREFUSED (the host answered, nobody listens there),
/// ETIMEDOUT (no answer within `timeout`), EHOSTUNREACH ..., or EADDRNOTAVAIL
/// when the host does not resolve.
inline int try_connect(const std::string& host, int port, std::chrono::milliseconds timeout) {
  ::addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  ::addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return EADDRNOTAVAIL;
  int err = EADDRNOTAVAIL;
  for (const ::addrinfo* a = found; a != nullptr; a = a->ai_next) {
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
    ::close(fd);
    if (err == 0) break;
  }
  ::freeaddrinfo(found);
  return err;
}

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP
